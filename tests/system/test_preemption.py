"""Preemption on the local Ray, as a user meets it.

One run of `jobs/pretrain.py` (2 CPU workers, 12 steps, a checkpoint every 8, a log line every step) is
preempted twice: one of its workers gets a SIGTERM once step 2 is logged, and, after Ray Train restarted
the run, its last rank gets a drain notice at step 9 (the test hook `VITRAY_TEST_PREEMPT_AT_STEP`). Each
time the run checkpoints at the next step boundary and says so in one line, Ray Train restarts it from
that checkpoint, and it ends with the weights of the same run uninterrupted (the system tests' straight
run, `tests/system/conftest.py`, which logs and checkpoints at its own pace). Beside it, on Ray Train
workers: the notice Ray Train hands a worker, and a SIGTERM to it, reach the watcher.

Arithmetic: 4 shards x 16 samples, 2 workers x micro-batch 8, batch 16 -> 4 steps an epoch, 12 steps
read 192 samples.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline import dcp
from pipeline.train.audit import AuditConfig, audit_run
from pipeline.train.checkpointing.preemption import TEST_HOOK
from pipeline.train.driver import read_metrics
from tests.system.conftest import TRAINING

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "jobs" / "pretrain.py"
pytestmark = pytest.mark.slow


def args(shards, out: Path) -> list[str]:
    return [
        "--data", ",".join(shards.urls), "--out", str(out), *TRAINING, "--checkpoint-every", "8",
        "--log-every", "1", "--keep-checkpoints", "5", "--max-failures", "3",
    ]  # fmt: skip


def train_workers_of(pid: int) -> list[int]:
    """The Ray Train workers that descend from process ``pid`` (through the local Ray it started)."""

    def parent(p: int) -> int:
        status = (Path("/proc") / str(p) / "status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"RayTrainWorker" not in (proc / "cmdline").read_bytes():
                continue
            p = int(proc.name)
            while p > 1 and p != pid:
                p = parent(p)
        except OSError:
            continue
        if p == pid:
            found.append(int(proc.name))
    return found


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def preempted_run(straight_run, tmp_path_factory):
    """(the straight run's final weights, the preempted run's dir, its output, the step logged when the
    SIGTERM was sent)."""
    shards, straight = straight_run.shards, straight_run.out
    root = tmp_path_factory.mktemp("preemption")
    out = root / "run"
    log_path = root / "run.log"
    with log_path.open("w") as log:
        job = subprocess.Popen(
            [sys.executable, str(PRETRAIN), *args(shards, out)],
            cwd=ROOT, env={**os.environ, TEST_HOOK: "9"}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 400
            while (
                time.monotonic() < deadline and job.poll() is None and max(logged_steps(out), default=0) < 2
            ):
                time.sleep(0.05)
            workers = train_workers_of(job.pid)
            at_signal = max(logged_steps(out), default=0)
            assert len(workers) == 2 and 2 <= at_signal < 9, (
                workers,
                at_signal,
                log_path.read_text()[-3000:],
            )
            os.kill(workers[0], signal.SIGTERM)
            job.wait(timeout=480)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    output = log_path.read_text()
    assert job.returncode == 0, output[-5000:]
    weights = {k: v.clone() for k, v in load_file(straight / "final" / "weights.safetensors").items()}
    return weights, out, output, at_signal


def test_a_sigterm_and_a_drain_notice_each_checkpoint_the_next_step_and_ray_train_resumes_from_it(
    preempted_run,
):
    _, out, output, at_signal = preempted_run
    preempted = re.findall(r"preempted at step (\d+) \((.+?)\): (checkpoint_\d+) saved in [\d.]+ s; ", output)
    assert len(preempted) == 2, output[-5000:]
    (sigterm_step, sigterm_why, first), (notice_step, notice_why, second) = preempted
    step = int(sigterm_step)
    # At the next step boundary: none of the steps logged before the signal lost, the step in flight
    # (and on a loaded machine the one after it, begun before the signal landed) kept too.
    assert at_signal <= step <= at_signal + 2, (at_signal, step)
    assert re.fullmatch(r"SIGTERM on rank [01]", sigterm_why) and first == dcp.checkpoint_name(step)
    assert (int(notice_step), notice_why, second) == (
        9,
        f"a drain notice from {TEST_HOOK} on rank 1",
        dcp.checkpoint_name(9),
    )
    resumed = [(Path(p).name, int(s)) for p, s in re.findall(r"resumed from (\S+) at step (\d+)", output)]
    assert resumed == [
        (first, step),
        (second, 9),
    ]  # lost after each restart: nothing trained before the notice
    assert "finished at step 12:" in output and "samples read: 192, skipped as bad: 0" in output
    # One history in metrics.jsonl; each preemption checkpoint a complete one beside the periodic ones.
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, 13))
    for n in sorted({step, 8, 9, 12}):
        assert dcp.is_complete(out / dcp.checkpoint_name(n)), n
    # One line of the run's own for each preemption: no worker's traceback on the console.
    assert "Error in training function" not in output and "Preempted:" not in output, output[-5000:]
    report = audit_run(AuditConfig(run=str(out)))  # every sample of its 3 epochs once, as its ledger holds
    assert report.ok and report.finished == 2, report.format()


def test_a_run_preempted_twice_ends_with_the_weights_of_a_straight_run(preempted_run):
    straight, out, _, _ = preempted_run
    final = load_file(out / "final" / "weights.safetensors")
    assert final.keys() == straight.keys()
    for name in straight:
        assert torch.equal(straight[name], final[name]), f"{name} differs from the uninterrupted run"


def _watch(config: dict) -> None:
    """On each of 2 Ray Train workers: a watcher; rank 0 gets Ray Train's notice (handed over as Ray
    Train's own watcher hands it, `mark_preempt`), rank 1 a SIGTERM; each writes what it saw."""
    import ray
    import ray.train
    from ray.train import PreemptionInfo

    from pipeline.train.checkpointing.preemption import PreemptionWatcher

    rank = ray.train.get_context().get_world_rank()
    watcher = PreemptionWatcher(rank, 2, first_step=0, poll_seconds=0.0)
    seen = {"sigterm_handled": watcher.handles_sigterm, "before": watcher.notice(0) is not None}
    start = time.monotonic()
    if rank == 0:
        info = PreemptionInfo(
            deadline_ms=int(time.time() * 1000) + 90_000, preempted_node_to_ranks={"n": [0, 1]}
        )
        ray.get(ray.get_runtime_context().current_actor.mark_preempt.remote(info))
    else:
        os.kill(os.getpid(), signal.SIGTERM)
    notice = None
    while notice is None and time.monotonic() - start < 30:
        notice = watcher.notice(1)
        time.sleep(0.01)
    seen.update(
        why=notice and notice.why, deadline=notice and notice.deadline, seconds=time.monotonic() - start
    )
    watcher.close()
    Path(config["dir"], f"{rank}.json").write_text(json.dumps(seen))


def test_a_ray_train_worker_sees_rays_notice_and_a_sigterm(ray_session, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        _watch,
        train_loop_config={"dir": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="watch", storage_path=str(tmp_path / "ray")),
    ).fit()
    rank0, rank1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert rank0["sigterm_handled"] and rank1["sigterm_handled"]  # on the actor's main thread
    assert not rank0["before"] and not rank1["before"]
    assert rank0["why"] == "Ray's preemption notice for the node(s) of rank(s) 0, 1"
    assert time.time() + 30 < rank0["deadline"] < time.time() + 91
    # The worker survived its SIGTERM (Ray's handler would have ended it) and read it at once from the
    # wakeup pipe, not at the main thread's next task (Ray Train's status poll, every 2 s).
    assert rank1["why"] == "SIGTERM" and rank1["seconds"] < 1.0, rank1
