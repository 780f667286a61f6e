"""The data plane in a feeder process (`pipeline.train.feeder`): a feeder killed mid-epoch fails its rank
at once, and the run resumed from its last checkpoint trains the keys a straight run trains at the same
steps (the recorded ones of `tests.train.test_golden`, which `test_golden` checks with the feeder on too).
The worker loop runs in this process (gloo, one rank), its feeder an actor of the shared local Ray."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray

from pipeline.train import loop
from pipeline.train.feeder import FeederPlan
from tests.train import test_golden
from tests.train.test_golden import data_of, keys_config, record_keys, run, stream_of, use_stream

KILL_AT = 4  # before the fifth step: epoch 1 (4 steps an epoch), checkpoints every 3 steps


def test_a_feeder_killed_mid_epoch_fails_its_rank_and_the_run_resumes_with_the_same_keys(
    world, tmp_path, ray_session
):
    recorded = json.loads(test_golden.GOLDEN.read_text())["plain"]["keys"]
    cfg = keys_config("plain", tmp_path / "run").replace(data_process="feeder", checkpoint_every=3)
    killed: dict[str, float] = {}
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of("plain"))
        real = loop.Trainer.train_step

        def train_step(self, data, step_input, agreement):
            if self.state.step == KILL_AT and not killed:
                assert isinstance(self.plan, FeederPlan)
                pid = ray.get(self.plan.feeder.pid.remote())
                assert pid != os.getpid()
                os.kill(pid, signal.SIGKILL)
                killed["at"] = time.monotonic()
            return real(self, data, step_input, agreement)

        mp.setattr(loop.Trainer, "train_step", train_step)
        with pytest.raises(RuntimeError, match="the data feeder of worker 0 died"):
            run(cfg, world, data_of("plain"))
        assert time.monotonic() - killed["at"] < 60  # a failed rank, not a hang
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of("plain"))
        taken = record_keys(mp)
        summary = run(cfg, world, data_of("plain"))["summary"]
    resumed = summary["resumed_from"]["step"]
    assert resumed in (3, 6)  # a checkpoint inside an epoch: the resume re-reads part of it
    assert taken == recorded[resumed:]
