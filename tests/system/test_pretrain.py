"""Pretraining under Ray Train: 2 CPU workers (gloo, FSDP2), a tiny ViT, synthetic shards.

Arithmetic the resume tests rely on: 4 shards x 16 samples, 2 workers x micro-batch 8, batch 16
-> every rank reads 2 shards (32 samples) an epoch = exactly 4 steps, so step 4 is an epoch edge.
"""

from __future__ import annotations

import itertools
import os
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
from pipeline.train import checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.driver import fit, read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from pipeline.data.synthetic import write_synthetic_shards

    out = tmp_path_factory.mktemp("train_shards")
    return write_synthetic_shards(out, 64, samples_per_shard=16, image_size=32, num_classes=4, seed=1)


def config(shards, out: Path, **changes) -> TrainConfig:
    base = TrainConfig(
        model="vit_tiny_test",
        image_size=32,
        num_classes=4,
        data=",".join(shards.urls),
        out=str(out),
        batch_size=16,
        micro_batch_size=8,
        num_workers=2,
        use_gpu=False,
        lr=1e-3,
        warmup_steps=2,
        max_steps=8,
        log_every=2,
        checkpoint_every=4,
        keep_checkpoints=5,
        shuffle_buffer=16,
        max_failures=0,
    )
    return base.replace(**changes)


def fit_metrics(cfg: TrainConfig, urls: list[str]) -> dict:
    return fit(cfg, urls)["metrics"]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    # Copies: load_file memory-maps, and the file may be replaced by a later run.
    return {k: v.clone() for k, v in load_file(out / "final" / "weights.safetensors").items()}


@pytest.fixture(scope="module")
def stopped_run(ray_session, shards, tmp_path_factory):
    """A 2-worker run stopped at step 4 (its checkpoint falls on an epoch edge), and its export."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    metrics = fit_metrics(config(shards, out, stop_at_step=4), shards.urls)
    assert metrics["step"] == 4
    assert dcp.is_complete(out / dcp.checkpoint_name(4))
    assert not (out / dcp.checkpoint_name(8)).exists()
    return out, final_weights(out)


def test_resume_at_an_epoch_edge_ends_equal_to_an_uninterrupted_run(stopped_run, shards, tmp_path):
    out, at_step_4 = stopped_run
    straight = tmp_path / "straight"
    fit(config(shards, straight), shards.urls)

    metrics = fit_metrics(config(shards, out), shards.urls)  # the same command, without the stop
    assert metrics["step"] == 8
    assert [r["step"] for r in read_metrics(str(out))] == [2, 4, 6, 8]  # one history, continued at 4

    a, b = final_weights(straight), final_weights(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninterrupted run"
    assert any(not torch.equal(a[n], at_step_4[n]) for n in a)  # steps 5-8 did train


def test_two_worker_checkpoint_loads_in_one_process(stopped_run, shards):
    out, at_step_4 = stopped_run
    # In a subprocess: a world of one (gloo, FSDP2 over 1 rank) loads the 2-rank DCP checkpoint and
    # must hold exactly what the 2-worker run exported at the same step.
    code = f"""
import torch
from pipeline.train import checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.model import build_model, init_distributed
from pipeline.train.step import TrainStep
_, world, device = init_distributed()
assert world == 1
cfg = TrainConfig.from_dict({config(shards, out, num_workers=1).to_dict()!r})
model = build_model(cfg.replace(seed=123), device)
state = checkpoint.load({str(out / dcp.checkpoint_name(4))!r}, model, TrainStep(model, cfg, device).optimizer)
assert state["step"] == 4, state
for name, value in model.state_dict().items():
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    torch.save(full, {str(out.parent)!r} + "/" + name + ".pt")
print("loaded", len(model.state_dict()), "tensors")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"loaded {len(at_step_4)} tensors" in result.stdout
    for name, value in at_step_4.items():
        assert torch.equal(torch.load(out.parent / f"{name}.pt"), value), name


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


def test_a_killed_worker_is_replaced_and_the_run_resumes_from_its_checkpoint(ray_session, shards, tmp_path):
    """SIGKILL a worker once checkpoint 8 is complete: the new worker group resumes from a checkpoint
    (8 or later, an epoch edge: 4 steps an epoch) and ends with the uninterrupted run's weights."""
    changes = {"max_steps": 24, "checkpoint_every": 4, "log_every": 4}
    straight = tmp_path / "straight"
    fit(config(shards, straight, **changes), shards.urls)

    out = tmp_path / "run"
    cfg = config(shards, out, max_failures=2, **changes)
    result: dict = {}

    def run() -> None:
        try:
            result["summary"] = fit(cfg, shards.urls)
        except Exception as e:  # the assertion below shows it
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + 180
    while not registered(out, 8) and time.time() < deadline and thread.is_alive():
        time.sleep(0.1)
    assert registered(out, 8), f"no checkpoint 8 to resume from: {result}"
    victims = train_workers()
    assert len(victims) == 2, f"expected this run's 2 training workers, found {victims}"
    os.kill(victims[1], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive(), "the run did not finish after a worker was killed"
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    assert summary["metrics"]["step"] == 24
    assert victims[1] not in train_workers()

    # The last attempt resumed (the worker's "resumed from ... at step N" line) from a complete
    # checkpoint at or after the one that existed before the kill.
    resumed = summary["resumed_from"]
    assert resumed is not None, "the run started over instead of resuming"
    assert resumed["step"] >= 8 and resumed["step"] % 4 == 0 and resumed["epoch"] == resumed["step"] // 4 - 1
    assert resumed["checkpoint"].rstrip("/").endswith(dcp.checkpoint_name(resumed["step"]))
    steps = [r["step"] for r in read_metrics(str(out))]
    assert steps == list(range(4, 25, 4))  # one history: the rows after the resumed step were rewritten

    a, b = final_weights(straight), final_weights(out)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninterrupted run"


def test_vit_h14_builds_shards_steps_and_checkpoints_on_two_cpu_workers(ray_session, tmp_path):
    """The real ViT-H/14 (632M parameters) at 224 px: each of 2 gloo workers holds about half of
    every parameter, takes one optimizer step on one image, and writes its half of a DCP checkpoint
    (model + AdamW state)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(cfg: dict) -> dict:
        import torch.distributed as dist

        from pipeline.train.model import build_model, model_config
        from pipeline.train.step import TrainStep

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
        labels = torch.randint(0, config.num_classes, (1,), generator=g)
        step = TrainStep(model, config, torch.device("cpu"))
        stats = step(0, [(patches, labels)], global_count=2)
        times["step"] = time.perf_counter()
        state = {"step": 1, "epoch": 0, "shards_started": []}
        checkpoint.save(cfg["directory"], model, step.optimizer, state, {"model_config": mcfg.to_dict()})
        times["save"] = time.perf_counter()
        seconds = {k: round(times[k] - times[p], 1) for p, k in itertools.pairwise(times)}
        return {"local": local, "total": total, "shares": shares, "loss": stats.loss_sum.item(),
                "grad_norm": stats.grad_norm.item(), "seconds": seconds}  # fmt: skip

    config = TrainConfig(model="vit_h14", image_size=224, num_classes=1000, batch_size=2, micro_batch_size=1,
                         num_workers=2, warmup_steps=1, max_steps=10)  # fmt: skip
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
    assert dcp.is_complete(directory)
    print("ViT-H/14 phases (s):", summary["seconds"])
    shard_bytes = sorted(f.stat().st_size for f in directory.glob("__*_0.distcp"))
    assert len(shard_bytes) == 2
    # Each rank wrote its half of fp32 weights + AdamW's two moments: ~632M x 12 bytes / 2.
    assert shard_bytes[0] > 0.45 * 632e6 * 12 / 2
