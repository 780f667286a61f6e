"""The embedding job's progress, as the training log shows its own: shards done of the total, rows
written, rows per second and the time left.

    progress = EmbedProgress(len(plan.work.pending))
    job.run(plan, on_commit=progress.on_commit)

Off a terminal (a log file, ``ray job logs``) it writes one line per interval and one at the last
shard; on a terminal it redraws one live line in place instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

BAR_WIDTH = 24


class EmbedProgress:
    """Counts committed shards; `on_commit` is the job's commit callback."""

    def __init__(
        self,
        total: int,
        *,
        interval_s: float = 10.0,
        stream: TextIO | None = None,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.interval_s, self.clock = total, interval_s, clock
        self.stream = stream if stream is not None else sys.stdout
        self.live = _is_terminal(self.stream) if live is None else live
        self.done = self.rows = 0
        self.start = self.last_line = clock()

    def on_commit(self, url: str, record: dict[str, Any]) -> None:
        """One shard committed (``record`` is its manifest entry: ``rows``, ``file``, ...)."""
        self.done += 1
        self.rows += int(record.get("rows", 0))
        now = self.clock()
        finished = self.done >= self.total
        if self.live:
            end = "\n" if finished else ""
            self.stream.write(f"\r{bar(self.done, self.total)} {self.line(now)}\x1b[K{end}")
        elif finished or now - self.last_line >= self.interval_s:
            self.stream.write(self.line(now) + "\n")
            self.last_line = now
        self.stream.flush()

    def line(self, now: float) -> str:
        """``embedded 3/8 shards (38%) | 1,536 rows | 45.2 rows/s | eta 0:00:12``."""
        elapsed = max(now - self.start, 1e-9)
        parts = [
            f"embedded {self.done}/{self.total} shards ({100 * self.done / max(self.total, 1):.0f}%)",
            f"{self.rows:,} rows",
            f"{self.rows / elapsed:,.1f} rows/s",
        ]
        if self.done:
            parts.append(f"eta {hms(elapsed / self.done * (self.total - self.done))}")
        return " | ".join(parts)


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#########---------------]``: the share of shards done."""
    filled = round(width * done / max(total, 1))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
