"""A log line's report overlaps the next step (`pipeline.train.loop`): the loop takes what the row needs
at step N, queues step N+1's forward and backward, then finishes step N's report before N+1's update.
Without Ray, in one process: the loop's tests' config, fake data and local session
(`tests/train/test_loop.py`: 4 steps an epoch, 8 in all; here a log line every 2 steps, a checkpoint every
4, so steps 2 and 6 are the plain log lines).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline import dcp
from pipeline.data.bad_samples import BadSampleBudgetError
from pipeline.train.checkpointing import preemption
from pipeline.train.checkpointing.preemption import Preempted
from pipeline.train.step.train_step import TrainStep
from tests.train import test_loop
from tests.train.test_loop import config, patch_nan_loss, run, untimed


@pytest.fixture
def fake_data(monkeypatch):
    monkeypatch.setattr(test_loop.dataplan, "micro_batches", test_loop.fake_micro_batches)


def record_order(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``passes N`` as each step's forward and backward are queued, ``step N`` as its update is, ``row N``
    as each row is reported."""
    events: list[str] = []
    real_passes, real_update = TrainStep.forward_backward, TrainStep.update
    real_report = test_loop.LocalSession.report

    def forward_backward(self, index, *args, **kwargs):
        gradients = real_passes(self, index, *args, **kwargs)
        events.append(f"passes {index + 1}")
        return gradients

    def update(self, gradients):
        stats = real_update(self, gradients)
        events.append(f"step {gradients.step + 1}")
        return stats

    def report(self, metrics, *args, **kwargs):
        events.append(f"row {metrics['step']}")
        return real_report(self, metrics, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "forward_backward", forward_backward)
    monkeypatch.setattr(TrainStep, "update", update)
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


def test_a_log_lines_report_is_finished_between_the_next_steps_backward_and_its_update(
    world, fake_data, monkeypatch, tmp_path
):
    events = record_order(monkeypatch)
    summary, _ = run(config(tmp_path / "run"), world)
    assert summary["error"] == ""
    assert events == [
        "passes 1", "step 1", "passes 2", "step 2",
        "passes 3", "row 2", "step 3",  # a log line: between the next step's two calls
        "passes 4", "step 4", "row 4",  # at the epoch's end, where no step follows: at once
        "passes 5", "step 5", "passes 6", "step 6",
        "passes 7", "row 6", "step 7",
        "passes 8", "step 8", "row 8",  # the schedule's end: at once
    ]  # fmt: skip


def test_every_row_holds_the_values_of_its_own_step(world, fake_data, monkeypatch, tmp_path):
    """A log line every step, step 3's loss NaN: each row, finished during the next step, holds its own
    step's loss, accuracy, gradient norm and learning rate, as the step returned them to the loop's watch,
    and the skipped steps counted up to it."""
    patch_nan_loss(monkeypatch, {2})
    seen = test_loop.Seen()
    summary, session = run(config(tmp_path / "run", log_every=1), world, seen)
    rows = rows_in_file(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 9)) and summary["error"] == ""
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
    for row in rows:
        stats = seen.stats[row["step"]]
        assert row["grad_norm"] == pytest.approx(stats.grad_norm.item(), rel=1e-6, nan_ok=True)
        assert row["lr"] == stats.lr
        if row["step"] == 3:  # skipped: no sample of it is scored
            assert bool(stats.skipped) and math.isnan(row["loss"])
            continue
        assert row["loss"] == pytest.approx(stats.loss_sum.item() / stats.count, rel=1e-6)
        assert row["accuracy"] == pytest.approx(stats.correct.item() / stats.count, rel=1e-6)
    assert [r["step"] for r in session.reports] == [r["step"] for r in rows]


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
    bad-sample budget: epoch 1's stream fails after the 4 micro-batches of steps 5 and 6): the run stops
    there, with step 6's row written."""

    def failing_in_epoch_1(*args, epoch, **kwargs):
        for i, batch in enumerate(test_loop.fake_micro_batches(*args, epoch=epoch, **kwargs)):
            if epoch == 1 and i == 4:
                raise BadSampleBudgetError("the data failed")
            yield batch

    monkeypatch.setattr(test_loop.dataplan, "micro_batches", failing_in_epoch_1)
    summary, _ = run(config(tmp_path / "run"), world)
    assert summary["error"] == "the data failed"
    assert untimed(rows_in_file(tmp_path / "run")) == straight_rows[:3]
    assert summary["metrics"]["step"] == 6


def test_too_many_skipped_steps_in_a_row_stop_the_run_one_step_after_a_plain_log_line(
    world, fake_data, monkeypatch, tmp_path
):
    """Steps 3 to 6 skipped, --max-skipped-steps 3: step 6's log line finds them once step 7's forward and
    backward are queued, and the run stops there, before step 7's update and step 8's checkpoint
    (`tests/train/test_loop.py` checks the rest)."""
    patch_nan_loss(monkeypatch, set(range(2, 100)))
    events = record_order(monkeypatch)
    summary, _ = run(config(tmp_path / "run", max_skipped_steps=3), world)
    assert summary["error"].startswith("4 steps in a row (up to step 6) had a non-finite loss")
    assert events[-3:] == ["passes 6", "step 6", "passes 7"]  # no row 6, no update of step 7, no step 8
    assert not (tmp_path / "run" / dcp.checkpoint_name(8)).exists()
