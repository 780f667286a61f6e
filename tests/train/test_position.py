"""The data position by sample (`pipeline.train.input.position.EpochPosition`): what ranks consume, the union
a checkpoint holds, the deal of the rest at another layout, and its size at scale. No Ray, no torch
collective (but the figure's test, which prints the size of a 14M-sample epoch's position)."""

from __future__ import annotations

import json
import random

import numpy as np

from pipeline.data.config import shard_order
from pipeline.data.consumed import Consumed
from pipeline.train.input.position import EpochPosition

SHARDS = [f"s3://bucket/data/train-{i:05d}.tar" for i in range(10)]


def columns(url: str, indices: list[int], size: int = -1):
    """One micro-batch's (url, index, shard_size) columns; ``size`` on its last row."""
    sizes = [-1] * len(indices)
    if sizes:
        sizes[-1] = size
    return np.array([url] * len(indices)), np.array(indices), np.array(sizes)


def test_a_shard_is_done_once_every_sample_is_consumed_and_its_size_known():
    position = EpochPosition(SHARDS)
    position.took([columns(SHARDS[3], [2, 0, 4])], counted=[(SHARDS[3], 1, -1)])
    assert position.partial[3].bounds == [0, 3, 4, 5] and not position.done
    position.took([columns(SHARDS[3], [5], size=6)], counted=[])
    assert position.sizes == {3: 6} and not position.done  # sample 3 still sits in a buffer
    position.add([(SHARDS[3], 3, -1), ("s3://elsewhere/x.tar", 0, -1)])  # a stranger's row changes nothing
    assert position.done == {3} and position.partial == {} and position.sizes == {}
    position.add([(SHARDS[3], 0, -1)])  # a done shard stays done
    assert position.to_dict()["partial"] == {}


def test_the_union_of_every_rank_round_trips_through_the_record():
    ranks = [EpochPosition(SHARDS) for _ in range(3)]
    ranks[0].add([(SHARDS[0], i, 4 if i == 3 else -1) for i in range(4)])  # shard 0 done
    ranks[1].add([(SHARDS[1], i, -1) for i in (0, 1, 2, 7, 9)])
    ranks[2].add([(SHARDS[1], 3, -1), (SHARDS[5], 0, -1)])  # shard 1 also by another (resumed) rank
    merged = EpochPosition(SHARDS)
    for rank in ranks:
        merged.update(json.loads(json.dumps(rank.to_dict())))
    assert merged.done == {0} and merged.partial == {1: Consumed([0, 4, 7, 8, 9, 10]), 5: Consumed([0, 1])}
    again = EpochPosition.resume(SHARDS, merged.to_dict())
    assert again is not None and again.to_dict() == merged.to_dict()
    # The record is of these shards, by name within their dataset: moved data keeps it; other data does not.
    moved = [url.replace("s3://bucket/", "gs://copy/") for url in SHARDS]
    assert EpochPosition.resume(moved, merged.to_dict()).to_dict() == merged.to_dict()
    assert EpochPosition.resume(SHARDS[:-1], merged.to_dict()) is None
    assert EpochPosition.resume(SHARDS, {}) is None and EpochPosition(SHARDS).to_dict() == {}


def test_any_layout_deals_every_remaining_sample_to_exactly_one_rank():
    position = EpochPosition(SHARDS)
    position.add([(SHARDS[2], i, 5 if i == 4 else -1) for i in range(5)])  # done
    position.add([(SHARDS[7], i, -1) for i in (0, 1, 3)])
    order = shard_order(SHARDS, seed=0, epoch=4)
    for world in (1, 2, 3, 4, 7):
        dealt = [position.deal(order, rank, world) for rank in range(world)]
        shards = [url for mine, _ in dealt for url in mine]
        assert sorted(shards) == sorted(set(SHARDS) - {SHARDS[2]})  # each once, the done one by none
        skips = {url: c for _, skip in dealt for url, c in skip.items()}
        assert skips == {SHARDS[7]: Consumed([0, 2, 3, 4])}
        # Ranks take the remaining shards in the epoch's order, every world-th.
        assert dealt[0][0] == [url for url in order if url != SHARDS[2]][::world]


def simulated_rank(shard_size: int, shards: int, buffer: int, in_flight: int, rng: random.Random) -> list:
    """One rank's consumption halfway through its stream of ``shards`` shards: (shard, index) drawn at
    random from a shuffle buffer of ``buffer`` samples, the last ``in_flight`` drawn not yet trained
    (prefetched steps, rebatch's remainder)."""
    held: list = []
    drawn: list = []
    for sample in [(s, i) for s in range(shards) for i in range(shard_size)][: shards * shard_size // 2]:
        held.append(sample)
        if len(held) > buffer:
            k = rng.randrange(len(held))
            held[k], held[-1] = held[-1], held[k]
            drawn.append(held.pop())
    return drawn[: len(drawn) - in_flight]


def test_the_position_of_14m_samples_in_14k_shards_stays_small():
    """14,000 shards of 1,000 samples, halfway through an epoch. Every rank's shuffle buffer (1,024, the
    default) and 1,056 samples in flight (8 prefetched steps, the default, of 4 x 32; one micro-batch in
    rebatch) leave holes in the shards it reads; half the shards are done. Printed: the record's bytes
    in train_state.json, and what a rank adds."""
    shards = [f"s3://bucket/laion/{i:05d}.tar" for i in range(14_000)]
    consumed = simulated_rank(1000, 8, buffer=1024, in_flight=1056, rng=random.Random(0))
    figures = {}
    for world in (64, 256, 1024):
        position = EpochPosition(shards)
        for rank in range(world):  # every rank reads 8 shards of its own alike: the last ones in part
            position.add((shards[8 * rank + s], i, 1000 if i == 999 else -1) for s, i in consumed)
        position.done |= set(range(8 * world, 14_000, 2))  # and half of the other shards are done
        record = json.dumps(position.to_dict())
        figures[world] = len(record)
        intervals = sum(len(c.bounds) // 2 for c in position.partial.values()) / world
        encoded = sum(len(c.encode()) for c in position.partial.values()) / world
        done = len(position.to_dict()["done"])
        print(
            f"{world} ranks: {len(record) / 1024:.0f} KiB ({done} B done, {encoded:.0f} B, {intervals:.0f} intervals a rank)"
        )
    assert figures[64] < 64 * 1024 and figures[1024] < 1024 * 1024, figures
