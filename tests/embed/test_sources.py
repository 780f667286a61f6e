"""The embedding job over several named sources (`pipeline.data.mixture`'s spec, weights unused): every
source's shards are embedded, each into its own file with its own keys. No Ray."""

from __future__ import annotations

import pytest

from pipeline.data.mixture import MixtureError
from pipeline.data.shards import ShardError
from pipeline.embed.config import EmbedConfig
from pipeline.embed.job import prepare
from pipeline.embed.output import output_name


def test_every_source_of_a_named_spec_is_embedded(synthetic_shards, tiny_export, tmp_path):
    urls = synthetic_shards.urls
    spec = f"a={urls[0]},{urls[1]}:0.9,b={urls[2]}:0.1,c={urls[3]},{urls[0]}"  # weights unused; a shard once
    plan = prepare(EmbedConfig(data=spec, weights=tiny_export, out=str(tmp_path / "out"), batch_size=8))
    assert plan.shards == urls and plan.work.pending == urls
    assert sorted(plan.work.names.values()) == sorted(output_name(u) for u in urls)  # a file per shard
    with pytest.raises(MixtureError, match="source b names no shards"):
        prepare(EmbedConfig(data=f"a={urls[0]},b=", weights=tiny_export, out=str(tmp_path / "out")))
    with pytest.raises(ShardError, match="shard not found"):
        prepare(
            EmbedConfig(
                data=f"a={urls[0]},b={tmp_path / 'none'}", weights=tiny_export, out=str(tmp_path / "o")
            )
        )
