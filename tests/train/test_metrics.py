"""The training log: metrics.jsonl kept as one history across resumes, the log line, the curve PNG."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from pipeline.train.observe import stacks
from pipeline.train.observe.host_copy import HostCopy
from pipeline.train.observe.metrics import MetricsLog, MetricsWindow, format_line, plot_training_curve


def row(step: int, loss: float = 1.0) -> dict:
    return {
        "step": step, "epoch": 0, "loss": loss, "accuracy": 0.5, "lr": 1e-3, "grad_norm": 1.0,
        "images_per_s": 100.0, "images_per_s_per_worker": 50.0, "mfu": None, "data_wait_share": 0.1,
        "samples_seen": 10 * step, "bad_samples": 0, "memory_gib": 0.5,
    }  # fmt: skip


def test_a_resumed_log_drops_what_came_after_its_checkpoint(tmp_path):
    log = MetricsLog(str(tmp_path))
    for step in (10, 20, 30):  # the run died at step 30, after its checkpoint at 20
        log.append(row(step), flush=False)
    resumed = MetricsLog(str(tmp_path), resume_step=20)
    resumed.append(row(30, loss=0.5), flush=True)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(10, 1.0), (20, 1.0), (30, 0.5)]


def test_a_checkpoints_row_is_stored_before_the_save_so_a_run_killed_after_it_keeps_every_row():
    """On an object store rows reach the file at checkpoints. The loop writes the checkpoint's own row
    (`flush(pending=...)`) before it saves; a run killed once the checkpoint registered, before the row
    was appended, resumes with every logged step up to the checkpoint."""
    log = MetricsLog("memory://metrics-test")  # an object store: flushed at checkpoints only
    log.append(row(2), flush=False)
    log.flush(pending=row(4))  # the checkpoint at step 4 saves next; the run dies before its append
    resumed = MetricsLog("memory://metrics-test", resume_step=4)
    assert [r["step"] for r in resumed.rows] == [2, 4]
    assert [r["step"] for r in log.rows] == [2]  # pending is written, not appended


def test_log_line_reads_like_progress():
    line = format_line(
        {**row(120), "mfu": 0.45}, last_step=240, started=time.perf_counter() - 10, first_step=0
    )
    assert line.startswith("step 120/240 (50%) | epoch 0 | loss 1.0000 | acc 50.0%")
    assert "MFU 45.0%" in line and "eta 0:00:1" in line


def test_training_curve_is_a_png(tmp_path):
    path = plot_training_curve(
        [row(s, loss=2.0 / s) for s in range(10, 101, 10)], str(tmp_path / "curve.png")
    )
    with Image.open(path) as im:
        assert im.format == "PNG" and im.width > 400 and im.height > 200
        # Not a blank canvas: the two curves put more than a handful of colours on it.
        assert len(im.convert("RGB").getcolors(maxcolors=100_000)) > 20


def test_a_row_stored_ahead_of_its_save_is_not_written_again_when_appended(monkeypatch):
    """On an object store a checkpoint's row is written once, before its save: its append after the save
    writes nothing, and what the save added to it reaches the file at the next flush."""
    from pipeline import storage

    writes: list[str] = []
    real_write = storage.write_text
    monkeypatch.setattr(
        storage, "write_text", lambda where, text: (writes.append(text), real_write(where, text))
    )
    log = MetricsLog("memory://metrics-ahead-test")
    log.append(row(2), flush=False)
    checkpoint_row = row(4)
    log.flush(pending=checkpoint_row)
    checkpoint_row["checkpoint_stall_s"] = 0.5  # the save, after the write
    log.append(checkpoint_row, flush=True)
    assert len(writes) == 1 and "checkpoint_stall_s" not in writes[0]
    log.append(row(6), flush=True)  # another checkpoint's row, not stored ahead: written
    stalls = [json.loads(line).get("checkpoint_stall_s") for line in writes[-1].splitlines()]
    assert len(writes) == 2 and stalls == [None, 0.5, None]


@pytest.fixture
def collector():
    """Python's collector as it was, after a test whose windows turned it off and froze the heap."""
    yield
    gc.unfreeze()
    gc.enable()


def window_row(window: MetricsWindow, step: int, **kw) -> dict:
    return window.reduce(
        step=step, epoch=0, lr=1e-3, grad_norm=torch.zeros(()), samples_seen=0, bad_samples=0,
        skipped_steps=0, flops_per_image=1.0, peak_tflops=None, **kw,
    )  # fmt: skip


def test_windows_cover_every_second_the_device_backlog_at_a_log_line_included(world, monkeypatch, collector):
    """A log line's wait for the device's backlog (the event behind the window's last step, `HostCopy`)
    belongs to the window it ends (not to no window), the next window starts where it ended, and the
    windows' seconds add up to the run's, to the end of the last wait. The report's host work after the
    wait (its all-reduces of host values, slow here) is in the next window, beside the device's next step."""
    backlog, collective = 0.3, 0.2
    all_reduce = dist.all_reduce

    class Backlog:  # an event recorded behind queued work: its wait is the device's backlog
        def synchronize(self):
            time.sleep(backlog)

    def slow_all_reduce(tensor, *args, **kwargs):
        time.sleep(collective)
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(HostCopy, "record_event", staticmethod(lambda device: Backlog()))
    monkeypatch.setattr(dist, "all_reduce", slow_all_reduce)
    window = MetricsWindow(world)
    started, rows = window.start, []
    for step in (1, 2, 3):
        window.add_step(torch.tensor(1.0), torch.tensor(1), 100, torch.tensor(False))
        time.sleep(0.1)  # the host's part of the window
        rows.append(window_row(window, step))
        previous, window = window, window.next
        assert window.start == previous.end
    seconds = [100 / r["images_per_s"] for r in rows]
    assert sum(seconds) == pytest.approx(previous.end - started, abs=0.05)
    assert seconds[-1] >= 0.1 + backlog + 2 * collective  # its wait, and the row before's all-reduces
    assert seconds[-1] < 0.1 + backlog + 3 * collective  # not its own row's all-reduces
    assert rows[-1]["run_images_per_s"] == pytest.approx(300 / sum(seconds), rel=1e-6)


def test_the_collector_runs_at_log_lines_only_and_its_time_is_reported(world, collector):
    gc.enable()
    window = MetricsWindow(world)
    assert not gc.isenabled()  # no collection in the middle of a step
    frozen_before = gc.get_freeze_count()

    class Cycle:
        pass

    for _ in range(1000):  # garbage only a collection frees
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
    del a, b
    assert gc.get_count()[0] >= 1000  # left for the log line, not collected on the way
    row = window_row(window, 1)
    assert row["gc_s"] > 0
    assert gc.get_count()[0] < 1000
    assert gc.get_freeze_count() > frozen_before  # the warm-up's objects, never walked again
    later = window.next
    assert not gc.isenabled()
    assert window_row(later, 2)["gc_s"] > 0


def test_a_window_well_under_the_runs_median_says_where_the_training_thread_was(tmp_path, capsys):
    log = MetricsLog(str(tmp_path), watch=True)

    def waiting_for_something_slow():
        time.sleep(0.6)

    for step, rate in ((10, 20.0), (20, 100.0), (30, 100.0), (40, 90.0)):  # the first: the start
        log.append({**row(step), "images_per_s": rate}, flush=False)
    assert capsys.readouterr().out == ""  # 10% under: no line; the first window is not compared
    waiting_for_something_slow()
    log.append({**row(50), "images_per_s": 80.0}, flush=False)
    line = capsys.readouterr().out
    assert line.startswith(
        "step 50: 80 img/s, 20% under the run's median (100); the training thread: other 100%"
    )
    assert "test_metrics.py:waiting_for_something_slow" in line


def test_a_slow_window_among_the_first_few_is_not_judged(tmp_path, capsys):
    """A median of one or two windows is no baseline: the window after a run's first checkpoint, which
    holds its save, is not 'under the run's median' of the window before it."""
    log = MetricsLog(str(tmp_path), watch=True)
    for step, rate in ((2, 20.0), (4, 200.0), (5, 23.0), (6, 30.0)):  # the first: the start
        log.append({**row(step), "images_per_s": rate}, flush=False)
    assert capsys.readouterr().out == ""
    log.append({**row(8), "images_per_s": 20.0}, flush=False)  # three earlier windows: now judged
    assert capsys.readouterr().out.startswith("step 8: 20 img/s, ")


def test_the_summary_of_a_window_gives_each_parts_share():
    window = stacks.Window(None, 0.0)
    window.parts.update({"data wait": 8, "step": 1, "other": 1})
    window.other["gc.py:collect"] = 1
    assert stacks.summary(window) == "data wait 80%, step 10%, other 10% (other: gc.py:collect 1)"


def _ranks_at_their_own_pace(rank: int, own: list[float], alike: float, record: str) -> None:
    """Two windows of three steps; in each step a rank works its own seconds (``own[rank]``, then
    ``alike`` for every rank), then waits at the step's agreement (a barrier here) for the others; the
    windows' rows and log lines are written to ``record`` by rank 0."""
    rows = []
    window = MetricsWindow(torch.device("cpu"))
    for pace in (own, [alike] * len(own)):
        for _ in range(3):
            time.sleep(pace[rank])
            agreed = time.perf_counter()
            dist.barrier()
            window.sync_wait += time.perf_counter() - agreed
            window.add_step(torch.tensor(1.0), torch.tensor(1), 4, torch.tensor(False))
        rows.append(window_row(window, 3 * len(rows) + 3))
        window = window.next
    if rank == 0:
        lines = [format_line(r, last_step=6, started=time.perf_counter(), first_step=0) for r in rows]
        with open(record, "w") as f:
            json.dump({"rows": rows, "lines": lines}, f)


def test_each_ranks_step_time_is_recorded_and_a_slow_one_named_in_the_log_line(tmp_path):
    from tests.distributed import spawn

    record = tmp_path / "record.json"
    spawn(_ranks_at_their_own_pace, [0.1, 0.1, 0.5], 0.4, str(record), world_size=3)
    (slow, alike), (slow_line, alike_line) = json.loads(record.read_text()).values()
    step_s = slow["rank_step_s"]
    # Its own time, not the step's (which is the slow rank's for all): the others' waits are left out.
    assert len(step_s) == 3 and step_s[2] >= 0.5 and max(step_s[:2]) < step_s[2] / 2, step_s
    assert f"slowest rank 2: {step_s[2]:.2f} s/step" in slow_line, slow_line
    # Ranks alike (on a loaded machine, within a few tens of ms of each other): no rank named.
    assert all(0.4 <= s < 0.45 * 1.2 for s in alike["rank_step_s"]), alike["rank_step_s"]
    assert "slowest rank" not in alike_line


def test_a_rank_is_named_only_past_twenty_percent_over_the_median():
    from pipeline.train.observe.stragglers import straggler

    assert straggler([1.0, 1.0, 1.19]) == ""
    assert straggler([1.0, 1.0, 1.0, 1.0]) == ""
    assert straggler([1.0]) == ""  # one rank: no median to be behind
    assert straggler([1.0, 1.21, 1.0]) == "slowest rank 1: 1.21 s/step, 21% over the median 1.00"
    line = format_line({**row(10), "rank_step_s": [0.5, 0.5, 0.5, 0.9]}, 20, time.perf_counter(), 0)
    assert "| slowest rank 3: 0.90 s/step, 80% over the median 0.50 |" in line
    assert "slowest" not in format_line({**row(10), "rank_step_s": [0.5, 0.58]}, 20, time.perf_counter(), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_copy_on_cuda_is_read_while_the_work_queued_after_it_still_runs():
    """A log line's read (`host_copy.HostCopy`): pinned memory, a non-blocking copy and an event, so that its
    wait returns the values as of the copy while the next step's kernels (here a kernel that spins)
    is still running, and a later change of the device tensor does not reach them."""
    device = torch.device("cuda")
    values = torch.arange(4, dtype=torch.float64, device=device)
    # Every kernel launched below, launched once first: under CUDA's lazy module loading a kernel's first
    # launch loads its module and may wait for the device to go idle, here for the spinning kernel (on
    # an H200 the first `values += 10` waited it out, and the stream was idle by the check).
    torch.cuda._sleep(1000)
    values += 10
    values -= 10
    torch.cuda.synchronize()
    copy = HostCopy(values)
    assert copy.values.is_pinned() and copy.event is not None
    torch.cuda._sleep(4_000_000_000)  # the next step: a kernel of about 2 s queued behind the copy
    values += 10  # the next step changes what the copy took
    started = time.perf_counter()
    read, seen = copy.wait()
    waited = time.perf_counter() - started
    assert not torch.cuda.current_stream().query(), (
        f"the wait waited {waited:.2f} s, for the work after the copy"
    )
    assert read == [0.0, 1.0, 2.0, 3.0] and seen >= copy.taken
    torch.cuda.synchronize()
