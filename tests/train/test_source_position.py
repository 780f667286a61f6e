"""The position by sample of mixed sources (`pipeline.train.input.source_position.SourcesPosition`): per source
and pass, the complete passes as a number, the union a checkpoint holds, each pass dealt at another layout,
and its size at scale. No Ray, no torch collective."""

from __future__ import annotations

import json
import random

import numpy as np

from pipeline.data.config import shard_order
from pipeline.train.input.position import EpochPosition
from pipeline.train.input.source_position import SourcesPosition
from tests.train.test_position import simulated_rank

A = [f"s3://bucket/a/{i:03d}.tar" for i in range(6)]
B = [f"s3://bucket/b/{i:03d}.tar" for i in range(3)]


def rows(url: str, n: int, source: int, passes: int) -> list[tuple]:
    """A whole shard of ``n`` samples, its size on its last row."""
    return [(url, i, n if i == n - 1 else -1, source, passes) for i in range(n)]


def test_a_pass_complete_on_every_shard_becomes_a_number_and_later_passes_stay_apart():
    position = SourcesPosition(["a", "b"], [A, B])
    for url in B[:2]:
        position.add(rows(url, 4, 1, 0))
    position.add(rows(B[0], 4, 1, 1)[:2])  # pass 1 begun before pass 0 is complete (another rank)
    assert position.done == [0, 0] and sorted(position.passes[1]) == [0, 1]
    position.add(rows(B[2], 4, 1, 0))
    assert position.done == [0, 1] and sorted(position.passes[1]) == [1]  # pass 0 dropped
    assert position.first_pass(1) == 1 and position.last_begun(1) == 1
    assert position.first_pass(0) == 0 and position.last_begun(0) == -1
    position.add(rows(B[1], 4, 1, 0))  # a sample of a complete pass changes nothing
    assert position.done == [0, 1] and sorted(position.passes[1]) == [1]
    record = position.to_dict()
    assert set(record["sources"]) == {"b"} and record["sources"]["b"]["passes_done"] == 1


def test_the_union_of_the_ranks_round_trips_and_refuses_other_sources():
    ranks = [SourcesPosition(["a", "b"], [A, B]) for _ in range(2)]
    urls, indices, sizes = np.array([A[0], A[0]]), np.array([0, 2]), np.array([-1, -1])
    ranks[0].took([(urls, indices, sizes, np.array([0, 0]), np.array([0, 0]))], [(A[0], 1, -1, 0, 0)])
    ranks[1].add(rows(B[1], 3, 1, 0) + rows(B[2], 3, 1, 0) + [(B[0], 0, -1, 1, 0), (B[0], 5, -1, 1, 2)])
    merged = ranks[0].fresh()
    for rank in ranks:
        merged.update(json.loads(json.dumps(rank.to_dict())))
    assert merged.passes[0][0].partial[0].bounds == [0, 3]
    assert merged.passes[1][0].done == {1, 2} and sorted(merged.passes[1]) == [0, 2]
    again = ranks[0].resumed(merged.to_dict())
    assert again is not None and again.to_dict() == merged.to_dict()
    assert SourcesPosition(["a"], [A]).resumed(merged.to_dict()) is None  # it names a source not here
    assert SourcesPosition(["a", "b"], [A, A[2:5]]).resumed(merged.to_dict()) is None  # other shards
    assert ranks[0].resumed({}) is None
    assert ranks[0].resumed({"shards": "0" * 16, "done": ""}) is None  # one source's record


def test_each_pass_deals_what_it_has_not_consumed_to_every_new_rank_once():
    position = SourcesPosition(["a", "b"], [A, B])
    position.add(rows(A[4], 5, 0, 0) + rows(A[1], 5, 0, 0)[:3] + rows(A[2], 5, 0, 1)[1:2])
    for passes, world in ((0, 4), (1, 3), (2, 2)):
        order = shard_order(A, 0, passes + 10)
        dealt = [position.of(0, passes).deal(order, rank, world) for rank in range(world)]
        shards = [url for mine, _ in dealt for url in mine]
        assert sorted(shards) == sorted(set(A) - ({A[4]} if passes == 0 else set()))
        skips = {url: c for _, skip in dealt for url, c in skip.items()}
        expected = {0: {A[1]: [0, 3]}, 1: {A[2]: [1, 2]}, 2: {}}[passes]
        assert {url: c.bounds for url, c in skips.items()} == expected
    assert position.of(1, 0).to_dict() == {}  # a pass not begun: all of it


def test_the_position_of_two_sources_at_scale_stays_small():
    """``laion``, 14,000 shards of 1,000 samples, halfway through its one pass; ``cc``, 1,024 shards of
    1,000, cycled: its pass 3 complete, half the ranks in pass 4 and half in pass 5 (a rank's part of a
    pass, 4 shards at 256 ranks, half read). Each rank's shuffle buffer and samples in flight per source as
    in `tests.train.test_position`. Printed: the record's bytes in train_state.json."""
    laion = [f"s3://bucket/laion/{i:05d}.tar" for i in range(14_000)]
    cc = [f"s3://bucket/cc/{i:04d}.tar" for i in range(1_024)]
    consumed = simulated_rank(1000, 8, buffer=1024, in_flight=1056, rng=random.Random(0))
    small = simulated_rank(1000, 4, buffer=1024, in_flight=1056, rng=random.Random(1))
    world = 256
    position = SourcesPosition(["laion", "cc"], [laion, cc])
    position.done[1] = 4
    for rank in range(world):
        position.add((laion[8 * rank + s], i, 1000 if i == 999 else -1, 0, 0) for s, i in consumed)
        ahead = rank % 2  # in pass 5: its part of pass 4 done; in pass 4: half of it
        part = [rank + world * s for s in range(4)]  # its shards of cc, as slots
        if ahead:
            position.passes[1].setdefault(4, EpochPosition(cc)).done.update(part)
        position.add((cc[part[s]], i, 1000 if i == 999 else -1, 1, 4 + ahead) for s, i in small)
    position.passes[0][0].done |= set(range(8 * world, 14_000, 2))  # half of laion's other shards done
    size = len(json.dumps(position.to_dict()))
    print(f"{world} ranks, 2 sources (3 passes begun): {size / 1024:.0f} KiB")
    assert sorted(position.passes[1]) == [4, 5] and size < 2 * 139 * 1024, size


def test_a_pass_position_is_built_once_not_at_every_step(monkeypatch):
    """Building a pass's position hashes its source's whole shard list: once per pass, never per add."""
    from pipeline.train.input import source_position

    built = []

    class Counted(EpochPosition):
        def __init__(self, shards):
            built.append(len(shards))
            super().__init__(shards)

    monkeypatch.setattr(source_position, "EpochPosition", Counted)
    position = SourcesPosition(["a", "b"], [A, B])
    for step in range(3):
        position.add([(A[step], 0, -1, 0, 0), (B[0], step, -1, 1, 0)])
    position.update(position.to_dict())
    assert built == [len(A), len(B)]
