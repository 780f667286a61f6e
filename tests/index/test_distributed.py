"""jobs/index.py --ray-tasks on the tests' Ray: trained once, rows added in Ray tasks by groups of files,
the shards merged in file order into the very index one process builds; hnsw refused, a file that
does not read ends the run in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline import cli
from pipeline.index import build, distributed, search
from pipeline.index.config import IndexConfig
from tests.index.test_index import clustered, header, index_job, one_line_error, unit, write_output

FILES = 5  # of 600 rows each: 3 tasks take 2, 1 and 2 files


@pytest.fixture
def tests_ray(ray_session, monkeypatch):
    """The job joins the tests' Ray instead of starting its own."""
    joined = []
    monkeypatch.setattr(cli, "connect_ray", lambda args, needed_cpus: joined.append(needed_cpus) or True)
    return joined


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_ray_tasks_build_the_index_one_process_builds(tmp_path, tests_ray, capsys, kind):
    vectors = clustered(3000)
    emb = tmp_path / "emb"
    keys = write_output(emb, vectors, header(), files=FILES)
    one, ray = tmp_path / "one", tmp_path / "ray"
    build.build(build.prepare(IndexConfig(embeddings=str(emb), out=str(one), kind=kind, batch_rows=250)))
    args = ["--embeddings", str(emb), "--out", str(ray), "--kind", kind, "--batch-rows", "250"]
    assert index_job.main([*args, "--ray-tasks", "3"]) == 0
    assert tests_ray == [1] and "adding in 3 Ray tasks" in capsys.readouterr().out

    assert (ray / "index.faiss").read_bytes() == (one / "index.faiss").read_bytes()
    assert pq.read_table(ray / "ids.parquet").equals(pq.read_table(one / "ids.parquet"))
    a, b = search.load_index(str(one)), search.load_index(str(ray))
    assert list(b.keys) == keys and b.manifest["kind"] == kind
    queries = unit(vectors[::37])
    for got, want in zip(b.search(queries, 10), a.search(queries, 10), strict=True):
        np.testing.assert_array_equal(got, want)
    assert b.manifest["source"] == a.manifest["source"]
    assert b.manifest["source"]["weights sha256"] == "ab" * 32 and b.manifest["rows"] == 3000
    assert b.manifest["build"]["ray_tasks"] == 3 and a.manifest["build"]["ray_tasks"] == 0


def test_files_are_grouped_in_order_with_their_first_ids(tmp_path):
    emb, copy = tmp_path / "emb", tmp_path / "copy"  # two outputs of one model
    write_output(emb, clustered(3000), header(), files=FILES)
    shutil.copytree(emb, copy)
    plan = build.prepare(IndexConfig(embeddings=f"{emb},{copy}", out=str(tmp_path / "i"), ray_tasks=3))
    groups = distributed.file_groups(plan, 3)
    files = [
        [f"{Path(r.uri).name}/{Path(f.url).name}" for r in readers for f in r.files] for readers, _ in groups
    ]
    assert files == [
        ["emb/shard-0.parquet", "emb/shard-1.parquet", "emb/shard-2.parquet"],
        ["emb/shard-3.parquet", "emb/shard-4.parquet", "copy/shard-0.parquet", "copy/shard-1.parquet"],
        ["copy/shard-2.parquet", "copy/shard-3.parquet", "copy/shard-4.parquet"],
    ]  # fmt: skip
    assert [first for _, first in groups] == [0, 1800, 4200]
    assert [len(readers) for readers, _ in groups] == [1, 2, 1]  # a group spans the two outputs
    assert len(distributed.file_groups(plan, 50)) == 2 * FILES  # never more tasks than files


def test_hnsw_is_refused_and_auto_takes_a_kind_that_merges(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "connect_ray", lambda *a, **k: pytest.fail("Ray joined for a refused build"))
    emb = tmp_path / "emb"
    write_output(emb, clustered(300), header())
    args = ["--embeddings", str(emb), "--out", str(tmp_path / "i"), "--ray-tasks", "2"]
    one_line_error(
        capsys, index_job.main([*args, "--kind", "hnsw"]), "--ray-tasks cannot build an hnsw index",
        "pass --kind ivfpq or --kind flat",
    )  # fmt: skip
    one_line_error(
        capsys,
        index_job.main([*args[:4], "--ray-tasks", "-1"]),
        "--ray-tasks must be from 0 to 65,536, got -1",
    )
    gib = build.GIB
    assert build.choose("auto", 1_000_000, 768, "ip", 8 * gib).kind == "hnsw"
    assert build.choose("auto", 1_000_000, 768, "ip", 8 * gib, mergeable=True).kind == "ivfpq"
    assert build.choose("auto", 10_000, 768, "ip", 8 * gib, mergeable=True).kind == "flat"


def test_a_file_that_does_not_read_fails_its_task_in_one_line(tmp_path, tests_ray, capsys):
    emb, out = tmp_path / "emb", tmp_path / "index"
    write_output(emb, clustered(3000), header(), files=FILES)
    broken = emb / "shard-3.parquet"
    column = pq.ParquetFile(broken).metadata.row_group(0).column(2)  # embedding: footer kept, pages not
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(broken.read_bytes())
    data[start : start + 64] = b"\xff" * 64
    broken.write_bytes(bytes(data))
    code = index_job.main(["--embeddings", str(emb), "--out", str(out), "--kind", "flat", "--ray-tasks", "2"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_RUN_FAILED, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: --embeddings "), err
    assert "shard-3.parquet is not an embedding file" in err, err
    assert not (out / build.INDEX_MANIFEST).exists()
    assert json.loads((emb / "_manifest.json").read_text())["shards"]  # the output itself untouched
