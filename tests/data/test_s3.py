"""An s3:// shard set on a real S3 endpoint (moto's server on loopback) reads like a local one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import s3fs  # noqa: F401 (the s3:// filesystem: a test dependency, never skipped when missing)
from moto import server as moto_server

from pipeline.data.config import DataConfig
from pipeline.data.dataset import build_dataset, check_shards
from pipeline.data.shards import ShardError, expand_shards
from pipeline.storage import Location
from tests.flaky_s3 import upload_shards

BUCKET = "vitray-test"


@pytest.fixture(scope="module")
def s3(synthetic_shards):
    """Upload the synthetic shards; yields the storage options that reach the endpoint."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    upload_shards(endpoint, BUCKET, synthetic_shards.urls)
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    yield options, endpoint
    server.stop()


def test_s3_urls_expand_and_fail_clearly(s3, synthetic_shards, monkeypatch):
    options, endpoint = s3
    names = [Path(u).name for u in synthetic_shards.urls]
    want = [f"s3://{BUCKET}/shards/{n}" for n in names]
    assert expand_shards(Location(f"s3://{BUCKET}/shards/train-{{000000..000003}}.tar", options)) == want
    assert expand_shards(Location(f"s3://{BUCKET}/shards/", options)) == want
    assert expand_shards(Location(f"s3://{BUCKET}/shards/*.tar", options)) == want
    with pytest.raises(ShardError, match=r"shard not found: s3://vitray-test/shards/train-000004\.tar"):
        expand_shards(Location(f"s3://{BUCKET}/shards/train-{{000000..000004}}.tar", options))
    # The endpoint and credentials may come from the environment instead.
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert expand_shards(Location(f"s3://{BUCKET}/shards/train-*.tar", {"skip_instance_cache": True})) == want


def test_s3_shards_read_like_local_ones_in_ray_workers(ray_session, s3, synthetic_shards):
    options, _ = s3
    local_config = DataConfig(image_size=32, patch_size=8)
    s3_config = DataConfig(image_size=32, patch_size=8, storage_options=options)
    urls = expand_shards(Location(f"s3://{BUCKET}/shards/train-{{000000..000003}}.tar", options))
    check_shards(urls, s3_config)

    def rows(ds):
        batches = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
        return {k: np.concatenate([b[k] for b in batches]) for k in ("key", "label", "patches", "error")}

    remote = rows(build_dataset(urls, s3_config, train=False))
    local = rows(build_dataset(synthetic_shards.urls, local_config, train=False))
    assert set(remote["error"]) == {""}
    assert list(remote["key"]) == list(local["key"]) == synthetic_shards.keys
    assert list(remote["label"]) == list(local["label"])
    np.testing.assert_array_equal(remote["patches"], local["patches"])


def test_s3_reads_through_5xx_timeouts_and_drops_deliver_every_sample_once(ray_session, synthetic_shards):
    """Every 2nd request to the store fails (503, a stall past the read timeout, 500, a dropped
    connection, in turn; 30 at most): the rows are still the local rows, each sample exactly once."""
    from tests.flaky_s3 import FlakyS3

    s3 = FlakyS3(period=2, max_faults=30).start()
    try:
        options = s3.storage_options
        upload_shards(s3.endpoint, BUCKET, synthetic_shards.urls)
        s3.faulty()
        urls = expand_shards(Location(f"s3://{BUCKET}/shards/train-{{000000..000003}}.tar", options))
        config = DataConfig(image_size=32, patch_size=8, storage_options=options, read_backoff_s=0.2)
        batches = list(build_dataset(urls, config, train=False).iter_batches(batch_size=None))
        remote = {k: np.concatenate([b[k] for b in batches]) for k in ("key", "error", "patches")}
        local = build_dataset(synthetic_shards.urls, DataConfig(image_size=32, patch_size=8), train=False)
        local_patches = np.concatenate([b["patches"] for b in local.iter_batches(batch_size=None)])
    finally:
        s3.stop()
    assert set(remote["error"]) == {""}
    assert list(remote["key"]) == synthetic_shards.keys
    np.testing.assert_array_equal(remote["patches"], local_patches)
    assert set(s3.faults) == {"503", "stall", "500", "drop"}, s3.faults  # faults of every kind happened
