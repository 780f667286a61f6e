"""A shard whose member names climb out of directories, through the whole embedding job (shared local Ray).

Output file names come from shard URLs, never from keys: the keys land in the ``key`` column as they
are, and the only files the job writes are its own, under ``--out``.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

import vit
from pipeline.data.config import DataConfig
from pipeline.data.synthetic import encode, render
from pipeline.data.writing import tar_bytes
from pipeline.embed.config import EmbedConfig
from pipeline.embed.identity import CLAIM
from pipeline.embed.job import prepare, run
from pipeline.embed.output import MANIFEST, RECORDS, output_name
from tests.embed.test_job import trained_model


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
    shard = tmp_path / "shards" / "hostile-000000.tar"
    shard.parent.mkdir()
    shard.write_bytes(tar_bytes(members))
    cwd = tmp_path / "work" / "one" / "two" / "three"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
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
