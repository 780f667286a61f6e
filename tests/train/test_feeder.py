"""The data plane in a feeder process (`pipeline.train.input.feeder`): a feeder killed mid-epoch fails its rank
at once, and the run resumed from its last checkpoint trains the keys a straight run trains at the same
steps (the recorded ones of `tests.train.test_golden`, which `test_golden` checks with the feeder on too).
The worker loop runs in this process (gloo, one rank), its feeder an actor of the shared local Ray.
And what the training process does with a feeder's reply: the step's tensors, on CUDA through pinned
buffers reused and a copy stream of its own."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch

from pipeline.data.bad_samples import BadSamples
from pipeline.train import loop
from pipeline.train.input import feeder
from pipeline.train.input.feeder import DeviceCopies, FeederInputs, FeederPlan
from tests.train import test_golden, test_loop
from tests.train.test_golden import data_of, keys_config, run, stream_of, use_stream
from tests.train.test_loop import Seen

KILL_AT = 1  # in epoch 0 (4 steps an epoch), checkpoints every 3 steps; see the test


def test_a_feeder_killed_mid_epoch_fails_its_rank_and_the_run_resumes_with_the_same_keys(
    world, tmp_path, ray_session
):
    # The rest of epoch 0's inputs may be received before the kill (2 in flight, 2 ready ahead), so the
    # rank fails when it asks for epoch 1's first, which the dead feeder never sent.
    recorded = json.loads(test_golden.GOLDEN.read_text())["plain"]["keys"]
    cfg = keys_config("plain", tmp_path / "run").replace(data_process="feeder", checkpoint_every=3)
    killed: dict[str, float] = {}
    feeders: list = []

    class KillTheFeeder(loop.StepWatch):
        def taken(self, step):
            if step.step == KILL_AT + 1 and not killed:
                pid = ray.get(feeders[0].pid.remote())
                assert pid != os.getpid()
                os.kill(pid, signal.SIGKILL)
                killed["at"] = time.monotonic()

    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of("plain"))
        real_start = FeederPlan.start
        mp.setattr(FeederPlan, "start", lambda plan: feeders.append(real_start(plan)) or feeders[-1])
        with pytest.raises(RuntimeError, match="the data feeder of worker 0 died"):
            run(cfg, world, data_of("plain"), KillTheFeeder())
        assert time.monotonic() - killed["at"] < 60  # a failed rank, not a hang
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of("plain"))
        seen = Seen()
        summary = run(cfg, world, data_of("plain"), seen)["summary"]
    resumed = summary["resumed_from"]["step"]
    assert resumed in (3, 6)  # a checkpoint inside an epoch: the resume re-reads part of it
    assert seen.keys == recorded[resumed:]
    report = test_loop.audited(cfg.run.out, test_loop.SHARDS, test_loop.FAKE_KEYS)  # what its ledger holds
    assert report.ok and report.finished == 1, report.format()


def reply(columns: dict[str, np.ndarray], micro_batches: int = 2) -> dict:
    """A feeder's reply (`Feeder.next`) of ``micro_batches`` copies of ``columns``, read-only as arrays
    mapped from the object store are."""
    for array in columns.values():
        array.flags.writeable = False
    keys = [f"k{i}" for i in range(len(columns["label"]))]
    return {
        "micro_batches": [dict(columns) for _ in range(micro_batches)], "keys": keys * micro_batches,
        "samples": len(keys) * micro_batches, "ran_dry": False, "error": "",
        "bad_samples": BadSamples().to_dict(), "consumed": [], "counted": [], "tallied": [], "tallied_bad": [],
        "dry": None,
    }  # fmt: skip


def step_arrays() -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    return {"patches": g.integers(0, 256, (4, 16, 48), dtype=np.uint8), "label": g.integers(0, 10, 4)}


def test_a_replys_arrays_become_the_steps_tensors_which_the_step_may_write():
    arrays = step_arrays()
    inputs = FeederInputs(None, 0, rank=0, columns=("patches", "label"), in_flight=1, copies=DeviceCopies())
    fed = inputs.step_input(reply(arrays))
    assert fed.samples == 8 and len(fed.micro_batches) == 2
    for patches, label in fed.micro_batches:
        assert np.array_equal(patches.numpy(), arrays["patches"]) and np.array_equal(
            label.numpy(), arrays["label"]
        )
        patches[0, 0, 0] = 1  # a copy: the object store's arrays are read-only
    assert fed.to_device(torch.device("cpu")) is fed.micro_batches


class Replies:
    """A feeder without Ray for `FeederInputs`: each ``next.remote`` is the reply itself (``wait`` is patched
    to return it); the ``dry_at``-th reply carries the stream's final counts, the one after it ran dry."""

    def __init__(self, arrays: dict[str, np.ndarray], dry_at: int):
        self.arrays, self.dry_at, self.sent = arrays, dry_at, 0
        self.next = SimpleNamespace(remote=self.reply)
        self.close = SimpleNamespace(remote=lambda epoch: None)

    def reply(self, epoch: int) -> dict:
        self.sent += 1
        answer = reply(self.arrays)
        if self.sent == self.dry_at:
            answer["dry"] = BadSamples().to_dict()
        if self.sent > self.dry_at:
            answer.update(micro_batches=[], keys=[], samples=0, ran_dry=True)
        return answer


def test_replies_are_received_and_copied_ahead_on_a_thread_of_their_own(monkeypatch):
    """The training thread only takes a step that is ready: the replies are received, and their arrays
    copied out of the object store, on the inputs' own thread, before any step asks (on an H200 that copy
    on the training thread was a tenth of each B/16 step). The final counts reach `ran_dry` once the
    training thread has taken the reply carrying them; then the stream's end, and empty inputs after it."""
    copied_on, ready = [], threading.Event()
    step_input = FeederInputs.step_input

    def copying(self, answer):
        copied_on.append(threading.current_thread())
        if len(copied_on) == FeederInputs.READY:
            ready.set()
        return step_input(self, answer)

    monkeypatch.setattr(FeederInputs, "step_input", copying)
    monkeypatch.setattr(FeederInputs, "wait", lambda self, ref: ref)
    inputs = FeederInputs(
        Replies(step_arrays(), dry_at=3), 0, rank=0, columns=("patches", "label"), in_flight=2,
        copies=DeviceCopies(),
    )  # fmt: skip
    inputs.start()
    assert ready.wait(30)  # two steps received and copied, none asked for
    here = threading.current_thread()
    taken, dry = [], []
    for _ in range(5):
        taken.append(inputs.next())
        dry.append(inputs.ran_dry() is not None)
    assert [t.samples for t in taken] == [8, 8, 8, 0, 0] and [t.ran_dry for t in taken] == [False] * 3 + [
        True
    ] * 2
    assert copied_on and here not in copied_on
    assert dry == [False, False, True, True, True]  # the third reply carried the final counts
    inputs.close()


@pytest.mark.gpu
def test_on_cuda_fed_steps_reach_the_device_through_pinned_buffers_reused_across_epochs_on_a_copy_stream():
    device = torch.device("cuda")
    copies = DeviceCopies.on(device)  # one for the run: every epoch's inputs copy with it
    pinned = []
    for epoch in range(3):
        inputs = FeederInputs(None, epoch, rank=0, columns=("patches", "label"), in_flight=1, copies=copies)
        arrays = step_arrays()
        fed = inputs.step_input(reply(arrays))
        assert all(t.is_pinned() for mb in fed.micro_batches for t in mb)
        pinned.append({t.data_ptr() for mb in fed.micro_batches for t in mb})
        on_device = fed.to_device(device)
        inputs.release(fed)
        for patches, label in on_device:
            assert patches.device.type == "cuda"
            assert torch.equal(patches.cpu(), torch.from_numpy(arrays["patches"].copy()))
            assert torch.equal(label.cpu(), torch.from_numpy(arrays["label"].copy()))
    assert pinned[0] == pinned[1] == pinned[2]  # allocated once, for the steps of every epoch


class Silent:
    """A feeder that never answers."""

    def next(self, epoch: int) -> dict:
        time.sleep(120)
        return {}

    def close(self, epoch: int) -> None:
        pass


def test_a_feeder_silent_past_the_bound_fails_its_rank_instead_of_hanging(ray_session, monkeypatch):
    monkeypatch.setattr(feeder, "WAIT_S", 2.0)
    silent = ray.remote(Silent).remote()
    inputs = FeederInputs(silent, 0, rank=3, columns=("patches", "label"), in_flight=2, copies=DeviceCopies())
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the data feeder of worker 3 sent no step input in 2 s"):
        inputs.next()
    assert time.monotonic() - started < 30
    inputs.close()
    ray.kill(silent)


def test_the_calls_in_flight_are_capped_by_the_object_store_and_the_setting_is_bounded():
    """Before: --prefetch-steps 10^9 was taken, and the training thread submitted that many calls to its
    feeder before its first step."""
    from pipeline.train.input.feeder import calls_in_flight, step_bytes
    from tests.configs import tiny_config

    with pytest.raises(ValueError, match=r"^--prefetch-steps must be from 0 to 256, got 1,000,000,000$"):
        tiny_config(prefetch_steps=10**9).validate()
    # ViT-H/14 at 224 px, 32 images a micro-batch, 8 micro-batches a step: 39 MB a step.
    h14 = tiny_config(image_size=224, micro_batch_size=32, batch_size=256, num_workers=1)
    size = step_bytes(h14, h14.data_for(14), accum=8)
    assert size == 32 * 8 * 256 * (14 * 14 * 3 + 8)
    gib = 1 << 30
    # 8 ranks sharing 64 GiB of object store: a quarter of it is 2 GiB each for replies in flight, 54 steps.
    assert calls_in_flight(256, size, 64 * gib, 8) == 54
    assert calls_in_flight(8, size, 64 * gib, 8) == 8  # the setting, where memory holds it
    assert calls_in_flight(256, size, 256 << 20, 8) == 1  # never fewer than one
    assert calls_in_flight(0, size, 64 * gib, 8) == 1


def test_a_plan_in_a_feeder_keeps_no_more_calls_in_flight_than_its_node_holds(ray_session, monkeypatch):
    """The shared Ray's object store (2 GiB): a quarter of it holds 55 steps of 9.7 MB, not 256."""
    from pipeline.train.input import feeder as feeder_module
    from pipeline.train.state import Rank
    from tests.configs import tiny_config

    config = tiny_config(
        image_size=224, micro_batch_size=32, batch_size=64, num_workers=1, prefetch_steps=256
    )
    config = config.replace(data_process="feeder")
    data_config = config.data_for(16)
    me = Rank(0, 1, torch.device("cpu"), None, 2)
    monkeypatch.setattr(feeder_module, "plan_for", lambda *args: FakeInline())
    plan = feeder_module.feeder_plan_for({}, config, data_config, me, ("patches", "label"))
    per_step = 32 * 2 * 196 * (16 * 16 * 3 + 8)
    assert plan.depth == (2 << 30) // 4 // per_step == 55


class FakeInline:
    """What `FeederPlan` reads of an inline plan when it is made."""

    fingerprint = "f"
    columns = ("patches", "label")
