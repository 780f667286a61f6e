"""The embedding output under concurrency and at scale: per-shard records, a manifest written twice a
run, two runs into one ``--out`` at once, the identity claim (local and on a loopback S3), file names
that every reader sees. Units without Ray first, then real runs on the shared Ray."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import vit
from pipeline import storage
from pipeline.data.config import DataConfig
from pipeline.embed.config import EmbedConfig
from pipeline.embed.identity import CLAIM, OutputClaimedError
from pipeline.embed.job import prepare, run
from pipeline.embed.output import (
    FORMAT,
    MANIFEST,
    RECORDS,
    EmbeddingOutput,
    assign_names,
    embedding_table,
    output_name,
    visible,
)
from pipeline.embed.reader import load_embeddings
from tests.embed.test_job import trained_model

HEADER = {
    "format": "vitray-embeddings",
    "version": 1,
    "model": {"config": {"name": "m"}},
    "weights": {"sha256": "ab" * 32},
    "dim": 4,
}
OTHER = {**HEADER, "weights": {"sha256": "cd" * 32}}  # the same model, other weights


def shard_table(url: str, n: int = 3, header: dict = HEADER):
    keys = [f"{Path(url).stem}-{i}" for i in range(n)]
    about = {**header, "shard": {"url": url, "rows": n}}  # what the job writes; planning checks it
    return embedding_table(keys, [url] * n, np.ones((n, 4), np.float32), np.arange(n), about)


def commit(output: EmbeddingOutput, plan, url: str, n: int = 3) -> None:
    output.commit(url, plan.names[url], shard_table(url, n, output.header), [])


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def test_a_commit_costs_the_same_whatever_the_number_of_shards(tmp_path, monkeypatch):
    writes: list[tuple[str, int]] = []
    original = storage.write_text

    def counting(where, text):
        writes.append((str(where).rsplit("/", 1)[-1], len(text)))
        original(where, text)

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
    in_flight = tmp_path / f".{plan_a.names[shards[1]]}{storage.TEMP_MARK}0123456789ab"
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


def test_a_run_of_other_weights_loses_the_claim_and_leaves_nothing(tmp_path):
    shards = [f"/data/train-{i:06d}.tar" for i in range(2)]
    a, b = EmbeddingOutput(str(tmp_path), HEADER), EmbeddingOutput(str(tmp_path), OTHER)
    plan_a, plan_b = a.plan(shards, overwrite=False), b.plan(shards, overwrite=False)  # both: empty
    a.start(plan_a)
    commit(a, plan_a, shards[0])
    before = snapshot(tmp_path)
    with pytest.raises(OutputClaimedError, match=r"weights sha256 abab.* there, cdcd.* now") as info:
        b.start(plan_b)
    assert "\n" not in str(info.value) and "--overwrite" in str(info.value)
    assert snapshot(tmp_path) == before  # nothing written, nothing removed
    with pytest.raises(ValueError, match="holds embeddings of another configuration"):
        b.plan(shards, overwrite=False)  # a later run is refused before any cluster work
    # An --overwrite run takes the output over; the run it replaced stops at its next commit, unpublished.
    c = EmbeddingOutput(str(tmp_path), OTHER)
    c.start(c.plan(shards, overwrite=True))
    with pytest.raises(OutputClaimedError, match="weights sha256"):
        commit(a, plan_a, shards[1])
    assert sorted(snapshot(tmp_path)) == [CLAIM, MANIFEST]
    assert json.loads((tmp_path / CLAIM).read_text())["weights"] == OTHER["weights"]


def test_the_claim_is_exclusive_on_local_disk_with_hard_links_and_without(tmp_path, monkeypatch):
    path = str(tmp_path / "a" / CLAIM)
    assert storage.create_text(path, "first") and not storage.create_text(path, "second")
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(PermissionError("no hard links")))
    other = str(tmp_path / "b" / CLAIM)
    assert storage.create_text(other, "first") and not storage.create_text(other, "second")
    assert [Path(p).read_text() for p in (path, other)] == ["first", "first"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [CLAIM, CLAIM]  # no temporaries


@pytest.fixture(scope="module")
def s3_options():
    """A loopback S3 (moto's server) with one bucket; yields the storage options that reach it."""
    from moto import server as moto_server

    from tests.flaky_s3 import s3_client

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3_client(endpoint).create_bucket(Bucket="claims")
    yield {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    server.stop()


def test_on_s3_the_claim_holds_with_a_conditional_create_and_without_one(s3_options, monkeypatch):
    fs, _ = storage.Location("s3://claims", s3_options).fs()

    def objects(prefix: str) -> dict[str, bytes]:
        fs.invalidate_cache()
        return {p: fs.cat_file(p) for p in fs.find(prefix)}

    shards = [f"/data/train-{i:06d}.tar" for i in range(2)]
    # s3fs sends If-None-Match: the run that comes second fails at its start, as on local disk.
    out = storage.Location("s3://claims/conditional", s3_options)
    a, b = EmbeddingOutput(out, HEADER), EmbeddingOutput(out, OTHER)
    plan_a, plan_b = a.plan(shards, overwrite=False), b.plan(shards, overwrite=False)
    a.start(plan_a)
    commit(a, plan_a, shards[0])
    before = objects("claims/conditional")
    with pytest.raises(OutputClaimedError, match="weights sha256"):
        b.start(plan_b)
    assert objects("claims/conditional") == before

    # A backend without a conditional create (fsspec before 2024.12): the claim is written where none
    # is found, then read back.
    original = fs.pipe_file
    monkeypatch.setattr(fs, "pipe_file", lambda path, value, **kw: original(path, value))
    assert "mode" not in inspect.signature(out.fs()[0].pipe_file).parameters
    claim = out.at("s3://claims/plain/" + CLAIM)
    assert storage.create_text(claim, "{}") and not storage.create_text(claim, "[]")
    assert fs.cat_file("claims/plain/" + CLAIM) == b"{}"
    # Two runs that both found no claim both write it; the later write stands. The run it displaced
    # stops at its next commit and publishes nothing; the other goes on.
    out = out.at("s3://claims/race")
    a, b = EmbeddingOutput(out, HEADER), EmbeddingOutput(out, OTHER)
    plan_a, plan_b = a.plan(shards, overwrite=False), b.plan(shards, overwrite=False)
    a.start(plan_a)
    storage.write_text(out.join(CLAIM), json.dumps({**OTHER, "run": b.run_id}))  # B's write
    with pytest.raises(OutputClaimedError, match="weights sha256"):
        commit(a, plan_a, shards[0])
    b.start(plan_b)
    for url in shards:
        commit(b, plan_b, url)
    b.finish()
    files = [p for p in objects("claims/race") if p.endswith(".parquet")]
    assert len(files) == 2 and all(
        json.loads(pq.read_schema(fs.open(p)).metadata[b"vitray"])["weights"] == OTHER["weights"]
        for p in files
    )


def test_output_names_are_visible_unique_and_a_pure_function_of_the_url():
    shards = ["/d/_a.tar", "/d/.b.tar", "/d/c.tmp-1.tar", "/a/x.tar", "/b/x.tar", "s3://k/val 01.tar.gz"]
    names = assign_names(shards)
    assert len(set(names.values())) == len(shards)
    for name in names.values():
        assert visible(name) and name.endswith(".parquet") and "." not in name.removesuffix(".parquet")
        assert not storage.is_temporary(f"{name}.json")  # its record is no temporary either
    assert [names[u].rsplit("-", 1)[0] for u in shards] == ["a", "b", "c-tmp-1", "x", "x", "val-01"]
    assert names == {u: output_name(u) for u in shards}  # whatever else a run holds, in any order
    assert not visible("_a.parquet") and not visible(".b.parquet") and visible("c.tmp-1.parquet")
    assert storage.is_temporary(storage.temporary_name(f"/o/{names['/a/x.tar']}").name)


def test_shards_named_like_hidden_or_temporary_files_are_read_and_kept(tmp_path):
    shards = ["/d/_a.tar", "/d/.b.tar", "/d/c.tmp-1.tar"]
    output = EmbeddingOutput(str(tmp_path), HEADER)
    plan = output.plan(shards, overwrite=False)
    output.start(plan)
    for url in shards:
        commit(output, plan, url, n=128)
    output.finish()
    import duckdb

    assert len(pd.read_parquet(tmp_path)) == 384  # pandas, pyarrow and DuckDB read every shard's rows
    assert duckdb.sql(f"SELECT count(*) FROM '{tmp_path}/*.parquet'").fetchall() == [(384,)]
    hours_ago = time.time() - 2 * 3600
    for path in tmp_path.iterdir():
        os.utime(path, (hours_ago, hours_ago))
    again = EmbeddingOutput(str(tmp_path), HEADER).plan(shards, overwrite=False)
    assert (again.delete, again.pending, sorted(again.done)) == ([], [], sorted(shards))


def test_two_runs_over_shards_of_one_file_name_keep_both(tmp_path):
    a, b = EmbeddingOutput(str(tmp_path), HEADER), EmbeddingOutput(str(tmp_path), HEADER)
    plan_a, plan_b = a.plan(["/a/x.tar"], overwrite=False), b.plan(["/b/x.tar"], overwrite=False)
    a.start(plan_a)
    b.start(plan_b)
    commit(a, plan_a, "/a/x.tar")
    commit(b, plan_b, "/b/x.tar")
    a.finish()
    b.finish()
    assert sorted(pq.read_table(tmp_path)["url"].to_pylist()) == ["/a/x.tar"] * 3 + ["/b/x.tar"] * 3
    assert {r["file"] for r in manifest(tmp_path)["shards"].values()} == {
        output_name("/a/x.tar"),
        output_name("/b/x.tar"),
    }


def test_older_outputs_resume_under_their_names_unless_readers_skip_them(tmp_path):
    output = EmbeddingOutput(str(tmp_path), HEADER)
    plan = output.plan(["/d/_a.tar", "/d/b.tar"], overwrite=False)
    plan.names.update({"/d/_a.tar": "_a.parquet", "/d/b.tar": "b.parquet"})  # as an older version named them
    output.start(plan)
    commit(output, plan, "/d/b.tar")
    output.finish()
    again = EmbeddingOutput(str(tmp_path), HEADER).plan(["/d/b.tar", "/d/c.tar"], overwrite=False)
    assert (again.names["/d/b.tar"], list(again.done), again.pending) == (
        "b.parquet",
        ["/d/b.tar"],
        ["/d/c.tar"],
    )
    commit(output, plan, "/d/_a.tar")
    output.finish()
    assert len(load_embeddings(str(tmp_path)).keys) == 6  # evaluate reads what the manifest lists
    with pytest.raises(ValueError, match=r"1 file\(s\) that Parquet readers skip \(e\.g\. _a\.parquet\)"):
        EmbeddingOutput(str(tmp_path), HEADER).plan(["/d/b.tar"], overwrite=False)
    redo = EmbeddingOutput(str(tmp_path), HEADER).plan(["/d/_a.tar", "/d/b.tar"], overwrite=True)
    assert "_a.parquet" in redo.delete and all(visible(n) for n in redo.names.values())


RECORDED = Path(__file__).with_name("recorded")


def test_an_output_an_older_version_wrote_from_signed_urls_resumes_by_the_shards_names(tmp_path):
    """``recorded/signed_urls``: an output as vitray wrote it (at 336f444) before shards were named
    without their query strings: two shards read through URLs signed ``sig=first`` (their file names,
    records, footers and rows hold the signature) and a local one. Signed again, the same shards are
    done, under the files they have; another configuration is refused as before; what is written now
    holds names only."""
    out = tmp_path / "out"
    shutil.copytree(RECORDED / "signed_urls", out)
    old = manifest(out)["shards"]
    shards = ["https://store.example/d/a.tar", "https://store.example/d/b.tar", "/d/c.tar"]
    plan = EmbeddingOutput(str(out), HEADER).plan(shards, overwrite=False)
    assert (sorted(plan.done), plan.pending, plan.strays) == (sorted(shards), [], [])
    assert [plan.names[u] for u in shards] == [r["file"] for r in old.values()]  # the files it has
    with pytest.raises(ValueError, match="holds embeddings of another configuration") as info:
        EmbeddingOutput(str(out), OTHER).plan(shards, overwrite=False)
    assert "\n" not in str(info.value)
    output = EmbeddingOutput(str(out), HEADER)
    plan = output.plan([*shards, "https://store.example/d/e.tar"], overwrite=False)
    assert plan.pending == ["https://store.example/d/e.tar"]
    output.start(plan)
    commit(output, plan, "https://store.example/d/e.tar")
    output.finish()
    assert sorted(manifest(out)["shards"]) == sorted([*shards, "https://store.example/d/e.tar"])
    assert "sig=" not in (out / MANIFEST).read_text()
    assert "sig=" not in (out / RECORDS / f"{output_name('https://store.example/d/e.tar')}.json").read_text()
    assert len(load_embeddings(str(out)).keys) == 12  # evaluate reads every file the manifest lists


# --- real runs on Ray ------------------------------------------------------------------------


def test_two_runs_at_once_into_one_out_give_one_row_per_key(
    ray_session, synthetic_shards, tiny_export_32px, tmp_path
):
    out = tmp_path / "out"
    urls = synthetic_shards.urls
    # Overlapping halves: shard 1 and 2 are embedded by both runs, at the same time.
    configs = [
        EmbedConfig(data=",".join(part), weights=tiny_export_32px, out=str(out), batch_size=8)
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
    assert sorted(p.name for p in (out / RECORDS).iterdir()) == sorted(f"{output_name(u)}.json" for u in urls)
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


def test_an_output_written_before_native_patches_is_a_square_ones():
    from pipeline.embed.output import difference

    before = {k: v for k, v in DataConfig().to_dict().items() if k not in ("patches", "max_patches")}
    square, native = (DataConfig(patches=p).to_dict() for p in ("square", "native"))
    headers = [{**HEADER, "preprocessing": data} for data in (before, square, native)]
    assert difference(headers[0], headers[1]) is None  # what every output before then held
    assert difference(headers[0], headers[2]) == "preprocessing patches 'square' there, 'native' now"


def test_two_runs_of_other_weights_into_one_fresh_out_leave_one_model(
    ray_session, synthetic_shards, tiny_export_32px, tmp_path
):
    other = trained_model(seed=1)
    vit.save_pretrained(tmp_path / "other", other.state_dict(), other.config)
    out = tmp_path / "out"
    configs = [
        EmbedConfig(data=synthetic_shards.dir, weights=weights, out=str(out), batch_size=8)
        for weights in (tiny_export_32px, str(tmp_path / "other"))
    ]
    plans = [prepare(c) for c in configs]  # both find a fresh --out, before either has claimed it
    run(plans[0])
    before = snapshot(out)
    with pytest.raises(OutputClaimedError, match="weights sha256") as info:
        run(plans[1])
    assert "\n" not in str(info.value)
    assert snapshot(out) == before  # the run that lost the claim left nothing
    loaded = load_embeddings(str(out))  # what jobs/evaluate.py scores: one model's rows
    assert loaded.weights_sha256 == plans[0].source.sha256 and sorted(loaded.keys) == synthetic_shards.keys


def test_an_output_of_a_newer_version_is_refused_by_every_reader_in_one_line(tmp_path):
    """A claim or manifest from a newer vitray may hold fields this one would not check: refused, naming
    the file, where it was resumed into or read before."""
    from pipeline.embed import identity
    from pipeline.embed.reader import output_files

    newer = {"format": FORMAT, "version": 99, "shards": {}}
    (tmp_path / MANIFEST).write_text(json.dumps(newer))
    with pytest.raises(ValueError, match=rf"^{tmp_path / MANIFEST} is version 99 of the embedding output"):
        EmbeddingOutput(str(tmp_path), {}).read_manifest()
    with pytest.raises(
        ValueError, match=r"is version 99 of the embedding output, newer than this vitray reads"
    ):
        output_files(str(tmp_path))
    (tmp_path / CLAIM).write_text(json.dumps(newer))
    with pytest.raises(ValueError, match=rf"^{tmp_path / CLAIM} is version 99"):
        identity.read(tmp_path)
