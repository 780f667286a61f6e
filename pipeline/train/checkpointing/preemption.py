"""A checkpoint on a preemption notice: a spot node taken away costs the run no step it had trained.

    SIGTERM (the handler sets a flag) --+
    Ray's drain notice (read locally) --+--> PreemptionWatcher.notice(step), at every step boundary
    the test hook (an env variable)  ---+        -> agree_on_step(preempted=...): any rank -> every rank
                                                 -> agree: the plan (one gather); the loop's normal
                                                    checkpoint of this step; stop: one log line, `Preempted`

Notices. Ray Train watches the cluster's node drains (a spot reclaim or a scale-down that the cluster
reports to Ray, `ray drain-node`) and hands every worker of the run a `ray.train.PreemptionInfo` with
the node's deadline. The watcher reads this worker's copy at most every `POLL_SECONDS`, locally
(`pipeline.compat.ray_train_preemption_info`): no remote call. A SIGTERM to a worker process (a VM
shutting down, a process stopped by hand) only sets a flag: a handler runs between two bytecodes of
whatever the main thread is doing, so it does no work. Python runs handlers on the main thread only,
and Ray Train runs the loop on another thread of its worker actor: the handler is installed on the
actor's main thread through the actor itself (`__ray_call__`), and the loop's thread reads the signal
from the wakeup pipe at the next step boundary, without waiting for the main thread to run the handler.
A second SIGTERM goes to the handler that was there before (Ray's: the worker exits), so a worker stuck
in a collective can still be stopped.

Agreement. A notice may reach one rank only (a SIGTERM) or the ranks at different steps. The step's
agreement folds every rank's flag into the all-reduce it makes anyway, so every rank stops at the same
step boundary, before that step: the checkpoint holds the steps up to N and every rank's cursor as of
step N, as a periodic checkpoint at step N would, and a resume goes on at the sample
(`pipeline.train.input.cursor`). One gather then settles the plan, the same on every rank: every rank's
reason, the least time left before a deadline, the longest a checkpoint took in this attempt.

Stop. The checkpoint is a normal one (`dcp.checkpoint_name(step)`), reported to Ray Train with its
metrics; then every rank raises `Preempted`, a worker failure that Ray Train counts against
--max-failures and answers by restarting the run from its latest checkpoint: this one. The steps lost
are those of the step in flight when the notice came, at most one. With less time left than a
checkpoint takes, none is tried, and the latest checkpoint stays the one to resume from.

Test hook: ``VITRAY_TEST_PREEMPT_AT_STEP=N`` in the workers' environment gives the last rank a drain
notice (deadline 60 s away) at the step boundary after step N, once per run: an attempt that resumed at
step N or later does not get it. Only tests set it; without it, nothing here differs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch.distributed as dist

from pipeline import compat, dcp
from pipeline.train.checkpointing.saver import Checkpointer
from pipeline.train.observe.metrics import log_line
from pipeline.train.state import Rank

POLL_SECONDS = 2.0  # between two reads of Ray's notice: a drain gives minutes, a step may take ms
TEST_HOOK = "VITRAY_TEST_PREEMPT_AT_STEP"
TEST_HOOK_DEADLINE_S = 60.0
REPORTS_TIMEOUT_S = 60.0  # for Ray Train's controller to take this rank's last reports before it raises


class Preempted(RuntimeError):
    """Every rank raises it once the run stopped for a preemption: a worker failure to Ray Train, which
    restarts the run from its latest checkpoint (within --max-failures)."""


@dataclass(frozen=True)
class Notice:
    """One rank's reason to stop: what it got, and when the node goes (UNIX seconds; None: not said)."""

    why: str
    deadline: float | None = None


@dataclass(frozen=True)
class Plan:
    """What every rank settles at the preempted step boundary, alike."""

    why: str  # every rank's reason, e.g. "SIGTERM on rank 1"
    save: bool  # a checkpoint fits before the deadline (or no deadline was said)
    seconds_left: float | None  # the least time left before a deadline, over the ranks
    save_seconds: float  # the longest a checkpoint took in this attempt, over the ranks (0: none yet)


# --- SIGTERM: a flag --------------------------------------------------------------------------------
class _Sigterm:
    """This process's SIGTERM state. Python runs a signal's handler on the main thread, between two of
    its bytecodes; a Ray actor's main thread waits in Ray's task loop until its next task (Ray Train's
    status poll, every 2 s), so the training thread reads the signal sooner from the wakeup pipe, where
    the interpreter's C-level handler writes each signal's number at once."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.handled = 0  # SIGTERMs the Python handler has run for: a second one goes to `previous`
        self.previous: Any = None  # the handler ours replaced, while ours is installed
        self.pipe: tuple[int, int] | None = None  # (read, write) ends of the wakeup pipe, ours
        self.wakeup = -1  # the wakeup fd before ours

    def seen(self) -> bool:
        if not self.flag.is_set() and self.pipe is not None:
            with contextlib.suppress(BlockingIOError):
                if signal.SIGTERM in os.read(self.pipe[0], 512):
                    self.flag.set()
        return self.flag.is_set()


_sigterm = _Sigterm()


def _on_sigterm(signum: int, frame: Any) -> None:
    """The first SIGTERM sets the flag; the next goes to the handler before ours."""
    _sigterm.flag.set()
    _sigterm.handled += 1
    if _sigterm.handled == 1:
        return
    previous = _sigterm.previous
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        raise SystemExit(128 + signum)


def _install(_actor: Any = None) -> None:
    """On the main thread (``_actor``: the worker actor, when run through it)."""
    _restore()  # a new attempt in this process starts without the last one's signal
    _sigterm.flag.clear()
    _sigterm.handled = 0
    _sigterm.previous = signal.signal(signal.SIGTERM, _on_sigterm)
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    _sigterm.wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if _sigterm.wakeup != -1:  # someone's (an asyncio loop's): kept, and the flag waits for the handler
        signal.set_wakeup_fd(_sigterm.wakeup)
        os.close(read)
        os.close(write)
    else:
        _sigterm.pipe = read, write


def _restore(_actor: Any = None) -> None:
    if _sigterm.previous is not None:
        signal.signal(signal.SIGTERM, _sigterm.previous)
        _sigterm.previous = None
    if _sigterm.pipe is not None:
        signal.set_wakeup_fd(_sigterm.wakeup)
        for fd in _sigterm.pipe:
            os.close(fd)
        _sigterm.pipe = None


def _on_main_thread(fn: Callable[..., None]) -> bool:
    """Run ``fn`` on this process's main thread: directly from there, or through this process's Ray
    actor (which runs its tasks there); False where neither can be done."""
    if threading.current_thread() is threading.main_thread():
        fn()
        return True
    import ray

    if not ray.is_initialized():
        return False
    try:
        actor = ray.get_runtime_context().current_actor
    except RuntimeError:  # a thread of a task or driver, not of an actor
        return False
    ray.get(actor.__ray_call__.remote(fn), timeout=60)  # fn(the actor instance)
    return True


def _test_hook_step() -> int | None:
    value = os.environ.get(TEST_HOOK)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{TEST_HOOK}={value!r} is no step number; it is a test hook: unset it") from None


class PreemptionWatcher:
    """One rank's notices of a coming preemption. `notice` is cheap enough for every step: a flag, an
    integer and a clock read, and Ray's notice read at most every ``poll_seconds``."""

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        first_step: int,
        read_info: Callable[[], Any] = compat.ray_train_preemption_info,
        poll_seconds: float = POLL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.read_info, self.poll_seconds, self.clock = read_info, poll_seconds, clock
        hook = _test_hook_step() if rank == world - 1 else None
        self.hook_step = hook if hook is not None and hook > first_step else None
        self.hook_notice: Notice | None = None
        self.info: Any = None  # Ray's notice, once read (a node drain is not taken back)
        self.next_poll = clock()
        self.handles_sigterm = _on_main_thread(_install)
        compat.drop_ray_train_tracebacks(Preempted)  # `stop` logs its own line

    def notice(self, step: int) -> Notice | None:
        """This rank's notice at the step boundary after ``step``, or None."""
        if _sigterm.seen():
            return Notice("SIGTERM")
        if self.hook_step is not None and step >= self.hook_step and self.hook_notice is None:
            self.hook_notice = Notice(f"a drain notice from {TEST_HOOK}", time.time() + TEST_HOOK_DEADLINE_S)
        if self.hook_notice is not None:
            return self.hook_notice
        now = self.clock()
        if self.info is None and now >= self.next_poll:
            self.next_poll = now + self.poll_seconds
            self.info = self.read_info()
        if self.info is None:
            return None
        ranks = ", ".join(map(str, self.info.preempted_ranks))
        deadline = None if not self.info.deadline_ms else self.info.deadline_ms / 1000
        return Notice(f"Ray's preemption notice for the node(s) of rank(s) {ranks}", deadline)

    def close(self) -> None:
        """The SIGTERM handler before ours, back."""
        if self.handles_sigterm:
            self.handles_sigterm = False
            _on_main_thread(_restore)


def decide(every: list[tuple[str | None, float | None, float]]) -> Plan:
    """The plan from every rank's (reason or None, seconds left before its deadline or None, the
    longest its checkpoints took): the same list gives the same plan on every rank."""
    ranks: dict[str, list[int]] = {}
    for rank, (why, _, _) in enumerate(every):
        if why:
            ranks.setdefault(why, []).append(rank)
    why = "; ".join(f"{w} on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}" for w, r in ranks.items())
    lefts = [left for _, left, _ in every if left is not None]
    left = min(lefts) if lefts else None
    need = max(seconds for _, _, seconds in every)
    return Plan(why, left is None or left > need, left, need)


def agree_on_plan(notice: Notice | None, save_seconds: float, group: dist.ProcessGroup | None) -> Plan:
    """Collective, at a preempted step boundary only: every rank's notice gathered, one `decide`."""
    left = None if notice is None or notice.deadline is None else notice.deadline - time.time()
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (notice and notice.why, left, save_seconds), group=group)
    return decide(every)


@dataclass(frozen=True)
class Stop:
    """What every rank does at a preempted step boundary, alike (`agree`): its plan, and whether a
    checkpoint of the step is saved (``saves``), else why none is (``done``) and where the restart resumes."""

    plan: Plan
    step: int
    saves: bool
    done: str  # "" when a checkpoint is saved
    source: str  # what Ray Train's restart resumes from
    max_failures: int
    settled: float  # `time.perf_counter()` when the ranks settled it


def agree(
    watcher: PreemptionWatcher,
    me: Rank,
    step: int,
    checkpointer: Checkpointer,
    *,
    held: bool,
    max_failures: int,
) -> Stop:
    """Collective, at the step boundary where the ranks agreed that one of them has a notice: the plan (one
    gather), and whether a normal checkpoint of ``step`` is saved: not at step 0, nor where one holds the
    step already (``held``), nor where the deadline leaves less time than a checkpoint takes. The loop
    saves it; `stop` then waits for it and stops."""
    # What a save takes, start to storage (an asynchronous one returns before): the checkpointer's record.
    plan = agree_on_plan(watcher.notice(step), checkpointer.longest_seconds, me.group)
    unsaved = Stop(plan, step, False, "", "it", max_failures, time.perf_counter())
    if step == 0:
        return replace(unsaved, done="no step trained yet", source="the start")
    if held:
        return replace(unsaved, done=f"{dcp.checkpoint_name(step)} holds this step already")
    if not plan.save:
        return replace(
            unsaved,
            done=f"{plan.seconds_left:.0f} s left before the deadline and a checkpoint takes "
            f"{plan.save_seconds:.0f} s: none saved",
            source="its latest checkpoint",
        )
    return replace(unsaved, saves=True)


def stop(settled: Stop, checkpointer: Checkpointer, rank: int) -> NoReturn:
    """Collective: once the save in flight is in storage (this step's, or the one before), one log line
    from rank 0, then `Preempted` on every rank."""
    checkpointer.wait()  # written and uploaded before the restart
    done = settled.done or (
        f"{dcp.checkpoint_name(settled.step)} saved in {time.perf_counter() - settled.settled:.1f} s"
    )
    # Ray Train registers a checkpoint only from a report its controller took before this rank raised.
    if not compat.wait_for_ray_train_reports(REPORTS_TIMEOUT_S):
        done += (
            f", but Ray Train had not taken its report after {REPORTS_TIMEOUT_S:.0f} s "
            "(the restart may resume from the checkpoint before)"
        )
    line = (
        f"preempted at step {settled.step} ({settled.plan.why}): {done}; Ray Train restarts the run from "
        f"{settled.source} within --max-failures {settled.max_failures}, or run the same command again"
    )
    if rank == 0:
        log_line(line)
    raise Preempted(line)
