"""Where a training thread's time goes, window by window: a sampling profiler for slow log windows.

    VITRAY_SAMPLE_STACKS=DIR python jobs/pretrain.py ...    # each rank writes DIR/stacks-rank<R>.tsv
    python jobs/benchmarks/stacks.py DIR/stacks-rank0.tsv    # per log window: where the thread was (`table`)

Off unless the variable names a directory. A daemon thread wakes every 10 ms and writes the training
thread's innermost frames with the wall-clock time; each report adds a mark with its step, so the
samples fall into the log windows of `metrics.jsonl`. A gap between samples much longer than the
interval is a time when no Python ran in the process's other threads: the interpreter lock held by
one call (a collector pause, a C extension that keeps the lock).

`windows` cuts a file at its marks and counts each window's samples by the part of the loop they are
in (`PARTS`: `data wait`, waiting for the next step's input; `report`, reports and checkpoints;
`step`, forward, backward and update; else `other`, with its innermost frames); `table` prints them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.compat import thread_frame

ENV = "VITRAY_SAMPLE_STACKS"
INTERVAL_S = 0.01
DEPTH = 16  # innermost frames kept per sample

_out = None  # the open file of this process's sampler, once started


def start(rank: int) -> None:
    """Sample the calling thread (the training thread) from now on, if the variable asks for it."""
    global _out
    directory = os.environ.get(ENV)
    if not directory or _out is not None:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    _out = open(Path(directory) / f"stacks-rank{rank}.tsv", "a", buffering=1)  # noqa: SIM115 (process-long)
    target = threading.get_ident()
    threading.Thread(target=_sample, args=(target, _out), name="vitray-stacks", daemon=True).start()


def mark(step: int) -> None:
    """The end of a log window: its last step."""
    if _out is not None:
        _out.write(f"{time.time():.4f}\tstep {step}\n")


def _sample(target: int, out) -> None:
    while True:
        time.sleep(INTERVAL_S)
        names = innermost_frames(target)
        if names is None:  # the training thread has ended
            return
        out.write(f"{time.time():.4f}\t" + " < ".join(names) + "\n")


def innermost_frames(target: int) -> list[str] | None:
    """Thread ``target``'s `DEPTH` innermost frames (``file.py:function``), or None once it has ended."""
    frame = thread_frame(target)
    if frame is None:
        return None
    names = []
    while frame is not None and len(names) < DEPTH:
        names.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return names


PARTS = (  # the first part whose frame is on a sample's stack names it
    ("data wait", ("prefetch.py:next",)),
    ("report", ("loop.py:take_report", "loop.py:finish_report", "saver.py:start")),
    ("step", ("train_step.py:forward_backward", "train_step.py:update")),
)


@dataclass
class Window:
    last_step: int | None  # the step its report was at; None for samples after the last report
    start: float
    end: float = 0.0
    parts: Counter = field(default_factory=Counter)
    other: Counter = field(default_factory=Counter)
    longest_gap: float = 0.0

    @property
    def samples(self) -> int:
        return sum(self.parts.values())


def part_of(stack: list[str]) -> str:
    for name, frames in PARTS:
        if any(f in stack for f in frames):
            return name
    return "other"


class Watch:
    """The calling thread (the training thread) sampled every ``interval`` seconds in memory, always on
    and cheap: per window, the share of its samples in each part of the loop and the innermost frames
    of `other`, for the one line a slow window gets (`summary`)."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.window = Window(None, time.time())
        self._lock = threading.Lock()
        target = threading.get_ident()
        threading.Thread(target=self._run, args=(target,), name="vitray-watch", daemon=True).start()

    def _run(self, target: int) -> None:
        while True:
            time.sleep(self.interval)
            names = innermost_frames(target)
            if names is None:  # the training thread has ended
                return
            part = part_of(names)
            with self._lock:
                self.window.parts[part] += 1
                if part == "other":
                    self.window.other[names[0]] += 1

    def take(self) -> Window:
        """The samples since the last call; a new window begins."""
        with self._lock:
            taken, self.window = self.window, Window(None, time.time())
        taken.end = time.time()
        return taken


def summary(window: Window, top: int = 2) -> str:
    """``data wait 81%, step 12%, report 2%, other 5% (queue.py:get 3)``: where the thread was."""
    n = max(window.samples, 1)
    shares = sorted(((window.parts[name], name) for name, _ in (*PARTS, ("other", ()))), reverse=True)
    text = ", ".join(f"{name} {100 * count / n:.0f}%" for count, name in shares if count)
    frames = ", ".join(f"{f} {c}" for f, c in window.other.most_common(top))
    return text + (f" (other: {frames})" if frames else "") if window.samples else "no samples"


def windows(lines: list[str]) -> list[Window]:
    """The samples of a `stacks-rank<R>.tsv` cut at its marks."""
    out: list[Window] = []
    current: Window | None = None
    last = None
    for line in lines:
        when, _, rest = line.rstrip("\n").partition("\t")
        t = float(when)
        if current is None:
            current = Window(None, t)
        if rest.startswith("step "):
            current.last_step, current.end = int(rest.split()[1]), t
            out.append(current)
            current = Window(None, t)
            continue
        if last is not None:
            current.longest_gap = max(current.longest_gap, t - last)
        last, current.end = t, t
        stack = rest.split(" < ")
        part = part_of(stack)
        current.parts[part] += 1
        if part == "other":
            current.other[stack[0]] += 1
    if current is not None and current.samples:
        out.append(current)
    return out


def table(found: list[Window], top: int) -> str:
    head = (
        f"{'step':>6} {'seconds':>8} "
        + " ".join(f"{n:>9}" for n, _ in PARTS)
        + f" {'other':>6} {'gap s':>6}  other's top frames"
    )
    rows = [head]
    for w in found:
        n = max(w.samples, 1)
        shares = " ".join(f"{100 * w.parts[name] / n:>8.0f}%" for name, _ in PARTS)
        frames = ", ".join(f"{f} {c}" for f, c in w.other.most_common(top))
        step = "end" if w.last_step is None else str(w.last_step)
        rows.append(
            f"{step:>6} {w.end - w.start:>8.2f} {shares} {100 * w.parts['other'] / n:>5.0f}% {w.longest_gap:>6.2f}  {frames}"
        )
    return "\n".join(rows)
