"""`EpochCursor`, where a rank stands in its epoch: unit tests without a process group or Ray."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.train.input.cursor import EpochCursor, stream_fingerprint
from pipeline.train.state import TrainState

DATA = DataConfig()
SAME = stream_fingerprint(["a.tar", "b.tar"], 0, 16)


def counts(total: int, bad: int) -> BadSamples:
    c = BadSamples.from_config(DATA)
    c.total, c.bad = total, bad
    c.by_reason["truncated image"] = bad
    return c


def saved(cursors: list[EpochCursor]) -> TrainState:
    """The state a checkpoint holds for these ranks' cursors (as `Checkpointer.take` gathers it)."""
    return TrainState(
        step=5,
        epoch_position=cursors[0].position(),
        bad_samples=[c.counts.to_dict() for c in cursors],
        epoch_bad_samples=[c.at_epoch_start.to_dict() for c in cursors],
    )


def test_a_cursor_takes_micro_batches_and_starts_each_epoch_from_its_counts():
    cursor = EpochCursor.start(0, 2, 4, SAME, DATA)
    assert (cursor.taken, cursor.counts.total, cursor.at_epoch_start.total) == (0, 0, 0)
    cursor.took(2, counts(8, 1))
    cursor.took(2, counts(16, 2))
    assert (cursor.taken, cursor.counts.bad, cursor.at_epoch_start.bad) == (4, 2, 0)
    assert cursor.position() == {"world": 2, "micro_batch_size": 4, "stream": SAME, "micro_batches": 4}
    cursor.next_epoch()
    assert (cursor.taken, cursor.at_epoch_start.bad) == (0, 2)
    cursor.at_epoch_start.bad = 99  # the start of the epoch is a copy, not the live counts
    assert cursor.counts.bad == 2


def test_skip_drops_exactly_the_micro_batches_taken():
    cursor = EpochCursor.start(0, 1, 4, SAME, DATA)
    cursor.took(3, counts(12, 0))
    assert list(cursor.skip(iter(range(10)))) == [3, 4, 5, 6, 7, 8, 9]
    assert list(cursor.skip(iter(range(2)))) == []  # a stream shorter than the position


def test_a_resume_at_the_same_layout_and_stream_re_reads_the_taken_samples_from_the_epoch_counts():
    ranks = [EpochCursor.start(r, 2, 4, SAME, DATA) for r in range(2)]
    for r, cursor in enumerate(ranks):
        cursor.took(1, counts(4, r))
        cursor.next_epoch()
        cursor.took(3, counts(16, r + 2))
    for r in range(2):
        again, note = EpochCursor.resume(saved(ranks), r, 2, 4, SAME, DATA)
        assert again.taken == 3 and note == "each worker re-reads the samples it had taken (up to 12)"
        assert (again.counts.bad, again.at_epoch_start.bad) == (r + 2, r)
        assert again.replay_counts().to_dict() == again.at_epoch_start.to_dict()


def test_a_position_is_re_read_only_in_the_stream_and_layout_it_was_taken_from():
    cursor = EpochCursor.start(0, 2, 4, SAME, DATA)
    cursor.took(3, counts(12, 0))
    state = saved([cursor, EpochCursor.start(1, 2, 4, SAME, DATA)])
    others = [
        (stream_fingerprint(["a.tar", "c.tar"], 0, 16), "from other shards"),
        (stream_fingerprint(["b.tar", "a.tar"], 0, 16), "from other shards"),  # listed in another order
        (stream_fingerprint(["a.tar", "b.tar"], 1, 16), "with another --seed"),
        (stream_fingerprint(["a.tar", "b.tar"], 0, 0), "with another --shuffle-buffer"),
        (
            stream_fingerprint(["a.tar"], 1, 0),
            "from other shards and with another --seed and with another --shuffle-buffer",
        ),
    ]
    moved = stream_fingerprint(["s3://bucket/copy/a.tar", "s3://bucket/copy/b.tar"], 0, 16)
    assert stream_fingerprint(["/data/a.tar", "/data/b.tar"], 0, 16) == SAME == moved  # same names
    for other, why in others:
        again, note = EpochCursor.resume(state, 0, 2, 4, other, DATA)
        assert again.taken == 0 and note.startswith(f"it was taken {why}, so this epoch's data"), note
    # A checkpoint from before the fingerprint had named parts: its whole hash is the first part's; any
    # other says each part that may have changed.
    before = hashlib.sha256(json.dumps([["a.tar", "b.tar"], 0, 16]).encode()).hexdigest()[:16]
    assert SAME.split()[0] == before
    state.epoch_position = {**state.epoch_position, "stream": before}
    assert EpochCursor.resume(state, 0, 2, 4, SAME, DATA)[0].taken == 3
    state.epoch_position = {**state.epoch_position, "stream": "0123456789abcdef"}
    _, note = EpochCursor.resume(state, 0, 2, 4, SAME, DATA)
    assert note.startswith(
        "it was taken from other shards or sources, or with another seed or shuffle buffer"
    )
    again, note = EpochCursor.resume(state, 0, 4, 4, SAME, DATA)
    assert again.taken == 0
    assert (
        note
        == "it was taken with 2 workers x micro-batch 4, so this epoch's data starts again from its first sample "
        "(no position by sample)"
    )
    _, note = EpochCursor.resume(state, 0, 2, 4, SAME, DATA, schedule_done=True)
    assert note == "the schedule is done, nothing is re-read"


def test_at_another_world_size_rank_0_carries_the_runs_counts_so_totals_go_on():
    ranks = [EpochCursor.start(r, 2, 4, SAME, DATA) for r in range(2)]
    ranks[0].took(1, counts(4, 1))
    ranks[1].took(1, counts(4, 2))
    state = saved(ranks)
    first, _ = EpochCursor.resume(state, 0, 3, 4, SAME, DATA)
    others = [EpochCursor.resume(state, r, 3, 4, SAME, DATA)[0] for r in (1, 2)]
    assert (first.counts.total, first.counts.bad) == (8, 3)
    assert all(c.counts.total == 0 for c in others)


def test_a_checkpoint_without_epoch_counts_starts_its_epoch_from_the_step_counts():
    cursor = EpochCursor.start(0, 1, 4, SAME, DATA)
    cursor.took(2, counts(8, 1))
    state = saved([cursor])
    state.epoch_bad_samples = []  # written before the epoch's counts were kept
    again, _ = EpochCursor.resume(state, 0, 1, 4, SAME, DATA)
    assert again.at_epoch_start.bad == 1


def columns(url: str, indices: list[int], size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A micro-batch's (url, index, shard_size) columns, ``size`` on its last row (`StepInput.consumed`)."""
    return np.array([url] * len(indices)), np.array(indices), np.array([-1] * (len(indices) - 1) + [size])


def test_at_another_layout_a_position_by_sample_makes_the_cursor_elastic_and_deals_what_is_left():
    shards = ["d/a.tar", "d/b.tar", "d/c.tar"]
    ranks = [EpochCursor.start(r, 2, 4, SAME, DATA, shards=shards) for r in range(2)]
    ranks[0].took(1, counts(4, 0), [columns("d/a.tar", [0, 1, 2, 3], 4)])  # a.tar done: its size is known
    ranks[1].took(1, counts(4, 1), [columns("d/b.tar", [0, 2, 3], -1)])
    ranks[1].saw(counts(5, 1), [("d/b.tar", 1, -1), ("d/b.tar", 5, -1)])  # bad ones count as consumed
    state = saved(ranks)
    state.epoch_consumed = ranks[0].samples.update(ranks[1].samples.to_dict()).to_dict()
    resumed, note = EpochCursor.resume(state, 0, 1, 4, SAME, DATA, shards=shards)
    assert resumed.elastic and not resumed.at_start
    assert "the workers share the samples this epoch had not consumed" in note
    mine, skip = resumed.deal(["d/c.tar", "d/a.tar", "d/b.tar"])
    assert mine == ["d/c.tar", "d/b.tar"] and list(skip["skip"]["d/b.tar"].bounds) == [0, 4, 5, 6]
    assert resumed.deal(["d/c.tar", "d/a.tar", "d/b.tar"], ahead=True) == (
        ["d/c.tar", "d/a.tar", "d/b.tar"],
        {},
    )
    assert resumed.position()["elastic"]  # a later resume, even at this layout, goes on by sample too
    resumed.next_epoch()
    assert resumed.at_start and not resumed.elastic and resumed.samples.to_dict() == {}
    # Without a position by sample (a checkpoint from before it), the epoch starts again.
    state.epoch_consumed = {}
    again, note = EpochCursor.resume(state, 0, 1, 4, SAME, DATA, shards=shards)
    assert not again.elastic and note.endswith(
        "so this epoch's data starts again from its first sample (no position by sample)"
    )


def test_a_mixed_streams_fingerprint_says_which_of_its_parts_changed():
    from pipeline.train.input.cursor import changed_parts
    from pipeline.train.input.dataplan import Mixture

    def mix(weights, shards=(["/a/0.tar"], ["/b/0.tar"]), exhausted="cycle"):
        return Mixture(["a", "b"], list(weights), [list(s) for s in shards], exhausted).fingerprint(0, 16)

    saved = mix([0.7, 0.3])
    assert mix([0.7, 0.3]) == saved
    # A resume with changed weights was told "taken from other shards, or with another seed".
    assert changed_parts(saved, mix([0.5, 0.5])) == "with other source weights"
    assert (
        changed_parts(saved, mix([0.7, 0.3], (["/a/0.tar"], ["/b/1.tar"]))) == "from other sources or shards"
    )
    assert changed_parts(saved, mix([0.7, 0.3], exhausted="end")) == "with another --source-exhausted"
    assert changed_parts(saved, SAME).startswith("from other shards or sources, or")  # one source now
