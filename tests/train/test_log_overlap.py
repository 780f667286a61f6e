"""A plain log line's report overlaps the next step (`pipeline.train.loop`): the loop takes what the row
needs at step N, queues step N+1, then finishes step N's report. Without Ray, in one process: the loop's
tests' config, fake data and local session (`tests/train/test_loop.py`: 4 steps an epoch, 8 in all; here
a log line every 2 steps, a checkpoint every 4, so steps 2 and 6 are the plain log lines).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import dcp
from pipeline.train import loop
from pipeline.train.checkpointing import preemption
from pipeline.train.checkpointing.preemption import Preempted
from pipeline.train.step.train_step import TrainStep
from tests.train import test_loop
from tests.train.test_loop import config, patch_nan_loss, run, untimed


@pytest.fixture
def fake_data(monkeypatch):
    monkeypatch.setattr(test_loop.dataplan, "micro_batches", test_loop.fake_micro_batches)


def record_order(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``step N`` as each step's call returns (its work queued), ``row N`` as each row is reported."""
    events: list[str] = []
    real_step, real_report = TrainStep.__call__, test_loop.LocalSession.report

    def step(self, index, *args, **kwargs):
        stats = real_step(self, index, *args, **kwargs)
        events.append(f"step {index + 1}")
        return stats

    def report(self, metrics, *args, **kwargs):
        events.append(f"row {metrics['step']}")
        return real_report(self, metrics, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "__call__", step)
    monkeypatch.setattr(test_loop.LocalSession, "report", report)
    return events


def rows_in_file(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_rows(world, tmp_path_factory) -> list[dict]:
    """The rows of the 8-step run, uninterrupted."""
    out = tmp_path_factory.mktemp("overlap") / "straight"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_loop.dataplan, "micro_batches", test_loop.fake_micro_batches)
        summary, _ = run(config(out), world)
    assert summary["error"] == ""
    return untimed(rows_in_file(out))


def test_a_plain_log_lines_report_is_finished_after_the_next_step_is_queued(
    world, fake_data, monkeypatch, tmp_path
):
    events = record_order(monkeypatch)
    summary, _ = run(config(tmp_path / "run"), world)
    assert summary["error"] == ""
    assert events == [
        "step 1", "step 2", "step 3", "row 2",  # a plain log line: after the next step
        "step 4", "row 4",  # a checkpoint's: in place, before its save
        "step 5", "step 6", "step 7", "row 6",
        "step 8", "row 8",  # the last step's: in place
    ]  # fmt: skip


def test_the_rows_are_those_of_reports_made_in_place(world, fake_data, monkeypatch, tmp_path):
    """Every row's values (timings aside) as when each log line reported at its own step, skipped steps
    counted alike: a log line every step, step 3's loss NaN."""
    patch_nan_loss(monkeypatch, {2})
    deferred, _ = run(config(tmp_path / "deferred", log_every=1), world)
    real_report = loop.Trainer.report
    monkeypatch.setattr(
        loop.Trainer, "report", lambda self, stats, *, defer=False, **kw: real_report(self, stats, **kw)
    )
    in_place, _ = run(config(tmp_path / "in_place", log_every=1), world)
    rows = untimed(rows_in_file(tmp_path / "deferred"))
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows == untimed(rows_in_file(tmp_path / "in_place"))
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert deferred["metrics"]["loss"] == in_place["metrics"]["loss"]


def test_a_preemption_notice_after_a_plain_log_line_checkpoints_with_that_lines_row(
    world, fake_data, straight_rows, monkeypatch, tmp_path
):
    monkeypatch.setenv(preemption.TEST_HOOK, "6")  # at the step boundary after step 6: its row pending
    cfg = config(tmp_path / "run")
    with pytest.raises(Preempted, match=f"preempted at step 6 .*{dcp.checkpoint_name(6)} saved"):
        run(cfg, world)
    rows = untimed(rows_in_file(tmp_path / "run"))
    assert rows == straight_rows[:3]  # steps 2, 4 and 6, step 6's as in the straight run, once
    assert dcp.is_complete(tmp_path / "run" / dcp.checkpoint_name(6))


def test_a_run_stopped_after_a_plain_log_line_writes_that_lines_row(
    world, fake_data, straight_rows, monkeypatch, tmp_path
):
    """A data error that every rank agrees on at the step boundary after step 6 (a run out of its
    bad-sample budget, say): the run stops there, with step 6's row written."""
    real = loop.Trainer.next_step_input

    def failing_after_step_6(self, data):
        step_input, agreement = real(self, data)
        if self.state.step == 6:
            agreement = dataclasses.replace(agreement, error="the data failed")
        return step_input, agreement

    monkeypatch.setattr(loop.Trainer, "next_step_input", failing_after_step_6)
    summary, _ = run(config(tmp_path / "run"), world)
    assert summary["error"] == "the data failed"
    assert untimed(rows_in_file(tmp_path / "run")) == straight_rows[:3]
    assert summary["metrics"]["step"] == 6


def test_too_many_skipped_steps_in_a_row_stop_the_run_one_step_after_a_plain_log_line(
    world, fake_data, monkeypatch, tmp_path
):
    """Steps 3 to 6 skipped, --max-skipped-steps 3: step 6's log line finds them once step 7 is queued,
    and the run stops there, before step 8's checkpoint (`tests/train/test_loop.py` checks the rest)."""
    patch_nan_loss(monkeypatch, set(range(2, 100)))
    events = record_order(monkeypatch)
    summary, _ = run(config(tmp_path / "run", max_skipped_steps=3), world)
    assert summary["error"].startswith("4 steps in a row (up to step 6) had a non-finite loss")
    assert events[-2:] == ["step 6", "step 7"]  # no row 6, no step 8
    assert not (tmp_path / "run" / dcp.checkpoint_name(8)).exists()
