"""`EpochCursor`: where one rank stands in the current epoch, the state behind resuming at the sample.

A rank's epoch is one stream of micro-batches: the shards `order[rank::world]` of the epoch's shard
order, read through its shuffle buffer. What fixes that stream beside the layout (world size and
micro-batch size) is its fingerprint: the shard list, the seed and the shuffle buffer. The cursor owns
what the rank has taken from it:

- ``taken``: the micro-batch places of this epoch's steps so far (the accumulation count per step),
  the same on every rank. A rank has taken that many micro-batches of its stream, or, once its stream
  ran dry in the epoch's padded tail (`pipeline.train.state.StepAgreement`), all of them: either way
  a resume at the same layout and fingerprint skips exactly what the rank trained on (`skip` stops
  at the stream's end) and trains on the rest; at another layout (or after such a resume in the
  same epoch) the cursor is ``elastic``: the epoch goes on from its position by sample
  (`pipeline.train.input.position`), each remaining sample once; without one (another fingerprint, a
  checkpoint that predates it) the epoch starts again from its first sample. The resume's log line
  says which and why (`resume`). Mixed sources keep their position per source and per pass
  (`pipeline.train.input.source_position`), and go on by sample alike.
- ``counts``: this rank's bad-sample counts as of the last step's input (what reports, checkpoints and
  the summary hold), and ``at_epoch_start``: its counts when the epoch began. A resume re-reads the
  skipped micro-batches counting from ``at_epoch_start``, so it ends at exactly ``counts``: each bad
  sample is counted once across the resume.

- ``samples``: what the epoch has consumed, by sample, whatever the layout (`EpochPosition`): the
  samples of the steps this rank trained (`took`) and the bad ones it counted (`saw`), plus what the
  run had consumed when it resumed. An ``elastic`` cursor's stream is the shards it is dealt, minus
  their consumed samples (`deal`).
- ``ledger``: what every epoch consumed, per shard, counted rather than united (`Ledger`): the same
  moments add to it, so that a sample trained twice shows.

A checkpoint holds the cursor of every rank as `TrainState.epoch_position`, `epoch_consumed` (the
union of every rank's ``samples``), `bad_samples`, `epoch_bad_samples` and `ledger` (every rank's
additions summed) (`save_into`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.data.shards import shard_names
from pipeline.train.input.ledger import Ledger, Tally
from pipeline.train.input.position import EpochPosition
from pipeline.train.input.source_position import SourcesPosition
from pipeline.train.state import TrainState, gather_bad_samples

T = TypeVar("T")
Position = EpochPosition | SourcesPosition


def _empty(shards: list[str] | None, position: Position | None) -> Position | None:
    """The empty position by sample of one source's ``shards``, or a mixed run's ``position``."""
    if position is not None:
        return position.fresh()
    return None if shards is None else EpochPosition(shards)


# What each part of a stream's fingerprint is, as a resume's log line says it changed.
STREAM_PARTS = {
    "shards": "from other shards",
    "sources": "from other sources or shards",
    "weights": "with other source weights",
    "seed": "with another --seed",
    "shuffle": "with another --shuffle-buffer",
    "exhausted": "with another --source-exhausted",
    "patches": "with other --patches or --max-patches",
}


def fingerprint(whole: Any, **parts: Any) -> str:
    """A stream's fingerprint: a hash of ``whole`` (what fingerprints were before they had parts, so a
    checkpoint of then still resumes at the sample), then each part's (``shards=1a2b3c4d seed=...``, named
    as in `STREAM_PARTS`), so a resume can say which part changed (`changed_parts`)."""
    digest = [hashlib.sha256(json.dumps(whole).encode()).hexdigest()[:16]]
    for name, value in parts.items():
        digest.append(f"{name}={hashlib.sha256(json.dumps(value).encode()).hexdigest()[:8]}")
    return " ".join(digest)


def same_stream(saved: str | None, now: str) -> bool:
    """Whether a checkpoint's stream fingerprint (whole, as before parts, or with them) is ``now``'s."""
    return saved in (now, now.split()[0])


def changed_parts(saved: str, now: str) -> str:
    """How the stream ``saved`` was taken differs from ``now``, in words (``with other source weights``);
    a checkpoint whose fingerprint has other parts (from before they had names, or of one source against
    several) gets every part that may have changed."""
    old, new = (dict(part.split("=", 1) for part in f.split() if "=" in part) for f in (saved, now))
    names = [*new, *(name for name in old if name not in new)]
    changed = [name for name in names if old.get(name) != new.get(name)]
    # Only a `patches` part may be there on one side alone: native micro-batches against square ones.
    if (old.keys() ^ new.keys()) - {"patches"} or not changed:
        return "from other shards or sources, or with another seed or shuffle buffer"
    return " and ".join(STREAM_PARTS.get(name, f"with another {name}") for name in changed)


def stream_fingerprint(shards: list[str], seed: int, shuffle_buffer: int) -> str:
    """What fixes the order of every rank's samples in an epoch, beside the layout: a resume re-reads
    a position only in the stream it was taken from. The shards count by their names within the
    dataset (`shard_names`), as the seeds of their samples do, so data moved to another directory or
    bucket, or signed again, is the same stream."""
    names = shard_names(shards)
    return fingerprint([names, seed, shuffle_buffer], shards=names, seed=seed, shuffle=shuffle_buffer)


def with_patches(stream: str, data_config: DataConfig) -> str:
    """A stream's fingerprint (`stream_fingerprint`, a mixture's) for micro-batches of native-aspect images
    (`pipeline.data.native.pack`, which cuts the rows by a token budget): another whole, so no checkpoint
    of square micro-batches re-reads its count of these, and a ``patches`` part; square: unchanged."""
    if not data_config.native:
        return stream
    whole, *parts = stream.split()
    mode = ["native", data_config.patch_budget]
    new_whole, patches = fingerprint([whole, *mode], patches=mode).split()
    return " ".join([new_whole, *parts, patches])


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
    stream: str  # `stream_fingerprint` of the run's shards, seed and shuffle buffer (`fingerprint`)
    counts: BadSamples
    at_epoch_start: BadSamples
    taken: int = 0  # micro-batch places of this epoch's steps: micro-batches taken, or the whole stream
    # This epoch's streams hold what its position by sample had not consumed (a resume at another
    # layout): re-reading micro-batches does not apply to it, not even at the same layout later.
    elastic: bool = False
    # What the epoch has consumed, by sample (`pipeline.train.input.position`): this rank's part, and what
    # the run had consumed when it resumed; None where the cursor is given no shards (not tracked).
    samples: Position | None = None
    # An ``elastic`` epoch's position as resumed (the run's union): what its shards are dealt from.
    # Kept apart from ``samples``, which the steps change while the data thread deals a mixed run's
    # passes as it reaches them.
    dealt: Position | None = None
    ledger: Ledger | None = None  # what every epoch consumed, per shard (None: not kept)

    @classmethod
    def start(
        cls,
        rank: int,
        world: int,
        micro_batch_size: int,
        stream: str,
        data_config: DataConfig,
        *,
        shards: list[str] | None = None,
        position: Position | None = None,
        ledger: Ledger | None = None,
    ) -> EpochCursor:
        """A cursor at the start of a fresh run (over ``shards``, or a mixed run's sources given their
        ``position``: also by sample), keeping ``ledger``."""
        counts = BadSamples.from_config(data_config)
        samples = _empty(shards, position)
        return cls(
            rank, world, micro_batch_size, stream, counts, _copy(counts), samples=samples, ledger=ledger
        )

    @classmethod
    def resume(
        cls,
        state: TrainState,
        rank: int,
        world: int,
        micro_batch_size: int,
        stream: str,
        data_config: DataConfig,
        *,
        schedule_done: bool = False,
        shards: list[str] | None = None,
        position: Position | None = None,
        ledger: Ledger | None = None,
    ) -> tuple[EpochCursor, str]:
        """(The cursor a checkpoint's `TrainState` holds for this rank, a note for the resume's log line).

        At another world size or micro-batch size, or from another stream, the ranks' streams differ:
        where the checkpoint holds this epoch's position by sample for ``shards`` the cursor is
        ``elastic``; else the epoch's data starts again from its first sample (``taken`` 0). The note
        says which, and why. ``ledger``: the checkpoint's (`Ledger.resume`), kept on."""
        counts = _counts_of(state.bad_samples, rank, world, data_config)
        # A checkpoint older than `epoch_bad_samples` has only the counts as of its step.
        start = _counts_of(state.epoch_bad_samples or state.bad_samples, rank, world, data_config)
        cursor = cls(rank, world, micro_batch_size, stream, counts, start, ledger=ledger)
        empty = _empty(shards, position)
        by_sample = None if empty is None else empty.resumed(state.epoch_consumed)
        cursor.samples = by_sample or empty
        if schedule_done:
            return cursor, "the schedule is done, nothing is re-read"
        saved = state.epoch_position  # the layout and stream its micro-batches were taken in
        taken = saved.get("micro_batches", 0)
        layout = (saved.get("world"), saved.get("micro_batch_size"))
        if not taken:
            return cursor, ""
        if saved.get("elastic"):
            why = "this epoch went on by sample after a resume at another layout"
        elif layout != (world, micro_batch_size):
            why = f"it was taken with {layout[0]} workers x micro-batch {layout[1]}"
        elif not same_stream(saved.get("stream"), stream):
            why = f"it was taken {changed_parts(saved.get('stream') or '', stream)}"
        else:
            cursor.taken = taken
            if ledger is not None:  # the re-read counts the epoch's bad samples again (`replay_counts`)
                ledger.forget_bad()
            return cursor, f"each worker re-reads the samples it had taken (up to {taken * micro_batch_size})"
        if by_sample is not None:
            cursor.elastic, cursor.dealt = True, empty.resumed(state.epoch_consumed)
            return cursor, f"{why}: the workers share the samples this epoch had not consumed, each once"
        # No position by sample of this data: a checkpoint that predates it, or of other shards or sources.
        if ledger is not None:  # the epoch's bad samples are counted again from its start (`replay_counts`)
            ledger.forget_bad()
        return (
            cursor,
            f"{why}, so this epoch's data starts again from its first sample (no position by sample)",
        )

    def replay_counts(self) -> BadSamples:
        """A copy of the counts at the epoch's start: the epoch's stream counts into it from its first
        sample, so re-reading what was taken brings it to `counts`. An ``elastic`` stream re-reads
        nothing: it counts on from `counts`."""
        return _copy(self.counts if self.elastic else self.at_epoch_start)

    def skip(self, stream: Iterator[T]) -> Iterator[T]:
        """``stream`` after its first ``taken`` micro-batches: those this rank had trained on (all of
        them, when its stream ran dry before the position)."""
        for _ in range(self.taken):
            if next(stream, None) is None:
                return
        yield from stream

    @property
    def at_start(self) -> bool:
        """No step of this epoch has run, nor was any consumed before a resume."""
        return self.taken == 0 and not self.elastic

    def deal(
        self, order: list[str], ahead: bool = False, part: tuple[int, int] | None = None
    ) -> tuple[list[str], dict[str, Any]]:
        """(This rank's shards of the epoch's shard ``order``; keyword arguments for the stream's
        `micro_batches`). ``order[rank::world]``, none (the next epoch started ``ahead`` too); once
        ``elastic``: every ``world``-th of the shards not done, and ``skip``, their consumed samples.
        A mixed run deals each ``part`` (source, pass) with that pass's ``order`` alike."""
        if not self.elastic or ahead or self.dealt is None:
            return order[self.rank :: self.world], {}
        dealt = self.dealt if part is None else self.dealt.of(*part)
        shards, skip = dealt.deal(order, self.rank, self.world)
        return shards, {"skip": skip}

    def took(
        self, micro_batches: int, counts: BadSamples, consumed: Iterable[Any] = (), tallied: Tally = ()
    ) -> None:
        """A step of ``micro_batches`` places (its accumulation count, on every rank alike) trained on
        what this rank's stream still had for them; ``counts`` as of its input; ``consumed``: its
        samples (`StepInput.consumed`), ``tallied`` them for the ledger (`StepInput.tallied`)."""
        self.taken += micro_batches
        self.counts = counts
        if self.samples is not None:
            self.samples.took(consumed, [])
        if self.ledger is not None:
            self.ledger.trained(tallied)

    def saw(
        self, counts: BadSamples, counted: Iterable[tuple[str, int, int]] = (), tallied: Tally = ()
    ) -> None:
        """The counts as of the latest step's input, trained or not (a rank that ran dry read them);
        ``counted``: the bad samples its input counted, consumed with them (`StepInput.counted`),
        ``tallied`` for the ledger (`StepInput.tallied_bad`)."""
        self.counts = counts
        if self.samples is not None:
            self.samples.add(counted)
        if self.ledger is not None:
            self.ledger.counted(tallied)

    def next_epoch(self, group: dist.ProcessGroup | None = None) -> None:
        """The next epoch begins; with a ledger of a mixed run, collective: what the epoch consumed of
        its sources' passes goes into the ledger (`Ledger.next_epoch`)."""
        if self.ledger is not None:
            mixed = isinstance(self.samples, SourcesPosition)
            self.ledger.next_epoch(self.samples.gathered(group) if mixed else None)
        self.taken, self.elastic, self.dealt = 0, False, None
        self.at_epoch_start = _copy(self.counts)
        if self.samples is not None:
            self.samples = self.samples.fresh()

    def save_into(self, state: TrainState, group: dist.ProcessGroup | None) -> None:
        """Collective: the `TrainState` fields a checkpoint holds of every rank's cursor."""
        state.epoch_position = self.position()
        state.epoch_consumed = {} if self.samples is None else self.samples.gathered(group)
        state.bad_samples = gather_bad_samples(self.counts, group)
        state.epoch_bad_samples = gather_bad_samples(self.at_epoch_start, group)
        state.ledger = {} if self.ledger is None else self.ledger.gathered(group)

    def position(self) -> dict[str, Any]:
        """What `TrainState.epoch_position` holds: the layout, the stream and the micro-batches taken."""
        return {
            "world": self.world,
            "micro_batch_size": self.micro_batch_size,
            "stream": self.stream,
            "micro_batches": self.taken,
            **({"elastic": True} if self.elastic else {}),
        }
