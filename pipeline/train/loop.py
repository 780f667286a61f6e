"""The Ray Train worker loop: data in, FSDP2 steps, metrics and checkpoints out.

Data: each epoch has one shard order, a pure function of (seed, epoch). Rank r streams
`order[r::world]` through its own Ray Data pipeline (read -> decode -> crop -> patchify), so which
sample lands on which rank at which step is deterministic, and a resumed run picks up exactly the
shards no rank had started. (Ray's `get_dataset_shard` balances blocks across workers on demand,
which is neither reproducible nor resumable mid-epoch; that is why the split is done here.)
Every step, ranks agree on whether all of them have a full step of data; the first rank to run
dry ends the epoch for all, so no rank waits in a collective that the others never join.
"""

from __future__ import annotations

import logging
import resource
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import Checkpoint

from pipeline import dcp, storage
from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples, LabelsMissingError
from pipeline.data.config import DataConfig, shard_order
from pipeline.data.dataset import Batch, micro_batches
from pipeline.train import checkpoint
from pipeline.train.config import TrainConfig, data_config
from pipeline.train.metrics import MetricsLog, format_line, log_line
from pipeline.train.model import build_model, model_config
from pipeline.train.resources import data_cpus_per_worker
from pipeline.train.step import TrainStep, peak_tflops, train_flops_per_image


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every Ray Train worker (see `pipeline.trainer.fit`); returns the run summary."""
    config = TrainConfig.from_dict(loop_config["train"])
    shards: list[str] = loop_config["shards"]
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # a line per rank per epoch otherwise
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    mcfg = model_config(config)
    dcfg = data_config(config, mcfg.patch_size)
    accum = config.batch_size // (config.micro_batch_size * world)

    model = build_model(config, device)
    step_fn = TrainStep(model, config, device)
    state: dict[str, Any] = {"step": 0, "epoch": 0, "shards_started": [], "seed": config.seed}
    resumed = ray.train.get_checkpoint()
    if resumed is not None:
        with resumed.as_directory() as directory:
            checkpoint.check_compatible(directory, mcfg)
            state = checkpoint.load(directory, model, step_fn.optimizer)
        if rank == 0:
            log_line(f"resumed from {resumed.path} at step {state['step']} (epoch {state['epoch']})")
    log = MetricsLog(config.out, resume_step=state["step"]) if rank == 0 else None
    saved_config = {"train": config.to_dict(), "model_config": mcfg.to_dict(), "data": dcfg.to_dict()}
    peak, peak_note = peak_tflops(device)
    nodes = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    if rank == 0:
        log_line(
            f"{mcfg.name}: {world} workers on {len(set(nodes))} node(s), {config.micro_batch_size} images x "
            f"{accum} accumulation each = batch {config.batch_size}; {len(shards)} shards; {peak_note}"
        )

    bad = BadSamples.from_config(dcfg)
    step, last_step = state["step"], config.last_step
    first_step, run_start = step, time.perf_counter()
    window = _new_window()
    last_metrics: dict[str, Any] = {}
    error = ""
    while step < last_step and not error:
        epoch = state["epoch"]
        started = set(state["shards_started"])
        remaining = [s for s in shard_order(shards, config.seed, epoch) if s not in started]
        stream = micro_batches(
            remaining[rank::world],
            dcfg,
            epoch=epoch,
            rank=rank,
            size=config.micro_batch_size,
            bad_samples=bad,
            data_cpus=loop_config["data_cpus_per_worker"] or data_cpus_per_worker(config, world, rank, epoch),
        )
        epoch_steps = 0
        while step < last_step:
            wait_start = time.perf_counter()
            batches, error = _take(stream, accum)
            window["wait"] += time.perf_counter() - wait_start
            local = sum(len(b["label"]) for b in batches)
            agree = torch.tensor(
                [local, len(batches) < accum, bool(error)], dtype=torch.float64, device=device
            )
            dist.all_reduce(agree)
            if agree[2] > 0:
                error = _first_error(error)
                break
            if agree[1] > 0:  # some rank ran dry: the epoch is over for everyone
                break
            for b in batches:
                started.update(b["url"].tolist())
            tensors = [(to_device(b["patches"], device), to_device(b["label"], device)) for b in batches]
            stats = step_fn(step, tensors, global_count=int(agree[0]))
            step += 1
            epoch_steps += 1
            window["loss"] += stats.loss_sum.item()
            window["correct"] += stats.correct.item()
            window["count"] += stats.count

            save_now = step % config.checkpoint_every == 0 or step == last_step
            if step % config.log_every and not save_now:
                continue
            last_metrics = _reduce_metrics(window, stats, step, epoch, bad, world, device, mcfg, peak)
            if rank == 0:
                log_line(format_line(last_metrics, last_step, run_start, first_step))
                log.append(last_metrics, flush=save_now)
            if save_now:
                state = {**state, "step": step, "shards_started": _union_started(started)}
                _save_and_report(model, step_fn.optimizer, state, saved_config, last_metrics)
            else:
                ray.train.report(last_metrics)
            # A new measuring window, started after any checkpoint so it does not count as training time.
            window = _new_window()
        stream.close()  # stops this epoch's Ray Data execution if it is still running
        if error or step >= last_step:
            break
        if epoch_steps == 0 and not started:
            error = (
                f"epoch {epoch} gave no full step: {len(shards)} shards hold fewer than "
                f"{config.batch_size} readable samples per step across {world} workers; "
                "use more data or a smaller --batch-size"
            )
            break
        state = {**state, "epoch": epoch + 1, "shards_started": []}

    # What the driver gets back (rank 0's return value): the last metrics, every rank's bad
    # samples merged, and the error all ranks stopped on, if any.
    bad_all = [None] * world
    dist.all_gather_object(bad_all, bad.to_dict())
    merged = BadSamples.from_config(dcfg)
    for counts in bad_all:
        merged.merge(counts)
    if not error:
        _export(model, mcfg, config, dcfg, last_metrics, step)
    return {"metrics": last_metrics, "bad_samples": merged.to_dict(), "error": error}


def _new_window() -> dict[str, float]:
    return {"loss": 0.0, "correct": 0.0, "count": 0.0, "wait": 0.0, "start": time.perf_counter()}


def _take(stream: Iterator[Batch], n: int) -> tuple[list[Batch], str]:
    """Up to n micro-batches from the stream, and the message of a data error if one stops it."""
    out: list[Batch] = []
    try:
        for _ in range(n):
            out.append(next(stream))
    except StopIteration:
        pass
    except (BadSampleBudgetError, LabelsMissingError) as e:  # one line each, saying what to do
        return out, str(e)
    return out, ""


def _first_error(mine: str) -> str:
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, mine)
    return next(e for e in errors if e)


def _union_started(started: set[str]) -> list[str]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(started))
    return sorted(set().union(*gathered))


def _reduce_metrics(window, stats, step, epoch, bad, world, device, mcfg, peak) -> dict[str, Any]:
    elapsed = time.perf_counter() - window["start"]
    sums = torch.tensor(
        [window["loss"], window["correct"], window["count"], window["wait"], bad.total, bad.bad],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(sums)
    loss, correct, count, wait, seen, n_bad = sums.tolist()
    memory = torch.tensor([_memory_gib(device)], dtype=torch.float64, device=device)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    images_per_s = count / elapsed
    mfu = None
    if peak:
        mfu = images_per_s * train_flops_per_image(mcfg) / (world * peak * 1e12)
    return {
        "step": step,
        "epoch": epoch,
        "loss": loss / max(count, 1),
        "accuracy": correct / max(count, 1),
        "lr": stats.lr,
        "grad_norm": stats.grad_norm.item(),
        "images_per_s": images_per_s,
        "images_per_s_per_worker": images_per_s / world,
        "mfu": mfu,
        "data_wait_share": wait / (world * elapsed),
        "samples_seen": int(seen),
        "bad_samples": int(n_bad),
        "memory_gib": memory.item(),
    }


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def _save_and_report(model, optimizer, state, saved_config, metrics) -> None:
    with tempfile.TemporaryDirectory(prefix="vitray-ckpt-") as tmp:
        checkpoint.save(tmp, model, optimizer, state, saved_config)
        ray.train.report(
            metrics,
            checkpoint=Checkpoint.from_directory(tmp),
            checkpoint_dir_name=dcp.checkpoint_name(state["step"]),
        )


def _export(model, mcfg, config: TrainConfig, dcfg: DataConfig, metrics: dict[str, Any], step: int) -> None:
    extra = {
        "preprocessing": dcfg.to_dict(),
        "training": {
            "step": step,
            "max_steps": config.max_steps,
            "finished": step >= config.max_steps,
            "loss": metrics.get("loss"),
            "accuracy": metrics.get("accuracy"),
            "config": config.to_dict(),
        },
    }
    with tempfile.TemporaryDirectory(prefix="vitray-final-") as tmp:
        if checkpoint.export_final(tmp, model, mcfg, extra) is not None:
            storage.upload_dir(tmp, storage.join(config.out, "final"), commit_last="config.json")
            log_line(f"exported {storage.join(config.out, 'final')}")
