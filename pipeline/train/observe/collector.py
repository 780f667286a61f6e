"""Python's garbage collector in a training run: it collects at log lines only, never in the middle of a step.

A full collection of a large heap holds the interpreter lock for a second or more, whenever allocation
counts say, in the middle of a step; so the run's first metrics window turns the automatic collections off
(`Collector`), and each log line collects the young generations, timed into its window (``gc_s``).
"""

from __future__ import annotations

import gc
import time


class Collector:
    """The run's collector, made with its first metrics window: automatic collections off from then on."""

    def __init__(self) -> None:
        gc.disable()
        self.frozen = False  # the objects of the warm-up frozen (`collect`)

    def collect(self) -> float:
        """A log line's collection of the young generations, in seconds. At the first log line, after the
        warm-up (model, optimizer, compiled code, the pipeline's first objects), what survives it is
        frozen (`gc.freeze`): no later collection walks it. The oldest generation is never collected (as
        torchtitan does): a full collection walks the whole heap, which took 1 s on a 2-core machine at a
        run's first log line (BENCHMARKS.md, "The host beside a device-shaped step")."""
        started = time.perf_counter()
        gc.collect(1)
        if not self.frozen:
            gc.freeze()
            self.frozen = True
        return time.perf_counter() - started
