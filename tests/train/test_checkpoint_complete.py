"""A checkpoint is complete only when every shard file its metadata names is there, read through the
restricted unpickler; rank 0's `.metadata` and `train_state.json` alone do not show the other ranks'
files arrived."""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp

from pipeline import dcp


def write_checkpoint(path) -> list[str]:
    """A DCP checkpoint spread over two shard files (two writer threads stand in for two ranks), plus
    rank 0's train_state.json and config.json; returns the shard file names."""
    state = {"model": {"a": torch.arange(64.0), "b": torch.ones(8, 8), "c": torch.zeros(3)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tdcp.save(state, storage_writer=tdcp.FileSystemWriter(str(path), thread_count=2), no_dist=True)
    (path / dcp.TRAIN_STATE).write_text('{"step": 3}')
    (path / dcp.CONFIG).write_text('{"model_config": {}}')
    shards = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert len(shards) == 2, shards
    return shards


def test_a_checkpoint_with_all_its_files_is_complete(tmp_path):
    path = tmp_path / dcp.checkpoint_name(3)
    write_checkpoint(path)
    assert dcp.is_complete(path)
    assert dcp.latest_complete(tmp_path).url == str(path)


def test_a_missing_shard_file_makes_it_incomplete(tmp_path):
    older, newer = tmp_path / dcp.checkpoint_name(2), tmp_path / dcp.checkpoint_name(3)
    write_checkpoint(older)
    shards = write_checkpoint(newer)
    os.remove(newer / shards[1])  # another rank's upload never arrived
    assert (newer / dcp.METADATA).is_file() and (newer / dcp.TRAIN_STATE).is_file()
    assert not dcp.is_complete(newer)
    assert dcp.latest_complete(tmp_path).url == str(older)


def test_missing_train_state_config_or_metadata_makes_it_incomplete(tmp_path):
    for name in (dcp.TRAIN_STATE, dcp.CONFIG, dcp.METADATA):
        path = tmp_path / name.strip(".") / dcp.checkpoint_name(3)
        write_checkpoint(path)
        os.remove(path / name)
        assert not dcp.is_complete(path)
    assert not dcp.is_complete(tmp_path / "no_such_checkpoint")


@pytest.mark.parametrize("which", ["shard", dcp.TRAIN_STATE, dcp.CONFIG])
def test_a_file_cut_short_makes_it_incomplete(tmp_path, which):
    """A copy into a local or mounted `--out` writes each file in place: one killed mid-copy is there,
    but short (the metadata, written whole, says how long each shard file is)."""
    older, newer = tmp_path / dcp.checkpoint_name(2), tmp_path / dcp.checkpoint_name(3)
    write_checkpoint(older)
    shards = write_checkpoint(newer)
    cut = newer / (shards[-1] if which == "shard" else which)
    cut.write_bytes(cut.read_bytes()[:-1])
    assert not dcp.is_complete(newer)
    assert dcp.latest_complete(tmp_path).url == str(older)


class Marker:
    """Unpickling this would run code: a metadata file must never get that far."""

    ran = False

    def __reduce__(self):
        return (Marker._run, ())

    @staticmethod
    def _run():
        Marker.ran = True


def test_cut_short_metadata_makes_it_incomplete(tmp_path):
    path = tmp_path / dcp.checkpoint_name(3)
    write_checkpoint(path)
    metadata = path / dcp.METADATA
    metadata.write_bytes(metadata.read_bytes()[:40])
    assert not dcp.is_complete(path)


def test_hostile_metadata_is_refused_in_one_line_not_passed_over(tmp_path):
    """Passed over as incomplete, it would let a run resume silently from an earlier checkpoint (or
    start again) over a file somebody wrote to run code."""
    path = tmp_path / dcp.checkpoint_name(3)
    write_checkpoint(path)
    buffer = io.BytesIO()
    pickle.dump(Marker(), buffer)
    (path / dcp.METADATA).write_bytes(buffer.getvalue())
    with pytest.raises(
        dcp.CheckpointRefusedError, match="refusing to unpickle it; remove that checkpoint"
    ) as info:
        dcp.latest_complete(tmp_path)
    assert "\n" not in str(info.value)
    assert not Marker.ran
