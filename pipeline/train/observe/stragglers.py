"""Who is slow: a rank behind the others in a window (its own seconds per step against the ranks' median),
and a window behind the run's own pace (against the median of the windows before), each said in a few
words of the log line where it shows."""

from __future__ import annotations

import statistics
from typing import Any

from pipeline.train.observe import stacks

STRAGGLER = 0.2  # a rank this far over the ranks' median time per step is named in the log line


def straggler(step_s: list[float]) -> str:
    """``slowest rank 3: 0.52 s/step, 37% over the median 0.38`` for the slowest of the ranks' own times per
    step (`MetricsWindow.reduce`) when more than `STRAGGLER` over their median; "" otherwise. On many
    nodes one slow rank (its decode, its node) sets every rank's pace: this says which."""
    if len(step_s) < 2:
        return ""
    median = statistics.median(step_s)
    slowest = max(range(len(step_s)), key=step_s.__getitem__)
    if median <= 0 or step_s[slowest] <= (1 + STRAGGLER) * median:
        return ""
    return (
        f"slowest rank {slowest}: {step_s[slowest]:.2f} s/step, "
        f"{100 * (step_s[slowest] / median - 1):.0f}% over the median {median:.2f}"
    )


SLOW = 0.15  # a window this far under the run's median says what the training thread was doing
BASELINE = 3  # earlier windows (after the first) before a median is one: a run of a few is no baseline


def slow_window(row: dict[str, Any], rates: list[float], window: stacks.Window) -> str:
    """One line for a window more than `SLOW` under the median of ``rates`` (the earlier windows after
    the first, `BASELINE` of them at least; this row's rate is added to them), saying where the training
    thread was (`pipeline.train.observe.stacks.summary`); "" for the others."""
    rate = row.get("images_per_s") or 0.0
    median = statistics.median(rates) if rates else rate
    rates.append(rate)
    if len(rates) <= BASELINE or rate >= (1 - SLOW) * median:
        return ""
    return (
        f"step {row['step']}: {rate:,.0f} img/s, {100 * (1 - rate / median):.0f}% under the run's median "
        f"({median:,.0f}); the training thread: {stacks.summary(window)}"
    )
