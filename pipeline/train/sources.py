"""Mixed sources in the training loop: each rank's mixed stream of an epoch, and what the log says of them.

The driver expands each source of a ``--data`` mixture (`pipeline.data.mixture`) and hands the workers
``sources``: ``[{"name", "weight", "shards"}, ...]``. A rank reads each source as it would read a single
one (its shards ``order[rank::world]`` of the source's shard order for that pass), and
`pipeline.data.mixture.mixed_micro_batches` fills every sample place of a step from the source drawn for
it. The mixed stream is a pure function of the run's seed, the epoch and the rank, so the loop's cursor
(`pipeline.train.cursor.EpochCursor`) resumes it as it resumes a single source: by re-reading the
micro-batches taken; the per-source counts come back with the re-read. The next epoch's mixed input starts
while this one's last steps train, as a single source's does (`pipeline.train.prefetch`).

At another layout the cursor goes on by sample (`pipeline.train.source_position`): each source starts at
its first pass not complete on the union of the old ranks, and each pass it reads is dealt by the cursor
(`EpochCursor.deal`) as a single source's epoch is: its shards not done, every ``world``-th, their
consumed samples passed over. A source whose first pass was complete has run out on every new rank: with
``cycle`` it is only cycled on (from its next pass not complete), with ``end`` the epoch is over. Not
kept: the order of the remaining samples, which share a step, and each place's draw (keyed by the new
ranks), so a source's share of the rest of the epoch holds only on average.

A plain ``--data`` never comes here: it runs as before, sample for sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig, shard_order
from pipeline.data.dataset import Batch, micro_batches
from pipeline.data.mixture import SourceReader, mixed_micro_batches, pass_epoch, shares
from pipeline.data.shards import dataset_root, shard_name
from pipeline.train import cursor
from pipeline.train.prefetch import Prefetcher
from pipeline.train.resources import data_cpus_per_worker
from pipeline.train.source_position import SourcesPosition


class Deal(Protocol):
    """`pipeline.train.cursor.EpochCursor.deal`: this rank's shards of a shard ``order`` (here: of source
    ``part[0]``'s pass ``part[1]``), and the keyword arguments of their `micro_batches` (``skip``)."""

    def __call__(
        self, order: list[str], ahead: bool = False, part: tuple[int, int] | None = None
    ) -> tuple[list[str], dict[str, Any]]: ...


@dataclass(frozen=True)
class Mixture:
    """The run's sources (name, weight, expanded shards) and what one that runs out does."""

    names: list[str]
    weights: list[float]
    shards: list[list[str]]
    exhausted: str

    @classmethod
    def from_loop_config(cls, loop_config: dict[str, Any], exhausted: str) -> Mixture | None:
        """The workers' mixture, or None for one plain source."""
        sources = loop_config.get("sources")
        if not sources:
            return None
        return cls(
            [s["name"] for s in sources], [float(s["weight"]) for s in sources],
            [list(s["shards"]) for s in sources], exhausted,
        )  # fmt: skip

    def fingerprint(self, seed: int, shuffle_buffer: int) -> str:
        """What fixes every rank's mixed stream beside the layout (as `pipeline.train.cursor.
        stream_fingerprint` for one source): each source's shard names, its weight, the seed, the shuffle
        buffer and what a source that runs out does."""
        named = [
            [name, [shard_name(url, dataset_root(shards)) for url in shards]]
            for name, shards in zip(self.names, self.shards, strict=True)
        ]
        whole = [[[n, w, s] for (n, s), w in zip(named, self.weights, strict=True)], seed, shuffle_buffer]
        return cursor.fingerprint(
            [*whole, self.exhausted],
            sources=named, weights=self.weights, seed=seed, shuffle=shuffle_buffer, exhausted=self.exhausted,
        )  # fmt: skip

    def stream(
        self,
        data_config: DataConfig,
        epoch: int,
        rank: int,
        world: int,
        accum: int,
        size: int,
        *,
        counts: BadSamples,
        data_cpus: float,
        deal: Deal | None = None,
        dealt: SourcesPosition | None = None,
    ) -> Iterator[Batch]:
        """This rank's mixed micro-batches of ``epoch``; every source counts into ``counts`` (its
        ``sources`` entry per source). The rank's decode CPUs are shared by the sources' pipelines in
        proportion to their weights. ``deal`` gives the rank's shards of each pass (else
        ``order[rank::world]``); ``dealt``: the position an elastic epoch goes on from (module doc)."""
        seed = data_config.seed
        cpus = [max(data_cpus * share, min(data_cpus, 1.0)) for share in shares(self.weights).tolist()]

        def opener(source: int, cpus: float):
            shards = self.shards[source]
            root = dataset_root(shards)

            def open_pass(passes: int) -> Iterator[Batch]:
                key = pass_epoch(epoch, passes)
                order = shard_order(shards, seed, key)
                mine, skip = deal(order, part=(source, passes)) if deal else (order[rank::world], {})
                return micro_batches(
                    mine, data_config, epoch=key, rank=rank, size=size,
                    bad_samples=counts, data_cpus=cpus, root=root, **skip,
                )  # fmt: skip

            return open_pass

        def reader(s: int, name: str, cpus: float) -> SourceReader:
            resumed = {} if dealt is None else {"first": dealt.first_pass(s), "begun": dealt.last_begun(s)}
            return SourceReader(name, opener(s, cpus), counts, index=s, **resumed)

        readers = [reader(s, name, c) for s, (name, c) in enumerate(zip(self.names, cpus, strict=True))]
        return mixed_micro_batches(
            readers, self.weights, seed=seed, rank=rank, epoch=epoch, accum=accum,
            size=size, exhausted=self.exhausted,
        )  # fmt: skip

    def metrics(self, counts: BadSamples, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """Collective: the ``sources`` entry of a metrics row, all ranks merged: per source the samples
        taken, bad samples read, its share of the samples taken against its target weight, the pass of
        this epoch the furthest rank is in and the samples taken in it."""
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, counts.sources, group=group)
        merged = BadSamples()
        for one in gathered:
            merged.merge(BadSamples(sources=one))
        total = sum(c.get("samples", 0) for c in merged.sources.values())
        out = {}
        for name, target in zip(self.names, shares(self.weights).tolist(), strict=True):
            c = merged.sources.get(name, {})
            out[name] = {
                "samples": c.get("samples", 0),
                "bad": c.get("bad", 0),
                "share": c.get("samples", 0) / total if total else 0.0,
                "weight": target,
                "pass": c.get("pass", 1),
                "in_pass": c.get("in_pass", 0),
            }
        return {"sources": out}


def epoch_input(trainer: Any, ahead: BadSamples | None = None) -> Prefetcher:
    """`pipeline.train.loop.Trainer.epoch_input` for mixed sources: the rank's mixed micro-batches of the
    epoch after those it has taken; given ``ahead`` (the counts this epoch's stream ended with), the next
    epoch's from its start. When the stream runs dry the next epoch's input starts, as for one source."""
    t = trainer
    epoch = t.state.epoch + (ahead is not None)
    counts = t.cursor.replay_counts() if ahead is None else ahead
    cpus = t.data_cpus or data_cpus_per_worker(t.config, t.world, t.rank, epoch)
    size = t.config.optim.micro_batch_size
    elastic = ahead is None and t.cursor.elastic  # the epoch goes on by sample (`EpochCursor.deal`)
    stream = t.mixture.stream(
        t.data_config, epoch, t.rank, t.world, t.accum, size, counts=counts, data_cpus=cpus,
        deal=t.cursor.deal if elastic else None, dealt=t.cursor.dealt if elastic else None,
    )  # fmt: skip
    return t.prefetcher(stream, epoch, counts, ahead=ahead is not None)


def position(trainer: Any) -> SourcesPosition | None:
    """The empty position by sample of a mixed run's sources, per pass; None for one source (the
    cursor keeps its shards' `pipeline.train.position.EpochPosition`)."""
    m = trainer.mixture
    return None if m is None else SourcesPosition(m.names, m.shards)


def stream_fingerprint(trainer: Any) -> str:
    """The fingerprint of the rank's streams the cursor resumes (`pipeline.train.cursor.stream_fingerprint`
    for one source; `Mixture.fingerprint` for several)."""
    seed, buffer = trainer.config.run.seed, trainer.data_config.shuffle_buffer
    if trainer.mixture is None:
        return cursor.stream_fingerprint(trainer.shards, seed, buffer)
    return trainer.mixture.fingerprint(seed, buffer)


def metrics(trainer: Any) -> dict[str, Any]:
    """Collective for a mixed run: the ``sources`` entry of its metrics row (`Mixture.metrics`); {} for one
    source (no collective)."""
    if trainer.mixture is None:
        return {}
    return trainer.mixture.metrics(trainer.cursor.counts, trainer.group)
