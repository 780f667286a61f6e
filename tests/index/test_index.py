"""jobs/index.py and jobs/search.py on small embedding outputs written with the embedding job's own table
builder: exact search finds each row first, the approximate indexes keep recall@10, keys round-trip,
bad input is one line. One process, no Ray."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

import vit
from pipeline.data.config import DataConfig
from pipeline.embed.identity import CLAIM
from pipeline.embed.output import FORMAT, MANIFEST, embedding_table
from pipeline.index import build, query, search
from pipeline.index.config import IndexConfig
from tests.job_scripts import load_job

index_job, search_job = load_job("index"), load_job("search")


def header(sha: str = "ab" * 32, normalize: bool = True, dtype: str = "float32", **more) -> dict:
    return {
        "format": FORMAT,
        "model": {"name": "vit_tiny_test"},
        "weights": {"sha256": sha},
        "embedding": "cls",
        "output": {"normalize": normalize, "dtype": dtype},
        **more,
    }


def write_output(directory: Path, vectors: np.ndarray, about: dict, *, files: int = 3) -> list[str]:
    """An output as jobs/embed.py leaves it (files, manifest, claim); returns its keys in file order."""
    directory.mkdir(parents=True, exist_ok=True)
    options = about["output"]
    shards, keys = {}, []
    for i, part in enumerate(np.array_split(vectors, files)):
        url = f"s3://b/shard-{i}.tar"
        names = [f"{i}-{j:05d}" for j in range(len(part))]
        table = embedding_table(
            names,
            [url] * len(part),
            part,
            np.full(len(part), -1),
            {**about, "shard": {"url": url}},
            **options,
        )
        pq.write_table(table, directory / f"shard-{i}.parquet")
        shards[url] = {"file": f"shard-{i}.parquet", "rows": len(part)}
        keys += names
    (directory / MANIFEST).write_text(json.dumps({**about, "shards": shards}))
    (directory / CLAIM).write_text(json.dumps(about))
    return keys


def clustered(n: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(20, dim))
    return (centers[rng.integers(0, 20, n)] + 0.5 * rng.normal(size=(n, dim))).astype(np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def built(tmp_path: Path, vectors: np.ndarray, about: dict, **config) -> search.LoadedIndex:
    emb, out = tmp_path / "emb", tmp_path / "index"
    write_output(emb, vectors, about)
    build.build(build.prepare(IndexConfig(embeddings=str(emb), out=str(out), **config)))
    return search.load_index(str(out))


@pytest.fixture(scope="module")
def vectors():
    return clustered(3000)


def test_exact_search_finds_every_row_first_and_keys_round_trip(tmp_path, vectors):
    index = built(tmp_path, vectors, header(), batch_rows=500)  # streamed in 6+ batches
    assert index.manifest["kind"] == "flat" and index.metric == "ip"
    keys = write_output(tmp_path / "again", vectors, header())
    assert list(index.keys) == keys and set(index.urls) == {f"s3://b/shard-{i}.tar" for i in range(3)}
    scores, ids = index.search(unit(vectors), 1)
    np.testing.assert_array_equal(ids[:, 0], np.arange(3000))
    np.testing.assert_allclose(scores[:, 0], 1, atol=1e-5)
    some = ["2-00007", "0-00000"]
    np.testing.assert_allclose(index.vectors(index.ids_of(some)), unit(vectors)[[2007, 0]], atol=1e-6)
    source = index.manifest["source"]
    assert source["weights sha256"] == "ab" * 32 and source["output"] == {
        "normalize": True,
        "dtype": "float32",
    }
    assert source["dim"] == 32 and index.manifest["rows"] == 3000


def test_an_output_not_normalized_is_searched_by_l2_distance_in_float16(tmp_path, vectors):
    index = built(tmp_path, vectors, header(normalize=False, dtype="float16"))
    assert index.metric == "l2"
    scores, ids = index.search(vectors[:50], 3)
    np.testing.assert_array_equal(ids[:, 0], np.arange(50))
    assert (scores[:, 0] < 0.01).all() and (scores[:, 1] > scores[:, 0]).all()


@pytest.mark.parametrize("kind, bound", [("hnsw", 0.95), ("ivfpq", 0.6)])
def test_approximate_recall_at_10_against_exact(tmp_path, vectors, kind, bound):
    exact = built(tmp_path / "flat", vectors, header())
    approx = built(tmp_path / kind, vectors, header(), kind=kind)
    assert approx.manifest["kind"] == kind
    queries = unit(vectors[::30])
    _, truth = exact.search(queries, 10)
    _, got = approx.search(queries, 10)
    recall = np.mean([len(set(t) & set(g)) / 10 for t, g in zip(truth, got, strict=True)])
    assert recall >= bound, recall


def test_auto_chooses_by_rows_and_memory():
    gib = build.GIB
    assert build.choose("auto", 10_000, 768, "ip", 4 * gib).kind == "flat"
    assert build.choose("auto", 1_000_000, 768, "ip", 8 * gib).kind == "hnsw"
    assert build.choose("auto", 1_000_000, 768, "ip", 4 * gib).kind == "ivfpq"  # hnsw peaks at ~6.2 GiB
    compressed = build.choose("auto", 1_000_000, 768, "ip", 1 * gib)
    assert compressed.kind == "ivfpq" and compressed.bytes <= gib and compressed.params["m"] == 384
    assert build.choose("auto", 100_000_000, 768, "ip", 4 * gib).params["m"] == 24
    with pytest.raises(ValueError, match=r"need about .* GiB as hnsw.*--kind ivfpq"):
        build.choose("hnsw", 10_000_000, 768, "ip", 4 * gib)
    # Too few rows to train product-quantized codes (FAISS warned, line after line, and built it anyway).
    with pytest.raises(
        ValueError,
        match=r"^--kind ivfpq trains its codes on at least 80 rows; these outputs hold 79: pass --kind flat",
    ):
        build.choose("ivfpq", 79, 32, "ip", gib)
    assert build.choose("ivfpq", 80, 32, "ip", gib).params["nlist"] == 2


def test_near_duplicates_are_found_once_each(tmp_path, vectors):
    planted = vectors.copy()
    planted[100] = planted[2500] + 1e-4  # one near copy across files
    index = built(tmp_path, planted, header())
    pairs = search.near_duplicates(index, 0.9999, 5)
    assert pairs.to_pylist() == [
        {"key_a": "0-00100", "url_a": "s3://b/shard-0.tar", "key_b": "2-00500", "url_b": "s3://b/shard-2.tar",
         "score": pytest.approx(1, abs=1e-5)}
    ]  # fmt: skip
    out = tmp_path / "dups.parquet"
    code = search_job.main(
        ["--index", str(tmp_path / "index"), "--near-duplicates", "0.9999", "--out", str(out)]
    )
    assert code == 0 and pq.read_table(out).num_rows == 1


def test_near_duplicates_replace_their_own_file_and_no_other(tmp_path, vectors, capsys):
    # --out naming a file that is there already: an earlier run's pairs are replaced; an embedding file
    # or the index's own ids.parquet is left as it was, with one line (it was overwritten, exit 0).
    emb, index = tmp_path / "emb", tmp_path / "index"
    write_output(emb, vectors, header())
    assert index_job.main(["--embeddings", str(emb), "--out", str(index)]) == 0
    args = ["--index", str(index), "--near-duplicates", "0.99"]
    pairs = tmp_path / "dups.parquet"
    assert search_job.main([*args, "--out", str(pairs)]) == 0
    assert search_job.main([*args, "--out", str(pairs)]) == 0  # its own file: replaced
    capsys.readouterr()
    for taken in (emb / "shard-0.parquet", index / "ids.parquet"):
        before = taken.read_bytes()
        one_line_error(
            capsys, search_job.main([*args, "--out", str(taken)]), "exists and is no near-duplicates file"
        )
        assert taken.read_bytes() == before
    (tmp_path / "d.parquet").mkdir()
    (tmp_path / "d.parquet" / "a").write_text("x")
    one_line_error(capsys, search_job.main([*args, "--out", str(tmp_path / "d.parquet")]), "is a directory")


def test_the_jobs_print_neighbours_as_a_table(tmp_path, vectors, capsys):
    emb, out = tmp_path / "emb", tmp_path / "index"
    write_output(emb, vectors, header())
    assert index_job.main(["--embeddings", str(emb), "--out", str(out)]) == 0
    assert "flat index (ip) over 3,000 rows" in capsys.readouterr().out
    assert search_job.main(["--index", str(out), "--key", "1-00003", "--key", "0-00009", "--k", "3"]) == 0
    printed = capsys.readouterr().out
    assert "neighbours of 1-00003 (s3://b/shard-1.tar)" in printed and "neighbours of 0-00009" in printed
    first = printed.split("neighbours of 1-00003")[1].splitlines()[3].split()
    assert first[:3] == ["1", "1-00003", "s3://b/shard-1.tar"] and float(first[3]) == pytest.approx(1)


def test_a_search_for_more_neighbours_than_rows_says_it_gave_fewer(tmp_path, capsys):
    emb, out = tmp_path / "emb", tmp_path / "index"
    write_output(emb, clustered(12), header())
    assert index_job.main(["--embeddings", str(emb), "--out", str(out)]) == 0
    capsys.readouterr()
    assert search_job.main(["--index", str(out), "--key", "0-00000", "--k", "20"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].split()[0] == "12", printed  # every row of the index, and no more
    assert printed[-1] == "  note: 12 neighbours, fewer than --k 20: the index holds 12 rows"
    assert search_job.main(["--index", str(out), "--key", "0-00000", "--k", "12"]) == 0
    assert "note:" not in capsys.readouterr().out


def one_line_error(capsys, code: int, *expected: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    for text in expected:
        assert text in err, err


def test_refusals_are_one_line(tmp_path, vectors, capsys):
    emb, other, out = tmp_path / "emb", tmp_path / "other", tmp_path / "index"
    write_output(emb, vectors, header())
    write_output(other, vectors, header(sha="cd" * 32))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    run = index_job.main
    one_line_error(capsys, run(["--embeddings", str(tmp_path / "nope"), "--out", str(out)]), "does not exist")
    one_line_error(
        capsys, run(["--embeddings", str(tmp_path / "notes"), "--out", str(out)]), "no embedding files"
    )
    one_line_error(
        capsys, run(["--embeddings", f"{emb},{other}", "--out", str(out)]), "mixes outputs", "weights sha256"
    )
    # One output named twice, however spelled: each row would be its own nearest neighbour.
    one_line_error(
        capsys,
        run(["--embeddings", f"{emb},{tmp_path}/./emb/", "--out", str(out)]),
        f"--embeddings names {tmp_path}/./emb/'s files twice (first: {emb}/",
        "name each output once",
    )
    one_line_error(capsys, run(["--embeddings", " , ", "--out", str(out)]), "names no output")
    one_line_error(
        capsys,
        run(["--embeddings", str(emb), "--out", str(tmp_path / "notes")]),
        "did not write",
        "--overwrite",
    )
    assert run(["--embeddings", str(emb), "--out", str(out)]) == 0
    assert (
        run(["--embeddings", str(emb), "--out", str(out), "--kind", "hnsw"]) == 0
    )  # the same model: rebuilt
    capsys.readouterr()
    one_line_error(
        capsys, run(["--embeddings", str(other), "--out", str(out)]), "holds an index of other embeddings"
    )
    assert run(["--embeddings", str(other), "--out", str(out), "--overwrite"]) == 0
    capsys.readouterr()
    find = search_job.main
    one_line_error(capsys, find(["--index", str(out), "--key", "9-99999"]), "--key '9-99999' is not in")
    one_line_error(capsys, find(["--index", str(emb), "--key", "0-00000"]), "not an index")
    one_line_error(capsys, find(["--index", str(out)]), "pass one of --key")
    # Flags the search would ignore: each refused, as it would change nothing.
    one_line_error(
        capsys, find(["--index", str(out), "--key", "0-00000", "--out", str(tmp_path / "p.parquet")]),
        "--out is where --near-duplicates writes its pairs; a query prints, so drop --out",
    )  # fmt: skip
    one_line_error(
        capsys, find(["--index", str(out), "--key", "0-00000", "--weights", str(emb)]),
        "--weights embeds an --image query",
    )  # fmt: skip
    one_line_error(
        capsys, find(["--index", str(out), "--key", "0-00000", "--ef-search", "64"]),
        f"--ef-search tunes an hnsw index; {out} is flat: drop --ef-search",
    )  # fmt: skip
    one_line_error(
        capsys, find(["--index", str(out), "--key", "0-00000", "--nprobe", "8"]),
        f"--nprobe tunes an ivfpq index; {out} is flat: drop --nprobe",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"the query has D = 8 but .* has D = 32"):
        search.load_index(str(out)).search(np.zeros((1, 8), np.float32), 3)


@pytest.mark.parametrize("flag", ["--k", "--nprobe", "--ef-search"])
def test_search_knobs_past_a_c_int_are_refused_at_parse(tmp_path, capsys, flag):
    # --nprobe 10**20 reached FAISS and ended in OverflowError, exit 1.
    args = ["--index", str(tmp_path / "index"), "--key", "0-00000", flag]
    one_line_error(
        capsys, search_job.main([*args, str(10**20)]), f"{flag} must be from 1 to 2,147,483,647, got 100,000,"
    )
    one_line_error(capsys, search_job.main([*args, "0"]), f"{flag} must be from 1 to 2,147,483,647, got 0")


def test_a_query_image_is_embedded_with_the_outputs_model(tmp_path, capsys):
    model = vit.create_model("vit_tiny_test", num_classes=4, image_size=32)
    weights = tmp_path / "export"
    vit.save_pretrained(weights, model.state_dict(), model.config)
    from pipeline.model_source import load_model_source

    sha = load_model_source(str(weights)).sha256
    data = DataConfig.for_eval(None, image_size=32, patch_size=8)
    about = header(sha=sha, image_size=32, preprocessing=data.to_dict())
    image = tmp_path / "q.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), np.uint8)).save(image)
    source = {
        "about": about,
        "embedding": "cls",
        "image_size": 32,
        "weights sha256": sha,
        "output": about["output"],
    }
    mine = query.embed_image(str(image), str(weights), source, 64)
    rows = np.concatenate([clustered(500, 64), mine])
    emb, out = tmp_path / "emb", tmp_path / "index"
    write_output(emb, rows, about, files=1)
    assert index_job.main(["--embeddings", str(emb), "--out", str(out)]) == 0
    capsys.readouterr()
    assert (
        search_job.main(["--index", str(out), "--image", str(image), "--weights", str(weights), "--k", "2"])
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[5].split()[:2] == ["1", "0-00500"], printed
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(io.BytesIO(b"\xff\xd8not a jpeg").getvalue())
    args = ["--index", str(out), "--weights", str(weights), "--image"]
    one_line_error(capsys, search_job.main([*args, str(broken)]), "does not decode")
    one_line_error(
        capsys, search_job.main([*args, str(tmp_path)]), f"--image {tmp_path} is a directory; pass an image file"
    )  # fmt: skip
    other = vit.create_model("vit_tiny_test", num_classes=4, image_size=32)
    vit.save_pretrained(tmp_path / "other", other.state_dict(), other.config)
    one_line_error(
        capsys, search_job.main([*args[:2], "--weights", str(tmp_path / "other"), "--image", str(image)]),
        "are not the weights the indexed output was embedded with",
    )  # fmt: skip


def test_the_training_sample_holds_no_batch_it_came_from(tmp_path):
    import tracemalloc

    emb = tmp_path / "emb"
    write_output(emb, clustered(20_000, 64), header())  # 5 MB of float32 rows
    spec = build.IndexSpec("ivfpq", "ip", 20_000, 64, {"nlist": 8, "nbits": 4})
    readers = build.open_outputs(IndexConfig(embeddings=str(emb), out=str(tmp_path / "i"), batch_rows=1000))
    tracemalloc.start()
    sample = build.training_sample(readers, spec, IndexConfig(embeddings="x", out="y", batch_rows=1000))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sample.shape == (624, 64)  # 16 codes x 39 rows, every 32nd row
    assert peak < 4 * 2**20, peak  # batches in flight and the sample (2.8 MB), not all 5 MB read (7.5 MB)
