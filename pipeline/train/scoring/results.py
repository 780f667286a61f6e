"""Rank 0's side of the checkpoint probe: its records taken from the ledger into the run's rows, log and sinks.

    finish_report (each log line): `ProbeResults.poll` -> a take asked of the ledger at the line before,
        read if answered (no wait) -> per record: one log line, its fields into the checkpoint's row of
        metrics.jsonl (`MetricsLog.amend`) and into the sinks (TensorBoard, W&B) at that step
    a checkpoint saved: `expect` its step (every record of it comes, scored, failed or skipped)
    the run's end: `done` until every step expected has its record (or the last probe's timeout passed),
        the ranks waiting in step, a short agreement a second (`pipeline.train.loop.Trainer.finish`)

A record of best/ (a fine-tuning's starting point, step 0, which has no row) goes into best/'s own record
instead (`pipeline.train.scoring.best.record_scores`).
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch.distributed as dist

from pipeline.train.observe.metrics import log_line
from pipeline.train.scoring import best
from pipeline.train.scoring.probe import SCORES, ProbePlan
from pipeline.train.state import agree_on_error

# The fields of a record that go into its checkpoint's row (and the sinks): scores, sizes, time, what went wrong.
ROW_FIELDS = (
    *SCORES,
    "probe_converged",
    "probe_images",
    "probe_eval_images",
    "probe_bad_samples",
    "probe_seconds",
    "probe_error",
    "probe_skipped",
)


def describe(record: dict[str, Any]) -> str:
    """A record as its log line: ``probe of step 120 (checkpoint_00000120): linear probe 87.50%, k-NN
    85.00% (fit on 1,536 images, scored on 512) in 14 s``, or why it failed or was skipped."""
    where = f"probe of step {record['step']} ({record['checkpoint']})"
    if record.get("probe_skipped"):
        return f"{where} skipped: {record['probe_skipped']}"
    if record.get("probe_error"):
        return f"{where} failed: {record['probe_error']}; training goes on"
    note = "" if record.get("probe_converged", True) else " (L-BFGS stopped before converging)"
    bad = f", {record['probe_bad_samples']} bad samples skipped" if record.get("probe_bad_samples") else ""
    sizes = f" (fit on {record.get('probe_images', 0):,} images, scored on {record.get('probe_eval_images', 0):,}{bad})"
    return (
        f"{where}: linear probe {100 * record['probe_accuracy']:.2f}%{note}, k-NN "
        f"{100 * record['knn_accuracy']:.2f}%{sizes} in {record.get('probe_seconds', 0):.1f} s"
    )


class ProbeResults:
    """Rank 0's records of the run's probes: ``log`` (its `MetricsLog`, with sinks) gets each one's fields
    at its step; ``last`` is the record of the latest step taken; ``kind``: --keep-best, for best/'s own."""

    def __init__(self, plan: ProbePlan, log: Any, kind: str | None):
        self.plan, self.log, self.kind = plan, log, kind
        self.asked: Any = None  # a take asked of the ledger, not read yet
        self.expected: set[int] = set()  # steps probed in this attempt whose record has not come
        self.last: dict[str, Any] | None = None
        self.start: dict[str, Any] | None = None  # the record of best/ at step 0 (a fine-tuning's start)

    def expect(self, step: int) -> None:
        """A checkpoint (or best/) of ``step`` is to be probed: its record will come."""
        self.expected.add(step)

    def poll(self) -> None:
        """The records the ledger answered since the last call, taken in; never waits."""
        if self.asked is not None:
            ready, _ = ray.wait([self.asked], timeout=0)
            if not ready:
                return
            self.took(ray.get(self.asked))
        self.asked = self.plan.ledger.take.remote()

    def done(self, deadline: float) -> bool:
        """Whether every record expected has come, after taking what the ledger holds (a short wait for
        its answer); past ``deadline`` (`time.monotonic`), True with a log line of what never came."""
        if self.asked is not None:
            self.took(ray.get(self.asked))
            self.asked = None
        self.took(ray.get(self.plan.ledger.take.remote()))
        if self.expected and time.monotonic() >= deadline:
            steps = ", ".join(map(str, sorted(self.expected)))
            log_line(
                f"the probe of step {steps} did not report within --probe-timeout {self.plan.timeout:g} s of "
                "the last checkpoint; the run ends without it"
            )
            self.expected.clear()
        return not self.expected

    def took(self, records: list[dict[str, Any]]) -> None:
        for record in sorted(records, key=lambda r: r["step"]):
            self.expected.discard(record["step"])
            log_line(describe(record))
            fields = {k: record[k] for k in ROW_FIELDS if k in record}
            if record["checkpoint"] == best.BEST:  # a fine-tuning's starting point: best/'s own record
                self.start = record
                if self.kind in ("probe", "knn"):
                    best.record_scores(self.plan.run_dir, self.kind, fields)
                continue
            self.log.amend(record["step"], fields)
            if self.last is None or record["step"] >= self.last["step"]:
                self.last = record


def wait_in_step(probes: ProbeResults | None, seconds: float, group: dist.ProcessGroup | None) -> None:
    """Collective, at the run's end: every rank waits, in step, until rank 0 (``probes``; None elsewhere)
    holds the record of every probe it expects, the last checkpoint's among them, one small agreement a
    second (a long wait in one collective would pass the process group's timeout); ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while True:
        done = probes is None or probes.done(deadline)
        _, (waiting,) = agree_on_error("", group, counts=(not done,))
        if not waiting:
            return
        time.sleep(1.0)
