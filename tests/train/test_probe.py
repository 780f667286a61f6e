"""The checkpoint probe's task (`pipeline.train.scoring.probe`) and its records on rank 0
(`pipeline.train.scoring.results`), on the tests' shared Ray, with checkpoints made in this process.

Each probe below runs as Ray Train's validation hook runs it (`probe`, from `probe_checkpoint`): the
newest-first skip, the task on the probe's resources, its failures as one-line records in the ledger.
What a whole run does with them: tests/system/test_probe.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import vit
from pipeline import dcp, storage
from pipeline.data.config import DataConfig
from pipeline.train.observe.metrics import MetricsLog
from pipeline.train.scoring.probe import ProbeLedger, ProbePlan, probe, probe_checkpoint
from pipeline.train.scoring.results import ProbeResults, describe


def write_checkpoint(run: Path, step: int, seed: int = 0) -> Path:
    """A complete checkpoint of a `vit_tiny_test` (32 px, 4 classes) as training writes one, in one process."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = vit.create_model("vit_tiny_test", num_classes=4)
    where = run / dcp.checkpoint_name(step)
    torch_dcp.save({"model": model.state_dict()}, checkpoint_id=str(where), no_dist=True)
    (where / dcp.TRAIN_STATE).write_text(json.dumps({"step": step}))
    data = DataConfig(image_size=32, patch_size=8).to_dict()
    (where / dcp.CONFIG).write_text(json.dumps({"model_config": model.config.to_dict(), "data": data}))
    assert dcp.is_complete(where)
    return where


def plan_for(run: Path, scorer, request: dict | None = None, timeout: float = 120.0) -> ProbePlan:
    return ProbePlan(
        scorer, request or {}, 1.0, False, timeout, storage.as_location(str(run)), ProbeLedger.remote()
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_probe_slower_than_the_checkpoints_skips_to_the_newest_and_records_the_skip(ray_session, tmp_path):
    for step in (4, 8):
        write_checkpoint(tmp_path, step)

    def scorer(weights, **_):  # what each probe scored: its checkpoint's step, as its accuracy
        return {"probe_accuracy": int(weights.url.rsplit("_", 1)[-1]) / 100, "knn_accuracy": 0.5}

    plan = plan_for(tmp_path, scorer)

    class Registered:  # what Ray Train hands its validation function
        def __init__(self, step: int):
            self.path = str(tmp_path / dcp.checkpoint_name(step))

    # Checkpoint 8 landed while 4's probe waited its turn: 4 skips itself (NaN: ranked last), 8 is probed.
    assert all(v != v for v in probe_checkpoint(Registered(4), plan=plan).values())
    assert probe_checkpoint(Registered(8), plan=plan) == {"probe_accuracy": 0.08, "knn_accuracy": 0.5}
    skipped, scored = ray_session.get(plan.ledger.take.remote())
    assert skipped == {
        "step": 4,
        "checkpoint": "checkpoint_00000004",
        "probe_skipped": "checkpoint_00000008 was saved before this probe could start; the newest is probed next",
    }
    assert (scored["step"], scored["probe_accuracy"], scored["probe_seconds"] >= 0) == (8, 0.08, True)
    assert describe(skipped).startswith("probe of step 4 (checkpoint_00000004) skipped: checkpoint_00000008")


def test_a_probe_killed_failing_or_too_slow_is_one_line_in_its_record_and_raises_nothing(
    ray_session, tmp_path
):
    def sleeper(weights, *, pid_file, fail=""):
        if fail:
            raise ValueError(f"{fail}\nsecond line of the traceback")
        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(60)
        return {}

    pid_file = tmp_path / "pid"
    plan = plan_for(tmp_path, sleeper, {"pid_file": str(pid_file)})
    found: dict = {}
    thread = threading.Thread(target=lambda: found.update(probe(plan, "checkpoint_00000004", 4)))
    thread.start()
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.1)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the probe's process, as the OOM killer would
    thread.join(timeout=60)
    assert found["probe_error"].startswith("the probe's task ended: "), found
    assert "\n" not in found["probe_error"] and "probe_accuracy" not in found

    failing = plan_for(
        tmp_path, sleeper, {"pid_file": str(pid_file), "fail": "--probe-data: shard x.tar gave no sample"}
    )
    assert (
        probe(failing, "checkpoint_00000004", 4)["probe_error"] == "--probe-data: shard x.tar gave no sample"
    )
    slow = plan_for(tmp_path, sleeper, {"pid_file": str(tmp_path / "pid2")}, timeout=1.0)
    record = probe(slow, "checkpoint_00000004", 4)
    assert record["probe_error"] == "the probe took longer than --probe-timeout 1 s and was stopped"
    assert describe(record) == (
        "probe of step 4 (checkpoint_00000004) failed: the probe took longer than --probe-timeout 1 s and was "
        "stopped; training goes on"
    )


def test_rank_0_takes_the_records_into_their_rows_without_waiting_and_waits_for_the_last_at_the_end(
    ray_session, tmp_path, capsys
):
    log = MetricsLog(str(tmp_path))
    for step in (2, 4, 6):
        log.append({"step": step, "loss": 1.0 / step}, flush=True)
    plan = plan_for(tmp_path, None)
    results = ProbeResults(plan, log, None)
    results.expect(4)
    results.poll()  # asks the ledger; nothing has landed
    scores = {"probe_accuracy": 0.75, "knn_accuracy": 0.5, "probe_images": 48, "probe_eval_images": 12}
    ray_session.get(plan.ledger.put.remote({"step": 4, "checkpoint": "checkpoint_00000004", **scores}))
    deadline = time.time() + 30
    while results.last is None and time.time() < deadline:
        results.poll()
        time.sleep(0.05)
    assert results.expected == set() and results.last["step"] == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1] == {"step": 4, "loss": 0.25, **scores}  # in its checkpoint's row, on disk
    assert rows[0] == {"step": 2, "loss": 0.5} and rows[2] == {"step": 6, "loss": 1 / 6}
    line = "probe of step 4 (checkpoint_00000004): linear probe 75.00%, k-NN 50.00% (fit on 48 images, scored on 12)"
    assert line in capsys.readouterr().out

    results.expect(6)  # a probe that never reports: the end gives up on it, once, in one line
    assert results.done(time.monotonic() + 0.5) is False
    assert results.done(time.monotonic() - 1) is True
    assert "the probe of step 6 did not report within --probe-timeout" in capsys.readouterr().out
