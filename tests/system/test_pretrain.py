"""Pretraining under Ray Train: 2 CPU workers (gloo, FSDP2), a tiny ViT, synthetic shards.

Arithmetic the resume tests rely on: 4 shards x 16 samples, 2 workers x micro-batch 8, batch 16
-> every rank reads 2 shards (32 samples) an epoch = exactly 4 steps, so step 6 is the middle of
epoch 1. The runs resumed are `jobs/pretrain.py`'s config, 12 steps, and end with the weights of the
system tests' straight run (`tests/system/conftest.py`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline import dcp
from pipeline.train import presets
from pipeline.train.audit import AuditConfig, audit_run
from pipeline.train.checkpointing import checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.driver import fit, read_metrics
from tests.configs import tiny_config
from tests.system.conftest import TRAINING

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from pipeline.data.synthetic import write_synthetic_shards

    out = tmp_path_factory.mktemp("train_shards")
    return write_synthetic_shards(out, 64, samples_per_shard=16, image_size=32, num_classes=4, seed=1)


def config(shards, out: Path, **changes) -> TrainConfig:
    """The tiny config on 2 workers over ``shards``, 8 steps, writing under ``out``."""
    return tiny_config(
        data=",".join(shards.urls), out=str(out), batch_size=16, num_workers=2, max_steps=8, log_every=2,
        checkpoint_every=4, keep_checkpoints=5, shuffle_buffer=16, max_failures=0,
    ).replace(**changes)  # fmt: skip


def job_config(urls: list[str], out: Path, *flags: str) -> TrainConfig:
    """`jobs/pretrain.py`'s config for the straight run's training over ``urls``, with ``flags``."""
    args = ["--data", ",".join(urls), "--out", str(out), *TRAINING, "--log-every", "2", "--keep-checkpoints", "5",
            *flags]  # fmt: skip
    return presets.resolve(presets.pretrain_parser().parse_args(args))


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    # Copies: load_file memory-maps, and the file may be replaced by a later run.
    return {k: v.clone() for k, v in load_file(out / "final" / "weights.safetensors").items()}


def ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1:
        status = (Path("/proc") / str(pid) / "status").read_text()
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        found.add(pid)
    return found


def train_workers() -> list[int]:
    """This test process's Ray Train workers: RayTrainWorker processes descending from it through the
    local Ray it started. Another run on the same machine (a second test session) is left alone."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if b"RayTrainWorker" in (proc / "cmdline").read_bytes() and os.getpid() in ancestors(
                    int(proc.name)
                ):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def registered(out: Path, step: int) -> bool:
    """Checkpoint `step` is complete and Ray Train has registered it (only a registered checkpoint is
    resumed from: files that landed just before a kill may not be yet)."""
    snapshot = out / "checkpoint_manager_snapshot.json"  # Ray Train's record of reported checkpoints
    name = dcp.checkpoint_name(step)
    return dcp.is_complete(out / name) and snapshot.is_file() and name in snapshot.read_text()


@pytest.fixture(scope="module")
def killed_run(straight_run, tmp_path_factory):
    """The system tests' straight run, and the same run with a checkpoint every 2 and a worker SIGKILLed
    once checkpoint 6 (the middle of epoch 1) is registered: (straight run dir, killed run dir, its
    summary, the victim).

    The first attempt's write of checkpoint 8 is held (the saver's test hook), so that attempt cannot
    pass the save of checkpoint 10, which waits for it: the kill lands mid-run however slowly the
    test sees checkpoint 6 registered (unheld, a loaded machine let the run reach its last checkpoint
    first, leaving nothing to resume). The attempt after the kill is not held."""
    shards, straight = straight_run.shards, straight_run.out
    out = tmp_path_factory.mktemp("killed") / "run"
    cfg = job_config(shards.urls, out, "--checkpoint-every", "2", "--max-failures", "2")
    result: dict = {}

    def held_first_attempt(loop_config: dict) -> dict:
        import ray.train

        from pipeline.train.checkpointing.saver import WRITE_DELAY_ENV
        from pipeline.train.loop import train_loop_per_worker

        if ray.train.get_checkpoint() is None:
            os.environ[WRITE_DELAY_ENV] = "8:600"
        else:
            os.environ.pop(WRITE_DELAY_ENV, None)
        return train_loop_per_worker(loop_config)

    def run() -> None:
        try:
            result["summary"] = fit(cfg, shards.urls, worker_loop=held_first_attempt)
        except Exception as e:  # the assertion below shows it
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + 180
    while not registered(out, 6) and time.time() < deadline and thread.is_alive():
        time.sleep(0.05)
    assert registered(out, 6), f"no checkpoint 6 to resume from: {result}"
    victims = train_workers()
    assert len(victims) == 2, f"expected this run's 2 training workers, found {victims}"
    os.kill(victims[1], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive(), "the run did not finish after a worker was killed"
    assert "error" not in result, result.get("error")
    return straight, out, result["summary"], victims[1]


def test_a_killed_worker_is_replaced_and_the_run_resumes_mid_epoch_as_if_never_stopped(killed_run):
    """The new worker group resumes from checkpoint 6, mid-epoch (4 steps an epoch), re-reads what
    each rank had taken, and ends with the uninterrupted run's weights."""
    straight, out, summary, victim = killed_run
    assert summary["metrics"]["step"] == 12
    assert victim not in train_workers()

    # The last attempt resumed (the worker's "resumed from ... at step N" line) from the checkpoint
    # registered before the kill (8's write was held), in epoch 1.
    resumed = summary["resumed_from"]
    assert resumed is not None, "the run started over instead of resuming"
    assert (resumed["step"], resumed["epoch"]) == (6, 1)
    assert resumed["checkpoint"].rstrip("/").endswith(dcp.checkpoint_name(resumed["step"]))
    steps = [r["step"] for r in read_metrics(str(out))]
    assert steps == list(range(2, 13, 2))  # one history: the rows after the resumed step were rewritten

    a, b = final_weights(straight), final_weights(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninterrupted run"
    # Its audit, as a user runs it: every sample of its 3 epochs trained once.
    audit = subprocess.run(
        [sys.executable, "jobs/audit.py", "--run", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.splitlines()[-1].startswith(
        "ok: every good sample of 2 finished epoch(s) trained once"
    )


def test_shards_moved_to_another_directory_between_a_stop_and_its_resume_train_on_at_the_sample(
    straight_run, tmp_path
):
    """Seeds and the stream's fingerprint come from the shards' names within their dataset, not
    where they lie: a copy trains like the original, and a run stopped mid-epoch and resumed after its
    data moved goes on at the sample, ending with the uninterrupted run's weights."""
    shards, straight = straight_run.shards, straight_run.out
    here, there = tmp_path / "copy", tmp_path / "moved" / "elsewhere"
    shutil.copytree(shards.dir, here)

    def moved_to(directory: Path) -> list[str]:
        return [str(directory / Path(url).name) for url in shards.urls]

    out = tmp_path / "run"
    urls = moved_to(here)
    fit(job_config(urls, out, "--checkpoint-every", "2", "--stop-at-step", "6"), urls)
    there.parent.mkdir()
    shutil.move(here, there)
    urls = moved_to(there)
    summary = fit(job_config(urls, out, "--checkpoint-every", "2"), urls)
    assert summary["resumed_from"]["step"] == 6 and summary["metrics"]["step"] == 12
    a, b = final_weights(straight), final_weights(out)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the run on the original shards"
    report = audit_run(AuditConfig(run=str(out)))  # its ledger against the shards where they are now
    assert report.ok and report.finished == 2, report.format()


def test_two_worker_checkpoint_loads_in_one_process(killed_run):
    _, out, _, _ = killed_run
    exported = final_weights(out)  # step 12, as checkpoint 12 holds it
    # In a subprocess: a world of one (gloo, FSDP2 over 1 rank) loads the 2-rank DCP checkpoint and
    # must hold exactly what the 2-worker run exported at the same step.
    code = f"""
import torch
from pipeline.train.checkpointing import checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.step.model import build_model, init_distributed
from pipeline.train.step.train_step import TrainStep
_, world, device = init_distributed()
assert world == 1
cfg = TrainConfig.from_dict({job_config([], out).replace(num_workers=1).to_dict()!r})
model = build_model(cfg.replace(seed=123), device)
state = checkpoint.load({str(out / dcp.checkpoint_name(12))!r}, model, TrainStep(model, cfg, device).optimizer)
assert state["step"] == 12, state
for name, value in model.state_dict().items():
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    torch.save(full, {str(out.parent)!r} + "/" + name + ".pt")
print("loaded", len(model.state_dict()), "tensors")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"loaded {len(exported)} tensors" in result.stdout
    for name, value in exported.items():
        assert torch.equal(torch.load(out.parent / f"{name}.pt"), value), name


def test_uneven_shards_train_every_sample_each_epoch_and_keep_and_log_as_told(ray_session, tmp_path):
    """5 shards of 13, 13, 13, 13 and 12 samples for 2 workers: in each epoch one worker reads 3 shards
    (38 or 39 samples: 4 micro-batches of 8 and a short one), the other 2 (25 or 26: 3 and a short
    one), so each epoch takes 5 steps, the last with one worker idle, and trains all 64 samples; no
    collective may hang there. --keep-checkpoints 1 leaves only the newest checkpoint; --tensorboard
    writes every logged scalar."""
    from pipeline.data.synthetic import write_synthetic_shards
    from pipeline.train.observe.sinks import TENSORBOARD_DIR
    from tests.train.test_sinks import read_scalars

    uneven = write_synthetic_shards(
        tmp_path / "shards", 64, samples_per_shard=13, image_size=32, num_classes=4, seed=3
    )
    assert len(uneven.urls) == 5
    out = tmp_path / "run"
    cfg = config(
        uneven, out, max_steps=10, log_every=5, checkpoint_every=5, keep_checkpoints=1, tensorboard=True
    )
    summary = fit(cfg, uneven.urls)
    assert summary["metrics"]["step"] == 10
    rows = read_metrics(str(out))
    assert [(r["step"], r["epoch"], r["samples_seen"]) for r in rows] == [(5, 0, 64), (10, 1, 128)]
    assert sorted(p.name for p in out.glob("checkpoint_*") if p.is_dir()) == [dcp.checkpoint_name(10)]
    losses = read_scalars(out / TENSORBOARD_DIR)["train/loss"]
    assert losses == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in rows}


def test_vit_h14_builds_shards_steps_and_checkpoints_on_two_cpu_workers(ray_session, tmp_path):
    """The real ViT-H/14 (632M parameters; at 28 px, 4 patches, to keep the CPU step short): each of 2
    gloo workers holds about half of every parameter, takes one optimizer step on one image with the
    AdamW kernels a GPU run uses (fused: on a CPU too, and about 4x faster here than foreach), and
    writes its half of a DCP checkpoint (model + AdamW state)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(cfg: dict) -> dict:
        import torch.distributed as dist

        from pipeline.train.step.model import build_model, model_config
        from pipeline.train.step.optim import optimizer_kernels
        from pipeline.train.step.train_step import TrainStep

        config = TrainConfig.from_dict(cfg["train"])
        mcfg = model_config(config)
        times = {"start": time.perf_counter()}
        model = build_model(config, torch.device("cpu"))
        times["build"] = time.perf_counter()
        local = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        shares = [None, None]
        dist.all_gather_object(
            shares, {n: p.to_local().numel() / p.numel() for n, p in model.named_parameters()}
        )
        g = torch.Generator().manual_seed(dist.get_rank())
        patches = torch.randint(0, 256, (1, mcfg.num_patches, mcfg.patch_dim), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, config.arch.num_classes, (1,), generator=g)
        step = TrainStep(model, config, torch.device("cpu"))
        before = {n: p.to_local().flatten()[:256].clone() for n, p in model.named_parameters()}
        stats = step(0, [(patches, labels)], global_count=2)
        unmoved = [
            n for n, p in model.named_parameters() if torch.equal(p.to_local().flatten()[:256], before[n])
        ]
        times["step"] = time.perf_counter()
        state = {"step": 1, "epoch": 0}
        checkpoint.save(cfg["directory"], model, step.optimizer, state, {"model_config": mcfg.to_dict()})
        times["save"] = time.perf_counter()
        seconds = {k: round(times[k] - times[p], 1) for p, k in itertools.pairwise(times)}
        return {"local": local, "total": total, "shares": shares, "loss": stats.loss_sum.item(),
                "grad_norm": stats.grad_norm.item(), "unmoved": unmoved, "seconds": seconds,
                "kernels": optimizer_kernels(step.optimizer), "skipped": int(stats.skipped)}  # fmt: skip

    config = TrainConfig().replace(model="vit_h14", image_size=28, num_classes=1000, batch_size=2, micro_batch_size=1,
                         num_workers=2, warmup_steps=1, max_steps=10, optimizer_impl="fused")  # fmt: skip
    directory = tmp_path / "h14_checkpoint"
    trainer = TorchTrainer(
        loop,
        train_loop_config={"train": config.to_dict(), "directory": str(directory)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="h14", storage_path=str(tmp_path)),
    )
    summary = trainer.fit().return_value
    assert summary["total"] == pytest.approx(632e6, rel=0.005)
    assert summary["local"] == pytest.approx(summary["total"] / 2, rel=0.01)
    rank0, rank1 = summary["shares"]
    assert len(rank0) == 4 + 12 * 32 + 2 + 4  # embeddings, 32 blocks, final norm, pretraining head
    for name in rank0:
        assert rank0[name] + rank1[name] == pytest.approx(1.0), name
        assert 0.4 <= rank0[name] <= 0.6, f"{name}: rank 0 holds {rank0[name]:.0%}"
    assert torch.isfinite(torch.tensor([summary["loss"], summary["grad_norm"]])).all()
    assert (summary["kernels"], summary["skipped"]) == ("fused", 0)
    # The classifier starts at zero, so the first step's gradient reaches it alone: it moves, and every
    # matrix shrinks by AdamW's weight decay; biases, norms and embeddings (no decay) stay.
    no_decay = {
        n for n in rank0 if n.endswith("bias") or ".norm" in n or n.startswith(("norm.", "cls_", "pos_"))
    }
    assert set(summary["unmoved"]) == no_decay - {"head.fc.bias"}
    assert dcp.is_complete(directory)
    print("ViT-H/14 phases (s):", summary["seconds"])
    shard_bytes = sorted(f.stat().st_size for f in directory.glob("__*_0.distcp"))
    assert len(shard_bytes) == 2
    # Each rank wrote its half of fp32 weights + AdamW's two moments: ~632M x 12 bytes / 2.
    assert shard_bytes[0] > 0.45 * 632e6 * 12 / 2
