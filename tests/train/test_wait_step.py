"""The host benchmark's device-shaped step (`jobs/benchmarks/host.py`): it stands for a real step in
what the run's checkpoints see, in a one-rank world (gloo); and its device, a queue of waits that the
host runs ahead of (as a CUDA stream lets it) until the loop reads a device value."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from pipeline.train.observe.metrics import MetricsWindow, SkippedSteps
from pipeline.train.step.model import build_model
from pipeline.train.step.objective import objective_for
from tests.configs import tiny_config
from tests.job_scripts import load_job

host = load_job("benchmarks/host")
WAIT_S = 0.5  # a device step: long beside a thread's start on a loaded machine


def test_the_wait_step_leaves_the_optimizer_state_of_a_first_step_and_the_weights(
    world, monkeypatch, tmp_path
):
    """Its run's first checkpoint must not be the one to make the optimizer's state (seconds of host time
    in DCP's state dict, which a real run spends in its first step), and no weight moves."""
    monkeypatch.setenv(host.STEPS_ENV, f"50,0,{tmp_path}")
    config = tiny_config(out=str(tmp_path / "run"))
    model = build_model(config, world)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = host.wait_step_class(host.DeviceQueue(0))(model, config, world, objective_for(config))
    assert len(step.optimizer.state) == len(before)  # each parameter's moments, as after a step
    for name, p in model.named_parameters():
        assert torch.equal(whole(p), whole(before[name])), name
        assert p.grad is None


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (FSDP's are DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def launch(device, ends: dict[int, float], i: int) -> float:
    """Wait ``i`` launched on ``device``, its end into ``ends``; when the launch returned."""
    device.launch(WAIT_S, lambda when: ends.__setitem__(i, when))
    return time.time()


def test_with_a_queue_of_one_a_step_returns_at_once_and_a_third_waits_behind_the_running_and_the_pending():
    device, ends = host.DeviceQueue(1), {}
    first, second = launch(device, ends, 1), launch(device, ends, 2)
    assert not ends and first < second  # both returned while the first wait runs, the second pending
    third = launch(device, ends, 3)  # two in: it waits until the device takes the second
    assert ends[1] <= third < ends.get(2, float("inf"))
    device.drain()
    assert sorted(ends) == [1, 2, 3]
    assert ends[2] - ends[1] >= WAIT_S and ends[3] - ends[2] >= WAIT_S  # one after another


@pytest.mark.parametrize("depth", [0, 1])
def test_a_step_holds_the_host_for_its_wait_without_a_queue_and_not_with_one(depth):
    """``--device-queue 0`` is the benchmark as it was: each step's call ends with its wait."""
    device, ends = host.DeviceQueue(depth), {}
    returned = launch(device, ends, 1)
    device.drain()
    assert (returned >= ends[1]) == (depth == 0)


def test_a_log_lines_read_waits_until_the_device_ran_its_step_and_not_the_step_queued_after(monkeypatch):
    """The loop's plain log line at step N closes its window behind step N, queues step N+1, then reads
    (`pipeline.train.observe.host_copy.HostCopy`): the read waits for step N's end on the device, as a CUDA event
    recorded after step N would, not for step N+1's."""
    device, ends = host.DeviceQueue(1), {}
    host.wait_at_device_reads(device, monkeypatch.setattr)
    window = MetricsWindow(torch.device("cpu"))
    launch(device, ends, 1)
    window.add_step(torch.tensor(1.0), torch.tensor(1), 4, torch.tensor(False))
    window.close(torch.tensor(0.5), SkippedSteps(torch.device("cpu")))  # step 1's log line
    launch(device, ends, 2)  # the next step, queued
    asked = time.time()
    window.wait()
    answered = time.time()
    assert asked < ends[1] <= answered < ends.get(2, float("inf"))  # step 1 ended, step 2 still running
    assert window.next is not None and window.next.start == window.end  # the next window starts there
    device.drain()
    assert device.ended == device.total == 2


def test_every_read_of_a_device_value_in_the_loop_drains_the_device_first(monkeypatch):
    device, ends, seen = host.DeviceQueue(1), {}, {}
    for owner, name in host.device_reads():  # each read, as a stand-in that says whether the device was idle
        monkeypatch.setattr(
            owner, name, lambda *_, key=name: seen.setdefault(key, []).append(device.launched)
        )
    host.wait_at_device_reads(device, monkeypatch.setattr)
    for i, (owner, name) in enumerate(host.device_reads()):
        launch(device, ends, i)
        assert device.launched == 1  # the device busy as the read begins
        getattr(owner, name)()
    assert seen == {name: [0] for _, name in host.device_reads()} and len(ends) == len(seen)


def test_the_steps_record_the_device_ends_and_the_host_time_outside_the_waits(world, monkeypatch, tmp_path):
    """Each step's row: its host seconds since the last call returned, less a device read's wait between,
    and when its wait ended on the device (spaced by the step at least: the device runs one at a time)."""
    monkeypatch.setenv(host.STEPS_ENV, f"{1000 * WAIT_S},1,{tmp_path}")
    config = tiny_config(out=str(tmp_path / "run"))
    device = host.DeviceQueue(1)
    step = host.wait_step_class(device)(build_model(config, world), config, world, objective_for(config))
    batch = [(torch.zeros(2, 4), torch.zeros(2))]
    called = time.time()
    step(0, batch, 2)
    step(1, batch, 2)
    returned = time.time()
    device.drain()  # a log line's read: not host time
    time.sleep(0.05)  # host work
    step(2, batch, 2)
    step(3, batch, 2)
    device.drain()
    rows = host.read_steps(tmp_path)
    assert [r[0] for r in rows] == [1, 2, 3, 4]
    ends = [r[2] for r in rows]
    assert returned < ends[0]  # two steps queued, neither waited for
    assert all(later - earlier >= WAIT_S for earlier, later in itertools.pairwise(ends))
    assert called <= rows[0][4] and rows[2][3] >= rows[1][4]  # when called; when the call before returned
    assert 0.05 <= rows[2][1] < WAIT_S / 2  # the host's 50 ms, without the drain's wait


def test_the_device_runs_its_queue_on_its_own_clock_however_late_its_thread_wakes(monkeypatch):
    """A GPU starts a queued step when the one before ends, not when the host's interpreter lock lets a
    thread see that: here each of the device thread's sleeps overruns by 0.2 s."""
    sleep = time.sleep
    monkeypatch.setattr(host.time, "sleep", lambda seconds: sleep(seconds + 0.2))
    device, ends = host.DeviceQueue(2), {}
    launched = time.time()
    for i in range(3):
        launch(device, ends, i)
    device.drain()
    assert ends[0] == pytest.approx(launched + WAIT_S, abs=0.05)
    assert ends[1] - ends[0] == pytest.approx(WAIT_S) and ends[2] - ends[1] == pytest.approx(WAIT_S)
