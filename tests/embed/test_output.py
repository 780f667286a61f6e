"""The embedding output under concurrency and at scale: per-shard records, a manifest written twice a
run, two runs into one ``--out`` at once. Units without Ray first, then two real runs on the shared Ray."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import vit
from pipeline import storage
from pipeline.data.config import DataConfig
from pipeline.embed.config import EmbedConfig
from pipeline.embed.job import prepare, run
from pipeline.embed.output import MANIFEST, RECORDS, EmbeddingOutput, embedding_table

HEADER = {"format": "vitray-embeddings", "version": 1, "model": {"config": {"name": "m"}}, "dim": 4}


def shard_table(url: str, n: int = 3):
    keys = [f"{Path(url).stem}-{i}" for i in range(n)]
    about = {"shard": {"url": url, "rows": n}}  # what the job writes; planning checks it
    return embedding_table(keys, [url] * n, np.ones((n, 4), np.float32), np.arange(n), about)


def commit(output: EmbeddingOutput, plan, url: str) -> None:
    output.commit(url, plan.names[url], shard_table(url), [])


def manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def test_a_commit_costs_the_same_whatever_the_number_of_shards(tmp_path, monkeypatch):
    writes: list[tuple[str, int]] = []
    original = storage.write_text

    def counting(uri, text, storage_options=None):
        writes.append((uri.rsplit("/", 1)[-1], len(text)))
        original(uri, text, storage_options)

    monkeypatch.setattr(storage, "write_text", counting)
    shards = [f"/data/train-{i:06d}.tar" for i in range(200)]
    output = EmbeddingOutput(str(tmp_path), HEADER)
    plan = output.plan(shards, overwrite=False)
    output.start(plan)
    for url in shards:
        commit(output, plan, url)
    output.finish()
    manifest_writes = [size for name, size in writes if name == MANIFEST]
    record_writes = [size for name, size in writes if name != MANIFEST]
    assert len(manifest_writes) == 2  # once at the start, once at the end: not once per shard
    assert len(record_writes) == 200 and max(record_writes) - min(record_writes) <= 2  # same size each
    assert sorted(manifest(tmp_path)["shards"]) == shards
    again = EmbeddingOutput(str(tmp_path), HEADER).plan(shards, overwrite=False)
    assert (len(again.done), again.pending) == (200, [])


def test_two_runs_over_other_shards_into_one_output_lose_no_record(tmp_path):
    shards = [f"/data/train-{i:06d}.tar" for i in range(4)]
    a, b = EmbeddingOutput(str(tmp_path), HEADER), EmbeddingOutput(str(tmp_path), HEADER)
    plan_a, plan_b = a.plan(shards[:2], overwrite=False), b.plan(shards[2:], overwrite=False)
    a.start(plan_a)
    # A commit of run A in flight (its hidden temporary) while run B starts: B must leave it alone.
    in_flight = tmp_path / f".train-000001.parquet{storage.TEMP_MARK}0123456789ab"
    in_flight.write_bytes(b"PAR1 half a file")
    b_plan_again = b.plan(shards[2:], overwrite=False)
    assert in_flight.name not in b_plan_again.delete
    b.start(b_plan_again)
    assert in_flight.exists()
    in_flight.unlink()
    commit(a, plan_a, shards[0])
    commit(b, plan_b, shards[2])
    commit(a, plan_a, shards[1])
    a.finish()  # A ends first; B commits later and ends last
    commit(b, plan_b, shards[3])
    b.fail(shards[3], "unreadable shard: once")  # a failure record does not undo a commit
    b.finish()
    assert sorted(manifest(tmp_path)["shards"]) == shards
    assert manifest(tmp_path)["failed"] == {}
    # The other order: the run that started first writes its manifest last, from records it never made.
    c = EmbeddingOutput(str(tmp_path), HEADER)
    c.start(c.plan(shards[:1], overwrite=False))
    c.finish()
    assert sorted(manifest(tmp_path)["shards"]) == shards
    plan = EmbeddingOutput(str(tmp_path), HEADER).plan(shards, overwrite=False)
    assert (sorted(plan.done), plan.pending) == (shards, [])


def test_a_crash_leftover_temporary_goes_once_it_is_old(tmp_path):
    output = EmbeddingOutput(str(tmp_path), HEADER)
    old = tmp_path / f".x.parquet{storage.TEMP_MARK}0123456789ab"
    old.write_bytes(b"PAR1")
    assert old.name not in output.plan([], overwrite=False).delete
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    assert old.name in output.plan([], overwrite=False).delete


# --- two real runs on Ray ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", num_classes=4).eval()
    path = tmp_path_factory.mktemp("export")
    data = DataConfig(image_size=32, patch_size=8)
    vit.save_pretrained(path, model.state_dict(), model.config, extra={"preprocessing": data.to_dict()})
    return str(path)


def test_two_runs_at_once_into_one_out_give_one_row_per_key(ray_session, synthetic_shards, export, tmp_path):
    out = tmp_path / "out"
    urls = synthetic_shards.urls
    # Overlapping halves: shard 1 and 2 are embedded by both runs, at the same time.
    configs = [
        EmbedConfig(data=",".join(part), weights=export, out=str(out), batch_size=8)
        for part in (urls[:3], urls[1:])
    ]
    plans = [prepare(c) for c in configs]  # both plan before either commits
    errors: list[BaseException] = []

    def go(plan):
        try:
            run(plan)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    keys = pq.read_table(str(out))["key"].to_pylist()
    assert sorted(keys) == synthetic_shards.keys  # every key, exactly once
    assert sorted(manifest(out)["shards"]) == sorted(urls)
    assert sorted(p.name for p in (out / RECORDS).iterdir()) == sorted(
        f"{Path(u).name.removesuffix('.tar')}.parquet.json" for u in urls
    )
    again = run(prepare(configs[0].replace(data=",".join(urls))))
    assert (again.committed, again.already_done, again.rows_in_output) == (0, 4, 48)


def test_an_output_written_before_the_regularization_fields_stays_this_models():
    from pipeline.embed.output import difference

    before = vit.get_config("vit_tiny_test").to_dict()
    for name in vit.REGULARIZATION_FIELDS:
        del before[name]
    now = vit.get_config("vit_tiny_test", drop_path_rate=0.1, dropout=0.1).to_dict()
    headers = [{**HEADER, "model": {"config": config}} for config in (before, now, {**now, "embed_dim": 32})]
    assert difference(headers[0], headers[1]) is None  # eval mode: the same function
    assert difference(headers[0], headers[2]) == "model embed_dim 64 there, 32 now"
