"""A data position's samples (`pipeline.data.consumed.Consumed`) and the read stage that passes over
them (`pipeline.data.rows.read_shard`: the ``index`` and ``shard_size`` columns, ``skip``). No Ray."""

from __future__ import annotations

import base64
import random

import numpy as np
import pyarrow as pa
import pytest

from pipeline.data.bad_samples import BadSamples
from pipeline.data.consumed import Consumed
from pipeline.data.rows import RowSpec, read_shard
from pipeline.data.writing import tar_bytes


def test_intervals_hold_exactly_the_indices_added_and_round_trip():
    rng = random.Random(0)
    for _ in range(200):
        indices = {rng.randrange(0, 3000) for _ in range(rng.randrange(0, 400))}
        consumed = Consumed()
        items = list(indices) * 2  # repeats change nothing
        rng.shuffle(items)
        for start in range(0, len(items), 37):
            consumed.add(items[start : start + 37])
        assert {i for i in range(3000) if i in consumed} == indices
        assert len(consumed) == len(indices)
        again = Consumed.decode(consumed.encode())
        assert again == consumed and again.bounds == consumed.bounds
        other = Consumed().add(rng.sample(range(3000), 100))
        union = Consumed(consumed.bounds).update(other)
        assert {i for i in range(3000) if i in union} == indices | {i for i in range(3000) if i in other}


def test_a_prefix_with_holes_costs_a_few_bytes_per_hole_whatever_the_shard_size():
    whole = Consumed().add(range(1_000_000))
    assert whole.bounds == [0, 1_000_000] and whole.prefix == 1_000_000
    assert len(whole.encode()) <= 8
    # A shard read to 50,000 with 1,000 samples still in a shuffle buffer (holes among the last 8,000).
    rng = random.Random(1)
    holes = set(rng.sample(range(42_000, 50_000), 1000))
    near_prefix = Consumed().add(i for i in range(50_000) if i not in holes)
    assert near_prefix.prefix < 50_000 and len(near_prefix) == 49_000
    # Dense holes: the bitmap of the 8,000 samples past the prefix (1,000 bytes) beats 2,000 bounds.
    assert len(near_prefix.encode()) <= 4 * (1000 + 8) // 3 + 4
    sparse = Consumed().add(i for i in range(50_000) if i not in {100, 30_000})
    assert len(sparse.encode()) <= 16  # sparse holes: a few bounds


def test_a_damaged_record_is_refused_with_one_line():
    # An unknown form; bounds: odd, an empty interval, a number cut short; a bitmap: cut short.
    for damaged in (b"\x05\x00", b"\0\x05", b"\0\x05\x00", b"\0\x05\x82", b"\1\x00\x10\xff"):
        with pytest.raises(ValueError, match="damaged"):
            Consumed.decode(base64.b64encode(damaged).decode())


MEMBERS = [
    (f"{i:04d}.{ext}", b"x" if ext == "jpg" else str(i % 4).encode())
    for i in range(10)
    for ext in ("cls", "jpg")
]


def test_rows_carry_their_place_in_the_shard_and_the_last_one_the_shard_size(tmp_path):
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([*MEMBERS[:2], ("0001.cls", b"1"), ("0001.txt", b"no image"), *MEMBERS[4:]]))
    table = pa.concat_tables(read_shard(str(path), RowSpec(), block_rows=4))
    assert table.column("key").to_pylist() == [f"{i:04d}" for i in range(10)]
    assert table.column("index").to_pylist() == list(range(10))
    assert table.column("shard_size").to_pylist() == [-1] * 9 + [10]
    assert table.column("error").to_pylist()[1].startswith("missing image")  # a bad sample has its index


@pytest.mark.parametrize("block_rows", [1, 3, 256])
def test_skip_reads_past_consumed_samples_and_still_says_the_shard_size(tmp_path, block_rows):
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes(MEMBERS))
    skip = Consumed().add([0, 1, 2, 5, 9])
    table = pa.concat_tables(read_shard(str(path), RowSpec(), block_rows=block_rows, skip=skip))
    assert table.column("index").to_pylist() == [3, 4, 6, 7, 8]
    assert table.column("key").to_pylist() == ["0003", "0004", "0006", "0007", "0008"]
    # The shard's last sample was consumed: its last row read says the size all the same.
    assert table.column("shard_size").to_pylist() == [-1, -1, -1, -1, 10]
    # All of it consumed: nothing to read, and no lost shard either.
    assert list(read_shard(str(path), RowSpec(), block_rows, skip=Consumed().add(range(10)))) == []


def test_bad_samples_counted_are_named_by_shard_index_and_size(tmp_path):
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([*MEMBERS[:18], ("0009.cls", b"1"), ("0009.txt", b"no image")]))
    batch = pa.concat_tables(read_shard(str(path), RowSpec(), block_rows=256)).to_pydict()
    counts = BadSamples()
    kept = counts.filter({k: np.array(v, dtype=object) for k, v in batch.items()})
    assert len(kept["key"]) == 9 and counts.bad == 1
    assert counts.take_counted() == [(str(path), 9, 10)] and counts.take_counted() == []
