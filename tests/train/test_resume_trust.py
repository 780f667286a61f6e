"""A resumed run reads its own checkpoint without trusting it: a crafted ``.metadata`` in the run's
latest checkpoint stops the run in one line, and the command in it never runs (2 CPU workers on Ray)."""

from __future__ import annotations

import os
import pickle

import pytest

from pipeline import dcp
from pipeline.train.config import TrainConfig
from pipeline.train.driver import TrainingError, fit

pytestmark = pytest.mark.slow


class _Exploit:
    """Unpickling it runs ``touch <sentinel>``: the sentinel's absence proves nothing ran."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_a_crafted_metadata_stops_the_resume_in_one_line_and_runs_nothing(ray_session, tmp_path):
    from pipeline.data.synthetic import write_synthetic_shards

    shards = write_synthetic_shards(
        tmp_path / "shards", 32, samples_per_shard=16, image_size=32, num_classes=4, seed=1
    )
    out = tmp_path / "run"
    config = TrainConfig(
        model="vit_tiny_test",
        image_size=32,
        num_classes=4,
        data=",".join(shards.urls),
        out=str(out),
        batch_size=16,
        micro_batch_size=8,
        num_workers=2,
        use_gpu=False,
        max_steps=4,
        log_every=2,
        checkpoint_every=2,
        shuffle_buffer=16,
        max_failures=2,  # a refusal must not be retried: every restart would refuse again
    )
    fit(config.replace(stop_at_step=2), shards.urls)
    latest = out / dcp.checkpoint_name(2)
    assert dcp.is_complete(latest)
    sentinel = tmp_path / "pwned"
    (latest / dcp.METADATA).write_bytes(pickle.dumps(_Exploit(sentinel)))

    with pytest.raises(TrainingError, match=r"refusing to unpickle it; remove that checkpoint") as info:
        fit(config, shards.urls)
    assert "\n" not in str(info.value) and not sentinel.exists()
    assert not (out / dcp.checkpoint_name(4)).exists()
