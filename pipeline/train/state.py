"""What a rank is, what a training run carries across checkpoints, and what the ranks agree on at each step.

`Rank` is one worker's place in the run, fixed at set-up. `TrainState` is the part of a checkpoint that is not model or optimizer state (`train_state.json`).
The agreements are the loop's collectives, each named by what the ranks settle: how many samples the
step holds (none: the epoch is over), the first data error, whether some rank has a preemption notice,
every rank's bad-sample counts. `agree_on_error` is the one
way the ranks settle on an error (the step's here, fine-tuning's evaluation in `pipeline.train.finetune`):
every rank learns the same message and ends the same way.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.data.bad_samples import BadSamples


@dataclass(frozen=True)
class Rank:
    """One worker's place in the run, fixed once the process group is up: what the data plan, the
    checkpointer, evaluation and the preemption check need of it."""

    rank: int
    world: int
    device: torch.device
    group: dist.ProcessGroup | None  # `control_group()`: the agreements' CPU group (None: the default)
    accum: int  # micro-batches per optimizer step on each rank


@dataclass
class TrainState:
    """Where the run stands: saved beside every checkpoint, the same on every rank."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    seed: int = 0
    # Where every rank stands in this epoch's stream: {"world", "micro_batch_size", "stream",
    # "micro_batches"}, the micro-batch places of the epoch's steps so far at that layout, from that
    # stream ({} at the epoch's start): the same on every rank, each rank having taken that many of
    # its micro-batches or, in the epoch's padded tail, all of them. A run resumed at the same layout
    # and stream re-reads exactly those and trains on the rest (`pipeline.train.input.cursor.EpochCursor`).
    epoch_position: dict[str, Any] = field(default_factory=dict)
    # What this epoch has consumed, by sample, whatever the layout (`pipeline.train.input.position`): the
    # union over every rank. A run resumed at another layout takes up the epoch from it ({}: nothing).
    epoch_consumed: dict[str, Any] = field(default_factory=dict)
    # Every rank's bad-sample counts when this epoch began: the re-read starts from them, so it ends
    # at exactly the counts of `bad_samples` (each sample counted once across the resume).
    epoch_bad_samples: list[dict[str, Any]] = field(default_factory=list)
    # Run totals, continued by a resumed run: steps skipped for a non-finite loss or gradient norm,
    # and every rank's bad-sample counts (`BadSamples.to_dict`, one per rank).
    skipped_steps: int = 0
    bad_samples: list[dict[str, Any]] = field(default_factory=list)
    # What every epoch consumed, per shard, summed over every rank and attempt: samples and a hash of their
    # keys, the bad ones apart (`pipeline.train.input.ledger`; {}: not kept, a checkpoint that predates it).
    ledger: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int | None:
        """The number of workers that saved this state (None: a fresh run's, which none saved)."""
        return self.epoch_position.get("world") or len(self.bad_samples) or None

    def where(self) -> tuple[Any, ...]:
        """The step, the epoch and (a copy of) the epoch's position: what a checkpoint's `take` fixes until
        its save."""
        return (self.step, self.epoch, copy.deepcopy(self.epoch_position))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainState:
        """From `to_dict`; fields a checkpoint predates keep their defaults, unknown keys are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass(frozen=True)
class StepAgreement:
    """What every rank knows before a step: whether it runs, and over how many samples.

    The epoch goes on until every rank's stream has run dry: a rank whose stream ended first joins
    the remaining steps with what it has left, then with nothing (the epoch's padded tail), so every
    good sample of the epoch is trained once and no rank waits in a collective the others skip."""

    samples: int  # samples of this step across all ranks; 0: every rank's stream has ended
    someone_ran_dry: bool  # some rank lacks a full step of micro-batches: the epoch's tail
    error: str  # the first rank's data error, "" when none: the run ends for all
    # Some rank has a preemption notice (`pipeline.train.checkpointing.preemption`): every rank checkpoints at this
    # step boundary, before this step, and stops so that Ray Train restarts the run from it.
    preempted: bool = False

    @property
    def epoch_over(self) -> bool:
        """No rank has a sample left: the epoch ends here, for all at once."""
        return self.samples == 0

    @property
    def runs(self) -> bool:
        return not self.epoch_over and not self.error and not self.preempted


def control_group() -> dist.ProcessGroup | None:
    """Collective, once at set-up: a CPU (gloo) group for the agreements below, so that none of them
    waits for the GPU's queued work (an NCCL collective read back on the host would); None where the
    default group is gloo already."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def agree_on_step(
    samples: int, ran_dry: bool, error: str, group: dist.ProcessGroup | None, *, preempted: bool = False
) -> StepAgreement:
    """Collective: sum the ranks' sample counts and learn whether any rank ran dry, hit an error or has
    a preemption notice (``preempted``: folded into the same all-reduce, so it costs nothing more).

    Every rank calls it once per step, those out of data too, so every rank knows whether the step
    runs (some rank still has samples) and joins its collectives. `group` is `control_group()`'s.
    """
    error, (total, dry, notices) = agree_on_error(error, group, counts=(samples, ran_dry, preempted))
    return StepAgreement(int(total), dry > 0, error, notices > 0)


def agree_on_error(
    mine: str, group: dist.ProcessGroup | None, counts: Sequence[float] = ()
) -> tuple[str, list[float]]:
    """Collective: (the lowest failing rank's error message, "" when no rank has one; every rank's
    ``counts`` summed). Every rank calls it with its own error ("" for none) and as many counts; the
    counts ride on the same all-reduce as the failure flag, and the messages are gathered only when
    some rank failed, so a step without errors costs one small all-reduce. `group`: as `agree_on_step`.
    """
    flags = torch.tensor([*counts, bool(mine)], dtype=torch.float64)
    dist.all_reduce(flags, group=group)
    *sums, failed = flags.tolist()
    if failed == 0:
        return "", sums
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, mine, group=group)
    return next(e for e in errors if e), sums


def gather_bad_samples(mine: BadSamples, group: dist.ProcessGroup | None) -> list[dict[str, Any]]:
    """Collective: every rank's bad-sample counts (`BadSamples.to_dict`), in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine.to_dict(), group=group)
    return gathered


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (the DTensor's local tensor), or a plain tensor itself."""
    return param.to_local() if hasattr(param, "to_local") else param  # FSDP2 DTensor -> this rank's shard
