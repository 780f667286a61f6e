"""The data plan: what a rank trains on, epoch by epoch. The training loop asks its plan for four things
and nothing else: an epoch's step inputs, the empty position by sample its checkpoints record, the
fingerprint of its streams, and the entry its metrics rows add.

    DataPlan (protocol) --- OneSource: a plain ``--data``, the shards of one dataset
                        +-- Mixture:   sources mixed by weight (``--data a=URL:0.7,b=URL:0.3``)

Both hand the loop step inputs through a `pipeline.train.input.prefetch.Prefetcher` built over the rank's
stream of micro-batches, after those the rank has taken (`pipeline.train.input.cursor.EpochCursor`); once the
stream has run dry (`StepInputs.ran_dry`), the loop starts the next epoch's input while this one's last
steps train.
`pipeline.train.input.feeder` hands out the same `StepInputs` from a process of the rank's own (``--data-process
feeder``).

One source. Each epoch has one shard order, a pure function of (seed, epoch); rank r streams
``order[r::world]`` through its own Ray Data pipeline (`pipeline.data.dataset.micro_batches`). Its
position by sample is one `pipeline.train.input.position.EpochPosition` of the shards, its fingerprint
`pipeline.train.input.cursor.stream_fingerprint`, and its metrics rows add nothing.

Mixed sources. The driver expands each source of a ``--data`` mixture (`pipeline.data.mixture`) and hands
the workers ``sources``: ``[{"name", "weight", "shards"}, ...]``. A rank reads each source as it would read
a single one (its shards ``order[rank::world]`` of the source's shard order for that pass), and
`pipeline.data.mixture.mixed_micro_batches` fills every sample place of a step from the source drawn for
it. The mixed stream is a pure function of the run's seed, the epoch and the rank, so the cursor resumes
it as it resumes a single source: by re-reading the micro-batches taken; the per-source counts come back
with the re-read.

At another layout the cursor goes on by sample (`pipeline.train.input.source_position`): each source starts at
its first pass not complete on the union of the old ranks, and each pass it reads is dealt by the cursor
(`EpochCursor.deal`) as a single source's epoch is: its shards not done, every ``world``-th, their
consumed samples passed over. A source whose first pass was complete has run out on every new rank: with
``cycle`` it is only cycled on (from its next pass not complete), with ``end`` the epoch is over. Not
kept: the order of the remaining samples, which share a step, and each place's draw (keyed by the new
ranks), so a source's share of the rest of the epoch holds only on average.

A plain ``--data`` is not a mixture of weight 1: its stream and position stay sample for sample those that
runs and checkpoints of one source have always had.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig, shard_order
from pipeline.data.dataset import Batch, by_token_budget, micro_batches
from pipeline.data.mixture import SourceReader, mixed_micro_batches, pass_epoch, shares
from pipeline.data.shards import dataset_root, shard_names
from pipeline.train.config import TrainConfig
from pipeline.train.input.cursor import EpochCursor, Position, fingerprint, stream_fingerprint, with_patches
from pipeline.train.input.position import EpochPosition
from pipeline.train.input.prefetch import Prefetcher, StepInput
from pipeline.train.input.source_position import SourcesPosition
from pipeline.train.resources import data_cpus_per_worker
from pipeline.train.state import Rank


class StepInputs(Protocol):
    """An epoch's step inputs for this rank, as the loop takes them (`Prefetcher`)."""

    def next(self) -> StepInput: ...

    def ran_dry(self) -> BadSamples | None:
        """The stream's final counts once it has run dry (maybe steps ahead of the input that ends it)."""
        ...

    def release(self, step_input: StepInput) -> None: ...

    def close(self) -> None: ...


class DataPlan(Protocol):
    """What a rank trains on: everything the training loop asks of its data."""

    fingerprint: str  # what fixes every rank's stream beside the layout: a resume re-reads only the same

    def position(self) -> Position:
        """An empty position by sample of an epoch (the cursor's, and its checkpoints' record)."""
        ...

    def cpus(self, epoch: int) -> float:
        """This rank's decode CPUs in ``epoch``: its data plane's, and any other pipeline it runs then
        (the fine-tuning evaluation, the probe head's images)."""
        ...

    def epoch_input(
        self,
        epoch: int,
        cursor: EpochCursor,
        *,
        ahead: BadSamples | None,
    ) -> StepInputs:
        """This rank's steps of ``epoch`` after the micro-batches ``cursor`` has taken; given ``ahead``
        (the counts the epoch before ended with), from the epoch's start."""
        ...

    def metrics(self, counts: BadSamples, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """Collective where the plan has one: what its metrics rows add ({} for none)."""
        ...

    def close(self) -> None:
        """The run is over (or failed): stop what the plan started beside the epochs' inputs."""
        ...


class Deal(Protocol):
    """`pipeline.train.input.cursor.EpochCursor.deal`: this rank's shards of a shard ``order`` (here: of source
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
        """What fixes every rank's mixed stream beside the layout (as `pipeline.train.input.cursor.
        stream_fingerprint` for one source): each source's shard names, its weight, the seed, the shuffle
        buffer and what a source that runs out does."""
        named = [[name, shard_names(shards)] for name, shards in zip(self.names, self.shards, strict=True)]
        whole = [[[n, w, s] for (n, s), w in zip(named, self.weights, strict=True)], seed, shuffle_buffer]
        return fingerprint(
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
        read: Callable[..., Iterator[Batch]] = micro_batches,
    ) -> Iterator[Batch]:
        """This rank's mixed micro-batches of ``epoch``; every source counts into ``counts`` (its
        ``sources`` entry per source). The rank's decode CPUs are shared by the sources' pipelines in
        proportion to their weights. ``deal`` gives the rank's shards of each pass (else
        ``order[rank::world]``); ``dealt``: the position an elastic epoch goes on from (module doc); ``read``:
        a source's stream of one pass (`micro_batches`)."""
        seed = data_config.seed
        cpus = [max(data_cpus * share, min(data_cpus, 1.0)) for share in shares(self.weights).tolist()]

        def opener(source: int, cpus: float):
            shards = self.shards[source]
            root = dataset_root(shards)

            def open_pass(passes: int) -> Iterator[Batch]:
                key = pass_epoch(epoch, passes)
                order = shard_order(shards, seed, key)
                mine, skip = deal(order, part=(source, passes)) if deal else (order[rank::world], {})
                return read(
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


@dataclass(frozen=True)
class PlanSettings:
    """What every plan here reads of the run: its settings, the data's, the rank, the batch columns the
    objective trains on, and the rank's decode CPUs (None: decided per epoch, `data_cpus_per_worker`)."""

    config: TrainConfig
    data_config: DataConfig
    me: Rank
    columns: tuple[str, ...]
    data_cpus: float | None


class StreamPlan:
    """The part every plan here shares: step inputs built over the rank's stream of micro-batches."""

    def __init__(self, settings: PlanSettings):
        self.config, self.data_config, self.me = settings.config, settings.data_config, settings.me
        self.columns, self.data_cpus = settings.columns, settings.data_cpus
        # The stream of one pass of shards, as found when the plan is made: a plan handed to a feeder
        # process (`pipeline.train.input.feeder`) reads with the same function there.
        self.read = micro_batches

    def cpus(self, epoch: int) -> float:
        """`DataPlan.cpus`: the run's --data-cpus-per-worker, else `data_cpus_per_worker`'s share."""
        return self.data_cpus or data_cpus_per_worker(self.config, self.me.world, self.me.rank, epoch)

    def epoch_input(
        self,
        epoch: int,
        cursor: EpochCursor,
        *,
        ahead: BadSamples | None,
    ) -> StepInputs:
        counts = cursor.replay_counts() if ahead is None else ahead
        stream = self.stream(epoch, cursor, counts, ahead=ahead is not None)
        # Native-aspect rows: micro-batches of one token budget (square ones: as they come).
        stream = by_token_budget(stream, self.data_config, self.config.optim.micro_batch_size)
        return Prefetcher(
            stream if ahead is not None else cursor.skip(stream),
            accum=self.me.accum,
            columns=self.columns,
            bad_samples=counts,
            pin=self.me.device.type == "cuda",
            depth=self.config.speed.prefetch_steps,
        )

    def stream(self, epoch: int, cursor: EpochCursor, counts: BadSamples, *, ahead: bool) -> Iterator[Batch]:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing runs beside the epochs' inputs, which the loop closes."""


class OneSource(StreamPlan):
    """A plain ``--data``: the shards of one dataset (module docstring)."""

    def __init__(self, shards: list[str], settings: PlanSettings):
        super().__init__(settings)
        self.shards = shards
        fingerprint = stream_fingerprint(shards, self.config.run.seed, self.data_config.shuffle_buffer)
        self.fingerprint = with_patches(fingerprint, self.data_config)

    def position(self) -> EpochPosition:
        return EpochPosition(self.shards)

    def stream(self, epoch: int, cursor: EpochCursor, counts: BadSamples, *, ahead: bool) -> Iterator[Batch]:
        order = shard_order(self.shards, self.config.run.seed, epoch)
        shards, skip = cursor.deal(order, ahead=ahead)
        return self.read(
            shards, self.data_config, epoch=epoch, rank=self.me.rank, size=self.config.optim.micro_batch_size,
            bad_samples=counts, data_cpus=self.cpus(epoch), root=dataset_root(self.shards),
            **skip,  # an elastic epoch's consumed samples, passed over (`EpochCursor.deal`)
        )  # fmt: skip

    def metrics(self, counts: BadSamples, group: dist.ProcessGroup | None) -> dict[str, Any]:
        return {}


class MixedSources(StreamPlan):
    """Sources mixed by weight (module docstring): `Mixture`'s streams, position and metrics."""

    def __init__(self, mixture: Mixture, settings: PlanSettings):
        super().__init__(settings)
        self.mixture = mixture
        fingerprint = mixture.fingerprint(self.config.run.seed, self.data_config.shuffle_buffer)
        self.fingerprint = with_patches(fingerprint, self.data_config)

    def position(self) -> SourcesPosition:
        return SourcesPosition(self.mixture.names, self.mixture.shards)

    def stream(self, epoch: int, cursor: EpochCursor, counts: BadSamples, *, ahead: bool) -> Iterator[Batch]:
        me = self.me
        elastic = not ahead and cursor.elastic  # the epoch goes on by sample (`EpochCursor.deal`)
        return self.mixture.stream(
            self.data_config, epoch, me.rank, me.world, me.accum, self.config.optim.micro_batch_size,
            counts=counts, data_cpus=self.cpus(epoch),
            deal=cursor.deal if elastic else None, dealt=cursor.dealt if elastic else None, read=self.read,
        )  # fmt: skip

    def metrics(self, counts: BadSamples, group: dist.ProcessGroup | None) -> dict[str, Any]:
        return self.mixture.metrics(counts, group)


def plan_for(
    loop_config: dict[str, Any],
    config: TrainConfig,
    data_config: DataConfig,
    me: Rank,
    columns: tuple[str, ...],
) -> DataPlan:
    """The run's plan from the driver's ``loop_config``: its ``sources`` mixed, or its ``shards``."""
    settings = PlanSettings(config, data_config, me, tuple(columns), loop_config["data_cpus_per_worker"])
    mixture = Mixture.from_loop_config(loop_config, config.run.source_exhausted)
    return (
        OneSource(list(loop_config["shards"]), settings)
        if mixture is None
        else MixedSources(mixture, settings)
    )
