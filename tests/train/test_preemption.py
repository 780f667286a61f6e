"""A checkpoint on a preemption notice (`pipeline.train.checkpointing.preemption`), without Ray: the watcher's flag from
a SIGTERM and from Ray's notice, the test hook, the ranks' agreement (any rank's notice stops every
rank at the same step, with the same plan), and the worker loop in one process, stopped by a notice and
by a SIGTERM and resumed.

Arithmetic (the loop's tests, `tests/train/test_loop.py`): 32 good samples an epoch, micro-batch 4,
batch 8 -> 4 steps an epoch, 8 steps in all; steps 3 and 5 are mid-epoch.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from pipeline import dcp
from pipeline.train.checkpointing import preemption
from pipeline.train.checkpointing.preemption import Notice, Plan, Preempted, PreemptionWatcher, decide
from pipeline.train.driver import read_metrics
from pipeline.train.state import StepAgreement, agree_on_step
from pipeline.train.step.train_step import TrainStep
from tests.distributed import spawn

HOOK = preemption.TEST_HOOK


def loop_tests():
    """`tests.train.test_loop` (its config, fake data, run and weights), imported when a loop test runs:
    the spawned ranks of the agreement test import this module and need neither it nor Ray Data."""
    from tests.train import test_loop

    return test_loop


def no_info() -> None:
    return None


@pytest.fixture
def sigterm_before():
    """A recording SIGTERM handler in place of the process's own, for the test's length."""
    calls: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    before = signal.getsignal(signal.SIGTERM)
    yield before, calls
    signal.signal(signal.SIGTERM, original)


def test_a_sigterm_only_sets_the_flag_and_a_second_one_goes_to_the_handler_before(sigterm_before):
    before, calls = sigterm_before
    watcher = PreemptionWatcher(0, 1, first_step=0, read_info=no_info)
    assert watcher.handles_sigterm and watcher.notice(3) is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert watcher.notice(3) == Notice("SIGTERM") and calls == []  # the handler before: not called
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == [signal.SIGTERM]  # a second SIGTERM: the process's own handler has it
    watcher.close()
    assert signal.getsignal(signal.SIGTERM) is before
    # A new attempt in the same process starts without the last one's signal.
    watcher = PreemptionWatcher(0, 1, first_step=3, read_info=no_info)
    assert watcher.notice(3) is None
    watcher.close()


def test_the_loops_thread_reads_a_sigterm_before_the_main_thread_runs_the_handler(sigterm_before):
    """The interpreter's C-level handler writes the signal's number into the wakeup pipe at once; a Ray
    actor's main thread runs the Python handler only at its next task."""
    before, calls = sigterm_before
    watcher = PreemptionWatcher(0, 1, first_step=0, read_info=no_info)
    try:
        os.write(preemption._sigterm.pipe[1], bytes([signal.SIGINT]))  # another signal: no notice
        assert watcher.notice(1) is None
        os.write(preemption._sigterm.pipe[1], bytes([signal.SIGTERM]))  # as the C-level handler does
        assert watcher.notice(1) == Notice("SIGTERM") and preemption._sigterm.handled == 0
        os.kill(os.getpid(), signal.SIGTERM)  # the same signal's Python handler, run later: no second one
        assert calls == [] and watcher.notice(2) == Notice("SIGTERM")
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGTERM) is before and signal.set_wakeup_fd(-1) == -1


def test_rays_notice_is_read_at_most_every_poll_interval_and_kept():
    from ray.train import PreemptionInfo  # here: the ranks of the spawned test import this module

    now = [100.0]
    reads: list[float] = []
    deadline_ms = 1_700_000_000_000
    info = PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={"node-b": [2, 3]})

    def read_info():
        reads.append(now[0])
        return info if now[0] >= 104 else None

    watcher = PreemptionWatcher(0, 4, first_step=0, read_info=read_info, clock=lambda: now[0])
    try:
        for step in range(300):  # 300 steps in 3 s: Ray's notice read every 2 s, not every step
            now[0] = 100 + step / 100
            assert watcher.notice(step) is None
        assert reads == [100.0, 102.0]
        now[0] = 104.5
        expected = Notice("Ray's preemption notice for the node(s) of rank(s) 2, 3", deadline_ms / 1000)
        assert watcher.notice(300) == expected
        now[0] = 200
        assert watcher.notice(301) == expected and reads == [100.0, 102.0, 104.5]  # kept, not read again
        # A notice without a deadline (Ray's 0 or None): not said.
        late = PreemptionWatcher(0, 4, first_step=0, read_info=lambda: PreemptionInfo(None, {"n": [0]}))
        assert late.notice(0) == Notice("Ray's preemption notice for the node(s) of rank(s) 0", None)
        late.close()
    finally:
        watcher.close()


def test_the_test_hook_gives_the_last_rank_a_notice_once_per_run(monkeypatch):
    monkeypatch.setenv(HOOK, "5")
    first, last = (PreemptionWatcher(r, 2, first_step=0, read_info=no_info) for r in (0, 1))
    resumed = PreemptionWatcher(1, 2, first_step=5, read_info=no_info)  # the attempt after the notice
    try:
        assert last.notice(4) is None
        start = time.time()
        notice = last.notice(5)
        assert notice.why == f"a drain notice from {HOOK}"
        assert start + 59 < notice.deadline <= time.time() + 60
        assert last.notice(6) == notice
        assert first.notice(5) is None and first.notice(9) is None
        assert resumed.notice(5) is None and resumed.notice(9) is None
    finally:
        for watcher in (first, last, resumed):
            watcher.close()
    monkeypatch.setenv(HOOK, "five")
    with pytest.raises(ValueError, match=f"{HOOK}='five' is no step number; it is a test hook: unset it"):
        PreemptionWatcher(0, 1, first_step=0, read_info=no_info)


def test_the_plan_is_every_ranks_reason_the_least_time_left_and_the_longest_save():
    assert decide([(None, None, 1.0), ("SIGTERM", None, 2.0)]) == Plan("SIGTERM on rank 1", True, None, 2.0)
    drain = "Ray's preemption notice for the node(s) of rank(s) 0"
    every = [(drain, 50.0, 4.0), (drain, 49.0, 1.0), ("SIGTERM", None, 0.0)]
    assert decide(every) == Plan(f"{drain} on ranks 0, 1; SIGTERM on rank 2", True, 49.0, 4.0)
    # Less time left on one rank than a checkpoint took on another: no rank saves.
    assert decide([(drain, 3.0, 0.0), (None, None, 5.0)]) == Plan(f"{drain} on rank 0", False, 3.0, 5.0)


def _agreement(rank: int) -> None:
    # No notice: none agreed; rank 1's notice: every rank stops at this step.
    assert agree_on_step(4, False, "", None, preempted=False) == StepAgreement(8, False, "", False)
    assert agree_on_step(4, False, "", None, preempted=rank == 1) == StepAgreement(8, False, "", True)
    assert agree_on_step(4, rank == 0, "", None, preempted=rank == 1) == StepAgreement(8, True, "", True)
    # The plan: the same on both ranks, whichever rank had the notice and whichever saved slower.
    plan = preemption.agree_on_plan(Notice("SIGTERM") if rank == 1 else None, 3.0 * rank, None)
    assert plan == Plan("SIGTERM on rank 1", True, None, 3.0)
    soon = Notice("drain", time.time() + 2) if rank == 0 else None  # 2 s left, a checkpoint took 3 s
    plan = preemption.agree_on_plan(soon, 3.0 * rank, None)
    assert (plan.why, plan.save, plan.save_seconds) == ("drain on rank 0", False, 3.0)
    assert 0 < plan.seconds_left <= 2


def test_one_ranks_notice_is_every_ranks_in_the_steps_agreement():
    spawn(_agreement)


# --- the worker loop in one process ----------------------------------------------------------------


@pytest.fixture
def fake_data(monkeypatch):
    tests = loop_tests()
    monkeypatch.setattr(tests.dataplan, "micro_batches", tests.fake_micro_batches)


@pytest.fixture(scope="module")
def straight(world, tmp_path_factory):
    """The uninterrupted 8-step run's weights (logging every step)."""
    out = tmp_path_factory.mktemp("preemption") / "straight"
    tests = loop_tests()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tests.dataplan, "micro_batches", tests.fake_micro_batches)
        summary, _ = tests.run(tests.config(out, log_every=1), world)
    assert summary["metrics"]["step"] == 8
    return tests.weights(tests.config(out), 8)


def stopped_and_resumed(cfg, device, capsys) -> tuple[str, str, dict]:
    """Run ``cfg`` until it raises `Preempted`, then resume it: (its message, the log, the resume's summary)."""
    with pytest.raises(Preempted) as raised:
        loop_tests().run(cfg, device)
    log = capsys.readouterr().out
    # The next attempt, as Ray Train starts it (the hook still set).
    summary, _ = loop_tests().run(cfg, device)
    return str(raised.value), log, summary


def rows(cfg) -> list[int]:
    return [row["step"] for row in read_metrics(cfg.run.out)]


def test_a_notice_checkpoints_the_step_and_the_resumed_run_ends_as_a_straight_one(
    world, fake_data, straight, monkeypatch, capsys, tmp_path
):
    """The notice at step 5 (mid-epoch, not logged, 3 steps after checkpoint 4)."""
    cfg = loop_tests().config(tmp_path / "run", log_every=2, checkpoint_every=4)
    monkeypatch.setenv(HOOK, "5")
    message, log, summary = stopped_and_resumed(cfg, world, capsys)
    assert message.startswith(
        f"preempted at step 5 (a drain notice from {HOOK} on rank 0): {dcp.checkpoint_name(5)} saved in "
    )
    assert message.endswith(
        "; Ray Train restarts the run from it within --max-failures 3, or run the same command again"
    )
    assert log.splitlines()[-1] == message  # rank 0's one line, after the step's own
    assert log.splitlines()[-2].startswith("step 5/8 ")
    assert summary["resumed_from"]["step"] == 5 and summary["metrics"]["step"] == 8
    assert rows(cfg) == [2, 4, 5, 6, 8]
    resumed = loop_tests().weights(cfg, 8)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    report = loop_tests().audited(cfg.run.out, loop_tests().SHARDS, loop_tests().FAKE_KEYS)
    assert report.ok and report.finished == 1, report.format()


def test_a_sigterm_during_a_step_checkpoints_that_step_and_the_resumed_run_ends_as_a_straight_one(
    world, fake_data, straight, monkeypatch, capsys, tmp_path
):
    """SIGTERM while step 3 runs (logged: its row goes with the checkpoint)."""
    cfg = loop_tests().config(tmp_path / "run", log_every=1, checkpoint_every=4)
    real_passes, sent = TrainStep.forward_backward, []

    def forward_backward(self, index, *args, **kwargs):
        if index == 2 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return real_passes(self, index, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "forward_backward", forward_backward)
    message, _, summary = stopped_and_resumed(cfg, world, capsys)
    assert message.startswith(f"preempted at step 3 (SIGTERM on rank 0): {dcp.checkpoint_name(3)} saved in ")
    assert dcp.is_complete(Path(cfg.run.out) / dcp.checkpoint_name(3))
    assert summary["resumed_from"]["step"] == 3 and summary["metrics"]["step"] == 8
    assert rows(cfg) == list(range(1, 9))  # step 3's row once
    resumed = loop_tests().weights(cfg, 8)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    report = loop_tests().audited(cfg.run.out, loop_tests().SHARDS, loop_tests().FAKE_KEYS)
    assert report.ok and report.finished == 1, report.format()
    assert signal.getsignal(signal.SIGTERM) is not preemption._on_sigterm  # the handler before is back


@pytest.mark.parametrize("log_every", [1, 3])
def test_a_sigterm_between_two_epochs_checkpoints_their_edge_with_one_row_of_the_epoch_it_trained(
    world, fake_data, straight, monkeypatch, capsys, tmp_path, log_every
):
    """SIGTERM once epoch 0 has ended at step 4 and before epoch 1's first step: the checkpoint of step 4
    is saved at epoch 1's first boundary, and step 4 has one row, of epoch 0. Logged every step, its row
    was written at the epoch's last boundary (a loaded machine landed a signal there: a second row of step
    4 followed, of epoch 1, with no samples and a NaN loss); logged every 3, the checkpoint's row is its
    own (it said epoch 1)."""
    from pipeline.train.input.cursor import EpochCursor

    cfg = loop_tests().config(tmp_path / "run", log_every=log_every, checkpoint_every=8)
    real_next_epoch, sent = EpochCursor.next_epoch, []

    def next_epoch(self, *args, **kwargs):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return real_next_epoch(self, *args, **kwargs)

    monkeypatch.setattr(EpochCursor, "next_epoch", next_epoch)
    message, log, summary = stopped_and_resumed(cfg, world, capsys)
    assert message.startswith(f"preempted at step 4 (SIGTERM on rank 0): {dcp.checkpoint_name(4)} saved in ")
    logged = [1, 2, 3, 4] if log_every == 1 else [3, 4]
    assert re.findall(r"^step (\d+)/8 \(", log, re.M) == [str(n) for n in logged]  # step 4's line once
    assert (summary["resumed_from"]["step"], summary["resumed_from"]["epoch"]) == (4, 1)
    history = read_metrics(cfg.run.out)
    steps = list(range(1, 9)) if log_every == 1 else [3, 4, 6, 8]
    assert [(r["step"], r["epoch"]) for r in history] == [(n, (n - 1) // 4) for n in steps]
    assert history[steps.index(4)]["samples_seen"] == 36  # epoch 0's 36 samples, 4 of them bad
    resumed = loop_tests().weights(cfg, 8)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    report = loop_tests().audited(cfg.run.out, loop_tests().SHARDS, loop_tests().FAKE_KEYS)
    assert report.ok and report.finished == 1, report.format()


def test_no_checkpoint_is_tried_when_the_deadline_is_too_near_or_one_holds_the_step(
    world, fake_data, monkeypatch, tmp_path
):
    monkeypatch.setattr(preemption, "TEST_HOOK_DEADLINE_S", 0.0)  # the deadline is now
    monkeypatch.setenv(HOOK, "5")
    cfg = loop_tests().config(tmp_path / "late", checkpoint_every=4)
    with pytest.raises(
        Preempted, match="s: none saved; Ray Train restarts the run from its latest checkpoint"
    ):
        loop_tests().run(cfg, world)
    assert sorted(p.name for p in Path(cfg.run.out).glob("checkpoint_*")) == [dcp.checkpoint_name(4)]

    monkeypatch.setenv(HOOK, "4")  # a step that checkpoint 4 holds
    cfg = loop_tests().config(tmp_path / "held", checkpoint_every=4)
    with pytest.raises(
        Preempted, match=f"{dcp.checkpoint_name(4)} holds this step already; Ray Train restarts"
    ):
        loop_tests().run(cfg, world)


def test_a_preempted_rank_raises_only_once_ray_trains_controller_took_its_last_reports(monkeypatch):
    """Ray Train's controller acts on a worker's error in the poll that sees it, and a report still
    queued then is lost: the restart would resume from the checkpoint before. The wait covers a report
    still in the upload thread (queued after the upload) and one queued but not yet taken."""
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from ray.train.v2._internal.execution import context as ray_context

    from pipeline import compat

    results: queue.Queue = queue.Queue()
    uploads = ThreadPoolExecutor(max_workers=1)  # Ray Train's: one thread, reports in order
    fake = SimpleNamespace(
        checkpoint_upload_threadpool=uploads, execution_context=SimpleNamespace(result_queue=results)
    )
    monkeypatch.setattr(ray_context, "get_train_context", lambda: fake)
    taken: list[float] = []

    def upload_then_report() -> None:
        time.sleep(0.3)  # the upload
        results.put("checkpoint_00000009")

    def controller() -> None:  # polls, takes one report per poll
        while not taken:
            try:
                results.get(timeout=0.1)
            except queue.Empty:
                continue
            time.sleep(0.2)  # the controller's handling of it
            taken.append(time.monotonic())
            results.task_done()

    uploads.submit(upload_then_report)
    poller = threading.Thread(target=controller)
    poller.start()
    try:
        assert compat.wait_for_ray_train_reports(timeout_s=10)
        done = time.monotonic()
        assert taken and taken[0] <= done  # not before the controller took the report
        results.put("never taken")
        assert not compat.wait_for_ray_train_reports(timeout_s=0.2)  # a controller that never polls
    finally:
        poller.join()
        uploads.shutdown()
