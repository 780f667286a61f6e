"""What a test or a profiler sees of each step of the loop (`pipeline.train.loop`): a `StepWatch` handed to
the loop, and the `TakenStep` it is shown. The loop calls it at two points of its timeline, neither of
which can change what the step trains on."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.data.bad_samples import BadSamples
from pipeline.train.step.train_step import StepStats


@dataclass(frozen=True)
class TakenStep:
    """What a `StepWatch` sees of a step: its number, its epoch and this rank's input."""

    step: int  # 1 for the run's first step
    epoch: int
    keys: list[str]  # this rank's samples, in the order the step takes them
    bad_samples: BadSamples  # this rank's bad-sample counts as of this input (a copy)


class StepWatch:
    """What a test or a profiler sees of each step: subclass it, override either call, and hand it to the
    loop (`Trainer`, `train_loop_per_worker`; through `pipeline.train.driver.fit`, a ``worker_loop`` that
    passes it on). Both run on the training thread; neither may change what the step trains on."""

    def taken(self, step: TakenStep) -> None:
        """The step's input is taken and every rank agreed to run it; its forward is not queued yet."""

    def trained(self, step: int, stats: StepStats) -> None:
        """Step ``step``'s update is queued: ``stats`` hold its loss and gradient norm on the device
        (reading them waits for the step)."""
