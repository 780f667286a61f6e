"""A resume at another world size through Ray Train, by sample: 4 shards x 16 samples, batch 16 of
micro-batches of 8. Two workers take one micro-batch each a step (4 steps an epoch); stopped at step 2,
the run resumes on one worker, two micro-batches a step: the 32 samples epoch 0 had not consumed make
steps 3 and 4, and epoch 1 begins at step 5 (a restart of the epoch would end it at step 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.train.audit import AuditConfig, audit_run
from pipeline.train.driver import fit
from tests.configs import tiny_config

pytestmark = pytest.mark.slow


def test_a_run_stopped_on_two_workers_goes_on_by_sample_on_one(ray_session, tmp_path):
    from pipeline.data.synthetic import write_synthetic_shards

    shards = write_synthetic_shards(
        tmp_path / "shards", 64, samples_per_shard=16, image_size=32, num_classes=4, seed=1
    )
    config = tiny_config(
        data=",".join(shards.urls), out=str(tmp_path / "run"), batch_size=16, micro_batch_size=8, num_workers=2,
        max_steps=6, log_every=1, checkpoint_every=2, shuffle_buffer=16, max_failures=0,
    )  # fmt: skip
    assert fit(config.replace(stop_at_step=2), shards.urls)["error"] == ""
    summary = fit(config.replace(num_workers=1), shards.urls)
    assert summary["error"] == "" and summary["resumed_from"]["step"] == 2
    rows = [json.loads(line) for line in (Path(config.run.out) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1)]
    assert rows[3]["samples_seen"] == 64  # every sample of epoch 0 read once across the two runs
    report = audit_run(AuditConfig(run=config.run.out))  # and trained once, as the ledger holds
    assert report.ok and report.finished == 1, report.format()
