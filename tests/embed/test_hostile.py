"""Hostile input through the embedding job (shared local Ray).

A shard whose member names climb out of directories: output file names come from shard URLs, never
from keys; the keys land in the ``key`` column as they are, and the only files the job writes are its
own, under ``--out``. Weights that pass every check and still give NaN (finite values that overflow):
no NaN row is ever written; the run stops in one line, exit 1, with that shard uncommitted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import vit
from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.data.synthetic import encode, render
from pipeline.embed.config import EmbedConfig
from pipeline.embed.identity import CLAIM
from pipeline.embed.job import NonFiniteEmbeddingError, ShardSink, prepare, run
from pipeline.embed.output import MANIFEST, RECORDS, output_name
from tests.data.test_hostile import hostile_shard
from tests.embed.test_job import embed_job, trained_model


def overflowing_export(path: Path) -> Path:
    """Finite weights, a sane config, and still no finite embedding: [CLS] + its position embedding
    is 6e38, past float32's largest number, so every token turns NaN in the first attention."""
    model = trained_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["cls_token"].fill_(3e38)
    state["pos_embed"][0].fill_(3e38)
    vit.save_pretrained(path, state, model.config)
    return path


def test_a_nan_embedding_is_never_committed(synthetic_shards, tmp_path):
    out = tmp_path / "out"
    url = synthetic_shards.urls[0]
    plan = prepare(EmbedConfig(data=url, weights=str(overflowing_export(tmp_path / "w")), out=str(out)))
    plan.output.start(plan.work)
    sink = ShardSink(plan, BadSamples.from_config(plan.data_config), on_commit=None)

    def batch(embeddings: np.ndarray, first: int) -> dict[str, np.ndarray]:
        n = len(embeddings)
        return {
            "key": np.array([f"k{first + i}" for i in range(n)], dtype=object),
            "url": np.array([url] * n, dtype=object),
            "embedding": embeddings.astype(np.float32),
            "label": np.zeros(n, np.int64),
            "error": np.array([""] * n, dtype=object),
        }

    sink.add(batch(np.ones((3, 64)), 0))  # finite rows of the same shard go on collecting
    poisoned = np.ones((3, 64))
    poisoned[1, 7] = np.nan
    with pytest.raises(NonFiniteEmbeddingError, match=r"NaN or infinite embeddings for 1 image\(s\)") as e:
        sink.add(batch(poisoned, 3))
    assert "'k4'" in str(e.value) and url in str(e.value) and "\n" not in str(e.value)
    assert sink.committed == 0 and not list(out.glob("*.parquet"))


def test_weights_that_overflow_stop_the_job_in_one_line_with_nothing_committed(
    ray_session, synthetic_shards, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(embed_job.cli, "connect_ray", lambda *args, **kwargs: False)  # the shared Ray
    out = tmp_path / "out"
    weights = overflowing_export(tmp_path / "w")
    args = ["--data", synthetic_shards.urls[0], "--weights", str(weights), "--out", str(out), "--cpu"]
    assert embed_job.main([*args, "--batch-size", "4", "--label-key", "none"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the model gave NaN or infinite embeddings"), err
    assert not list(out.glob("*.parquet"))


def test_climbing_and_absolute_keys_land_in_the_key_column_and_nowhere_else(
    ray_session, tmp_path, monkeypatch
):
    model = trained_model()
    weights = tmp_path / "export"
    extra = {"preprocessing": DataConfig(image_size=32, patch_size=8).to_dict()}
    vit.save_pretrained(weights, model.state_dict(), model.config, extra=extra)
    # Relative names climb from the driver's working directory (deeper below tmp_path than they
    # climb); the absolute one points inside tmp_path: any write by key would show up below.
    names = ["../../../escape", "a/../../b", "./../c", str(tmp_path / "planted" / "absolute")]
    members = []
    for i, name in enumerate(names):
        pixels, label = render(i, image_size=48, num_classes=4)
        members += [(f"{name}.cls", str(label).encode()), (f"{name}.jpg", encode(pixels))]
    shard = hostile_shard(tmp_path, members, monkeypatch)
    before = {p for p in tmp_path.rglob("*")}
    out = tmp_path / "out"

    summary = run(prepare(EmbedConfig(data=str(shard), weights=str(weights), out=str(out), batch_size=4)))

    assert (summary.committed, summary.rows, summary.bad_samples["bad"]) == (1, 4, 0)
    assert pq.read_table(out).column("key").to_pylist() == names
    written = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} - {
        p.relative_to(tmp_path) for p in before
    }
    name = output_name(str(shard))
    assert name.startswith("hostile-000000-")
    assert written == {
        Path("out"),
        Path(f"out/{name}"),
        Path(f"out/{CLAIM}"),
        Path(f"out/{MANIFEST}"),
        Path(f"out/{RECORDS}"),
        Path(f"out/{RECORDS}/{name}.json"),
    }
