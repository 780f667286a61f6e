"""A hang, diagnosed: when no worker finishes a step within a bound, every worker's Python stacks (all its
threads) go to one file under ``--out``, one log line names the workers that did not arrive and where they
stand, and the attempt fails, so that Ray Train restarts it from its latest checkpoint (within
``--max-failures``) rather than wait for ever.

Each rank runs a `Watchdog`: a daemon thread that wakes every second or so and compares the time since
the rank last finished a step (`finished`) with the bound: ``--hang-timeout`` seconds, or by default
`FACTOR` times the median of the attempt's steps (the first, which compiles, left out), never less than
`FLOOR_S`, which covers a first step's compilation and a first checkpoint's save at the scale of the
presets (docs/scaling.md); an attempt's first step is given `FLOOR_S` at least whatever the setting, so
that a restart's compilation is no hang. Data-parallel ranks cannot drift apart by more than a step (every step's
collectives hold them together), so when one is stuck all are, and their watchdogs fire within a poll of
each other. The loop says where the rank stands at each seam of a step (`at`: its input, the steps'
agreement, forward and backward, the report, the update); evaluation passes are not watched (`paused`).

What happens then, with every collective maybe stuck: the ranks meet in the default process group's
key-value store (a TCPStore under Ray Train; `pipeline.compat.default_store`), which answers from any
thread. Each rank puts its report there: the step it is at, the seam, for how long, its training thread's
innermost frames and every thread's stack. Rank 0 waits up to `GATHER_S` for them, writes them into
``<out>/hangs/step_<N>_<time>.txt``, and logs the line: the workers behind the furthest one did not
arrive where it waits (the seams of a step in their order); a worker that sent no report is named too.
Then every rank ends its process (exit code `HANG_EXIT`): Ray Train sees a failed worker group and
restarts it from the latest checkpoint; the steps after it are lost, and counted so
(`pipeline.train.observe.goodput`). A watchdog that cannot run (a thread holding the interpreter lock for
ever) cannot see the hang: Ray's own timeouts are then the last resort.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeline import storage
from pipeline.compat import default_store, exit_now, thread_frames
from pipeline.train.observe.metrics import log_line
from pipeline.train.observe.stacks import innermost_frames

FLOOR_S = 600.0  # the least bound by default: a first step's compilation, a first checkpoint's save
FACTOR = 20  # the default bound: this many times the median step, once steps were timed
GATHER_S = 60.0  # how long rank 0 waits for the other ranks' reports
HANG_EXIT = 75  # the exit code of a hung attempt's workers (EX_TEMPFAIL: try again)
HANGS_DIR = "hangs"
KEY = "vitray-hang"  # the store's keys: KEY/<rank>, KEY/written
# The seams of a step, in the order a rank meets them: a rank at an earlier one has not arrived where a
# rank at a later one waits.
SEAMS = ("input", "agreement", "forward/backward", "report", "update")


@dataclass(frozen=True)
class Stand:
    """Where a rank stands: the step it works on, the seam of it, since when (`time.time`)."""

    step: int
    seam: str
    since: float

    @property
    def order(self) -> tuple[int, int]:
        return self.step, SEAMS.index(self.seam) if self.seam in SEAMS else len(SEAMS)


def default_bound(intervals: list[float], setting: float | None, stepped: bool = True) -> tuple[float, str]:
    """(seconds, why): ``setting`` where given, else `FACTOR` times the median of the step ``intervals``,
    at least `FLOOR_S`; 0 turns the watchdog off (inf). Until the attempt's first step is done (not
    ``stepped``: compilation, the data pipeline's start) never under `FLOOR_S`, whatever the setting."""
    if setting == 0:
        return float("inf"), "off"
    if setting is not None:
        if not stepped and setting < FLOOR_S:
            return FLOOR_S, f"--hang-timeout {setting:g}, at least {FLOOR_S:g} s for an attempt's first step"
        return setting, f"--hang-timeout {setting:g}"
    if not intervals:
        return FLOOR_S, f"at least {FLOOR_S:g} s until steps are timed"
    median = statistics.median(intervals)
    return (
        max(FLOOR_S, FACTOR * median),
        f"{FACTOR} x the median step of {median:.2f} s, at least {FLOOR_S:g} s",
    )


class Watchdog:
    """One rank's watch for a hang (module docstring). ``fail`` ends the rank (default: its process, with
    `HANG_EXIT`); ``store`` is where the ranks meet (default: the default group's)."""

    def __init__(
        self,
        rank: int,
        world: int,
        run_dir: storage.Location,
        setting: float | None,
        *,
        max_failures: int = 0,
        store: Any = None,
        fail: Callable[[], None] | None = None,
        gather_s: float = GATHER_S,
    ):
        self.rank, self.world, self.run_dir, self.setting = rank, world, run_dir, setting
        self.max_failures, self.gather_s = max_failures, gather_s
        self.store = store if store is not None else default_store()
        self.fail = fail or _end_process
        self.target = threading.get_ident()  # the training thread
        self.stand = Stand(1, "input", time.time())
        self.last = time.time()  # the last step finished (or the watch began, or a pause ended)
        self.intervals: deque[float] = deque(maxlen=1000)
        self.steps = 0
        self.pauses = 0
        self.fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if default_bound([], setting)[0] != float("inf"):
            self._thread = threading.Thread(target=self._watch, name="vitray-watchdog", daemon=True)
            self._thread.start()

    # --- what the loop says ------------------------------------------------------------------------
    def at(self, seam: str, step: int) -> None:
        """The rank is at ``seam`` of step ``step``."""
        self.stand = Stand(step, seam, time.time())

    def finished(self, step: int) -> None:
        """Step ``step`` is done on this rank."""
        now = time.time()
        if self.steps:  # the first step (compilation, the pipeline's start) is no measure of the rest
            self.intervals.append(now - self.last)
        self.steps += 1
        self.last = now
        self.stand = Stand(step + 1, "input", now)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not watched meanwhile (an evaluation pass); the bound counts from its end."""
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1
            self.last = time.time()

    def close(self) -> None:
        self._stop.set()

    # --- the watch -----------------------------------------------------------------------------------
    def bound(self) -> tuple[float, str]:
        return default_bound(list(self.intervals), self.setting, stepped=self.steps > 0)

    def _watch(self) -> None:
        while not self._stop.is_set():
            bound, why = self.bound()
            self._stop.wait(min(1.0, max(bound / 20, 0.05)))
            if self._stop.is_set() or self.pauses:
                continue
            if innermost_frames(self.target) is None:  # the training thread is gone: nothing to watch
                return
            quiet = time.time() - self.last
            if quiet > bound:
                self.fired = True
                try:
                    self._diagnose(quiet, bound, why)
                finally:
                    self.fail()
                return

    def report(self) -> dict[str, Any]:
        """This rank's part of the file: where it stands, its training thread's innermost frames, and
        every thread's stack."""
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = {
            f"{names.get(ident, 'thread')} ({ident}){' (training)' if ident == self.target else ''}": "".join(
                traceback.format_stack(frame)
            )
            for ident, frame in thread_frames().items()
        }
        stand = self.stand
        return {
            "rank": self.rank,
            "step": stand.step,
            "seam": stand.seam,
            "for_s": time.time() - stand.since,
            "frames": (innermost_frames(self.target) or [])[:3],
            "pid": os.getpid(),
            "stacks": stacks,
        }

    def _diagnose(self, quiet: float, bound: float, why: str) -> None:
        store = self.store
        mine = self.report()
        if store is None:  # no way to meet the others: this rank's own file, and line
            self._write([mine], quiet, bound, why)
            return
        store.set(f"{KEY}/{self.rank}", json.dumps(mine))
        if self.rank != 0:  # rank 0 writes; this rank ends once it has (or the wait is over)
            _wait_for(store, [f"{KEY}/written"], self.gather_s + 10)
            with contextlib.suppress(Exception):
                store.set(f"{KEY}/ended/{self.rank}", "1")
            return
        keys = [f"{KEY}/{r}" for r in range(self.world)]
        _wait_for(store, keys, self.gather_s)
        reports = [json.loads(store.get(k)) for k in keys if store.check([k])]
        try:
            self._write(reports, quiet, bound, why)
        finally:
            store.set(f"{KEY}/written", "1")
            # The store's server lives in this process (rank 0's): it ends last, once the others heard.
            ended = [f"{KEY}/ended/{r['rank']}" for r in reports if r["rank"] != 0]
            _wait_for(store, ended, 10.0)

    def _write(self, reports: list[dict[str, Any]], quiet: float, bound: float, why: str) -> None:
        """The stacks file, and the log line (module docstring)."""
        step = min(r["step"] for r in reports)
        name = f"{HANGS_DIR}/step_{step:08d}_{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.txt"
        parts = []
        for r in sorted(reports, key=lambda r: r["rank"]):
            where = f"step {r['step']}, {r['seam']} for {r['for_s']:.1f} s"
            head = f"=== worker {r['rank']} (pid {r['pid']}): {where}"
            parts.append(head + "\n" + "\n".join(f"--- {t}\n{s}" for t, s in r["stacks"].items()))
        storage.write_text(self.run_dir.join(name), "\n".join(parts))
        log_line(
            hang_line(reports, self.world, quiet, bound, why, self.run_dir.join(name).url, self.max_failures)
        )


def hang_line(
    reports: list[dict[str, Any]],
    world: int,
    quiet: float,
    bound: float,
    why: str,
    where: str,
    max_failures: int,
) -> str:
    """The one line of a hang: how long no step finished against which bound, the workers that did not
    arrive where the others wait (or that sent nothing) and where they stand, the file, what follows."""
    stands = {r["rank"]: Stand(r["step"], r["seam"], 0.0) for r in reports}
    furthest = max(s.order for s in stands.values())
    behind = sorted(r for r, s in stands.items() if s.order < furthest)
    silent = sorted(set(range(world)) - set(stands))

    def where_is(rank: int) -> str:
        r = next(one for one in reports if one["rank"] == rank)
        frames = " < ".join(r["frames"][:2])
        return f"worker {rank} at step {r['step']}, {r['seam']} for {r['for_s']:.0f} s" + (
            f" ({frames})" if frames else ""
        )

    waiting = sorted(r for r, s in stands.items() if s.order == furthest)
    at = next(s for s in stands.values() if s.order == furthest)
    if behind:
        late = "; ".join(where_is(r) for r in behind)
        found = f"{late} did not arrive where worker(s) {_ranks(waiting)} wait: step {at.step}, {at.seam}"
    else:
        found = f"every worker is at step {at.step}, {at.seam}: " + "; ".join(where_is(r) for r in waiting)
    if silent:
        found += f"; worker(s) {_ranks(silent)} sent no stacks"
    return (
        f"hang: no worker finished a step in {quiet:.0f} s (bound {bound:.0f} s: {why}): {found}; every "
        f"worker's stacks in {where}; the attempt fails, and Ray Train restarts it from its latest "
        "checkpoint "
        f"within --max-failures {max_failures}"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _wait_for(store: Any, keys: list[str], seconds: float) -> None:
    """Until ``keys`` are all in ``store``, ``seconds`` at most; at once where its server is gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if store.check(keys):
                return
        except Exception:  # the server (rank 0's process) has ended: nothing more will come
            return
        time.sleep(0.2)


def _end_process() -> None:
    """The rank's process ends at once (`HANG_EXIT`)."""
    exit_now(HANG_EXIT)
