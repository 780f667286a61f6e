"""The embedding job over a store that fails: shards read from and embeddings written to a loopback S3
whose every 4th request fails (503, a stall past the read timeout, 500, a dropped connection, in turn).
The run finishes with one row per key and every shard in the manifest (shared local Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import s3fs

import vit
from pipeline.data.config import DataConfig
from pipeline.embed.config import EmbedConfig
from pipeline.embed.job import prepare, run
from pipeline.embed.output import MANIFEST, RECORDS
from tests.embed.test_job import trained_model
from tests.flaky_s3 import FlakyS3, upload_shards

BUCKET = "vitray-faults"


def test_shards_in_and_embeddings_out_through_failing_storage_lose_and_repeat_nothing(
    ray_session, synthetic_shards, tmp_path
):
    model = trained_model()
    extra = {"preprocessing": DataConfig(image_size=32, patch_size=8).to_dict()}
    vit.save_pretrained(tmp_path / "export", model.state_dict(), model.config, extra=extra)
    s3 = FlakyS3(period=4, max_faults=40).start()
    try:
        upload_shards(s3.endpoint, BUCKET, synthetic_shards.urls)
        config = EmbedConfig(
            data=f"s3://{BUCKET}/shards/train-{{000000..000003}}.tar",
            weights=str(tmp_path / "export"),
            out=f"s3://{BUCKET}/emb",
            batch_size=8,
            storage_options=s3.storage_options,
        )
        s3.faulty()
        summary = run(prepare(config))
        s3.faulty(False)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)
        rows = pd.read_parquet(f"{BUCKET}/emb", filesystem=fs)
        manifest = json.loads(fs.cat(f"{BUCKET}/emb/{MANIFEST}"))
        records = fs.ls(f"{BUCKET}/emb/{RECORDS}")
    finally:
        s3.stop()
    assert (summary.committed, summary.failed, summary.rows) == (4, {}, 48)
    assert sorted(rows["key"]) == synthetic_shards.keys  # one row per key: none lost, none twice
    assert sorted(manifest["shards"]) == sorted(
        f"s3://{BUCKET}/shards/{Path(u).name}" for u in synthetic_shards.urls
    )
    assert [r["rows"] for r in manifest["shards"].values()] == [12] * 4 and len(records) == 4
    assert sum(s3.faults.values()) >= 8 and set(s3.faults) == {"503", "stall", "500", "drop"}, s3.faults
