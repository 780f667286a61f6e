"""`EpochCursor`: where one rank stands in the current epoch, the state behind resuming at the sample.

A rank's epoch is one stream of micro-batches: the shards `order[rank::world]` of the epoch's shard
order, read through its shuffle buffer. What fixes that stream beside the layout (world size and
micro-batch size) is its fingerprint: the shard list, the seed and the shuffle buffer. The cursor owns
what the rank has taken from it:

- ``taken``: the micro-batch places of this epoch's steps so far (the accumulation count per step),
  the same on every rank. A rank has taken that many micro-batches of its stream, or, once its stream
  ran dry in the epoch's padded tail (`pipeline.train.state.StepAgreement`), all of them: either way
  a resume at the same layout and fingerprint skips exactly what the rank trained on (`skip` stops
  at the stream's end) and trains on the rest; at another layout or fingerprint the epoch starts
  again from its first sample, and the resume's log line says why (`resume`).
- ``counts``: this rank's bad-sample counts as of the last step's input (what reports, checkpoints and
  the summary hold), and ``at_epoch_start``: its counts when the epoch began. A resume re-reads the
  skipped micro-batches counting from ``at_epoch_start``, so it ends at exactly ``counts``: each bad
  sample is counted once across the resume.

A checkpoint holds the cursor of every rank as `TrainState.epoch_position`, `bad_samples` and
`epoch_bad_samples` (`save_into`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.data.shards import dataset_root, shard_name

T = TypeVar("T")


def stream_fingerprint(shards: list[str], seed: int, shuffle_buffer: int) -> str:
    """What fixes the order of every rank's samples in an epoch, beside the layout: a resume re-reads
    a position only in the stream it was taken from. The shards count by their names within the
    dataset (`shard_name`), as the seeds of their samples do, so data moved to another directory or
    bucket is the same stream."""
    root = dataset_root(shards)
    text = json.dumps([[shard_name(url, root) for url in shards], seed, shuffle_buffer])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _copy(counts: BadSamples) -> BadSamples:
    return BadSamples.from_dict(counts.to_dict())


def _counts_of(saved: list[dict[str, Any]], rank: int, world: int, data_config: DataConfig) -> BadSamples:
    """This rank's counts to continue from: at the world size that saved them each rank takes its own;
    at another, rank 0 carries the run's merged counts and the others start at zero, so the run's
    totals (the sum over ranks) go on either way."""
    counts = BadSamples.from_config(data_config)
    if len(saved) == world:
        counts.merge(saved[rank])
    elif rank == 0:
        for one in saved:
            counts.merge(one)
    return counts


@dataclass
class EpochCursor:
    """One rank's position in the current epoch's stream and its bad-sample counts."""

    rank: int
    world: int
    micro_batch_size: int
    stream: str  # `stream_fingerprint` of the run's shards, seed and shuffle buffer
    counts: BadSamples
    at_epoch_start: BadSamples
    taken: int = 0  # micro-batch places of this epoch's steps: micro-batches taken, or the whole stream

    @classmethod
    def start(
        cls, rank: int, world: int, micro_batch_size: int, stream: str, data_config: DataConfig
    ) -> EpochCursor:
        """A cursor at the start of a fresh run."""
        counts = BadSamples.from_config(data_config)
        return cls(rank, world, micro_batch_size, stream, counts, _copy(counts))

    @classmethod
    def resume(
        cls,
        state: Any,
        rank: int,
        world: int,
        micro_batch_size: int,
        stream: str,
        data_config: DataConfig,
        *,
        schedule_done: bool = False,
    ) -> tuple[EpochCursor, str]:
        """(The cursor a checkpoint's `TrainState` holds for this rank, a note for the resume's log line).

        At another world size or micro-batch size, or from another stream, the ranks' streams differ:
        the epoch's data starts again from its first sample (``taken`` 0), and the note says why."""
        counts = _counts_of(state.bad_samples, rank, world, data_config)
        # A checkpoint older than `epoch_bad_samples` has only the counts as of its step.
        start = _counts_of(state.epoch_bad_samples or state.bad_samples, rank, world, data_config)
        cursor = cls(rank, world, micro_batch_size, stream, counts, start)
        if schedule_done:
            return cursor, "the schedule is done, nothing is re-read"
        position = state.epoch_position
        taken = position.get("micro_batches", 0)
        layout = (position.get("world"), position.get("micro_batch_size"))
        if not taken:
            return cursor, ""
        if layout != (world, micro_batch_size):
            why = f"it was taken with {layout[0]} workers x micro-batch {layout[1]}"
        elif position.get("stream") != stream:
            why = "it was taken from other shards, or with another seed or shuffle buffer"
        else:
            cursor.taken = taken
            return cursor, f"each worker re-reads the samples it had taken (up to {taken * micro_batch_size})"
        return cursor, f"{why}, so this epoch's data starts again from its first sample"

    def replay_counts(self) -> BadSamples:
        """A copy of the counts at the epoch's start: the epoch's stream counts into it from its first
        sample, so re-reading what was taken brings it to `counts`."""
        return _copy(self.at_epoch_start)

    def skip(self, stream: Iterator[T]) -> Iterator[T]:
        """``stream`` after its first ``taken`` micro-batches: those this rank had trained on (all of
        them, when its stream ran dry before the position)."""
        for _ in range(self.taken):
            if next(stream, None) is None:
                return
        yield from stream

    def took(self, micro_batches: int, counts: BadSamples) -> None:
        """A step of ``micro_batches`` places (its accumulation count, on every rank alike) trained on
        what this rank's stream still had for them; ``counts`` as of its input."""
        self.taken += micro_batches
        self.counts = counts

    def saw(self, counts: BadSamples) -> None:
        """The counts as of the latest step's input, trained or not (a rank that ran dry read them)."""
        self.counts = counts

    def next_epoch(self) -> None:
        self.taken = 0
        self.at_epoch_start = _copy(self.counts)

    def position(self) -> dict[str, Any]:
        """What `TrainState.epoch_position` holds: the layout, the stream and the micro-batches taken."""
        return {
            "world": self.world,
            "micro_batch_size": self.micro_batch_size,
            "stream": self.stream,
            "micro_batches": self.taken,
        }
