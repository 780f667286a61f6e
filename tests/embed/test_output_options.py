"""--normalize and --dtype: unit rows, float16 storage, part of the output's identity, read back by evaluate.

Units without Ray first (the table, the identity, a claimed output refusing other options); then one
real run on the shared Ray."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.embed.config import EmbedConfig
from pipeline.embed.identity import difference
from pipeline.embed.job import NonFiniteEmbeddingError, ShardSink, prepare, run
from pipeline.embed.output import MANIFEST, METADATA_KEY, embedding_table
from pipeline.embed.reader import load_embeddings
from tests.embed.test_job import export  # noqa: F401  (a module fixture: the tiny export)

HEADER = {"format": "vitray-embeddings", "model": {"config": {"name": "m"}}, "weights": {"sha256": "ab"}}


def test_the_table_holds_unit_rows_and_float16_values():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 8)).astype(np.float32) * 3
    x[2] = 0  # a zero row stays zero, not NaN
    table = embedding_table([str(i) for i in range(5)], ["u"] * 5, x, np.arange(5), {}, normalize=True)
    rows = np.array(table["embedding"].to_pylist(), np.float32)
    np.testing.assert_allclose(np.linalg.norm(rows[[0, 1, 3, 4]], axis=1), 1, rtol=1e-6)
    assert not rows[2].any()
    half = embedding_table(["a"] * 5, ["u"] * 5, x, np.arange(5), {}, dtype="float16")
    assert half.schema.field("embedding").type == pa.list_(pa.float16(), 8)
    back = np.array(half["embedding"].to_pylist(), np.float32)
    np.testing.assert_allclose(back, x, rtol=1e-3)


def test_the_options_are_part_of_the_identity_and_older_outputs_are_plain_float32():
    plain = {**HEADER, "output": {"normalize": False, "dtype": "float32"}}
    assert difference(HEADER, plain) is None  # written before the options were recorded
    assert difference(plain, {**HEADER, "output": {"normalize": True, "dtype": "float32"}}) == (
        "output normalize False there, True now"
    )
    assert difference(plain, {**HEADER, "output": {"normalize": False, "dtype": "float16"}}) == (
        "output dtype 'float32' there, 'float16' now"
    )


def test_a_rerun_with_other_options_into_one_out_is_refused(synthetic_shards, export, tmp_path):  # noqa: F811
    config = EmbedConfig(
        data=synthetic_shards.dir,
        weights=export[0],
        out=str(tmp_path / "out"),
        normalize=True,
        dtype="float16",
    )
    plan = prepare(config)
    plan.output.start(plan.work)  # the claim and the first manifest, as a run's start writes them
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["output"] == {"normalize": True, "dtype": "float16"}
    with pytest.raises(ValueError, match=r"output dtype 'float16' there, 'float32' now.*--overwrite"):
        prepare(config.replace(dtype="float32"))
    with pytest.raises(ValueError, match="output normalize True there, False now"):
        prepare(config.replace(normalize=False))
    assert prepare(config).work.pending  # the same options resume it
    with pytest.raises(ValueError, match="--dtype must be one of float32, float16"):
        config.replace(dtype="bfloat16").validate()


def test_values_beyond_float16_are_refused_before_the_shard_is_committed(synthetic_shards, export, tmp_path):  # noqa: F811
    config = EmbedConfig(
        data=synthetic_shards.dir, weights=export[0], out=str(tmp_path / "o"), dtype="float16"
    )
    sink = ShardSink(prepare(config), bad=None, on_commit=None)
    part = {"key": np.array(["a", "b"]), "embedding": np.array([[1.0, 2.0], [7e4, 0.0]], np.float32)}
    with pytest.raises(NonFiniteEmbeddingError, match=r"key 'b'.*pass --normalize .* or --dtype float32"):
        sink._check_finite(part, "u")
    sink.header = {**sink.header, "output": {"normalize": True, "dtype": "float16"}}
    sink._check_finite(part, "u")  # normalized rows fit


def test_evaluate_reads_float16_outputs(tmp_path):
    from tests.evaluate.test_evaluate_job import clustered, write_output

    labels = np.repeat([0, 1, 2], 4)
    features = clustered(labels)
    out = write_output(tmp_path / "half", features, labels)
    for f in out.glob("*.parquet"):  # the same rows stored as float16
        table = pq.read_table(f)
        about = json.loads(table.schema.metadata[METADATA_KEY])
        rows = np.array(table["embedding"].to_pylist(), np.float32)
        half = embedding_table(
            table["key"].to_pylist(), table["url"].to_pylist(), rows, table["label"].to_numpy(), about,
            dtype="float16",
        )  # fmt: skip
        pq.write_table(half, f)
    loaded = load_embeddings(str(out))
    assert loaded.features.dtype == np.float32 and loaded.features.shape == (12, 6)
    np.testing.assert_allclose(loaded.features, features, atol=2e-3)


def test_a_run_writes_normalized_float16_rows_and_records_it(ray_session, synthetic_shards, export, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    config = EmbedConfig(
        data=synthetic_shards.dir,
        weights=export[0],
        out=str(out),
        batch_size=8,
        normalize=True,
        dtype="float16",
    )
    summary = run(prepare(config))
    assert summary.rows == 48
    files = sorted(Path(out).glob("*.parquet"))
    first = pq.read_table(files[0])
    assert first.schema.field("embedding").type == pa.list_(pa.float16(), 64)
    assert json.loads(first.schema.metadata[METADATA_KEY])["output"] == {
        "normalize": True,
        "dtype": "float16",
    }
    loaded = load_embeddings(str(out))
    np.testing.assert_allclose(np.linalg.norm(loaded.features, axis=1), 1, atol=2e-3)
