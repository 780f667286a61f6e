"""The optimizer step, without Ray: forward and backward over micro-batches, then clip and update.

    gradients = step.forward_backward(n, micro_batches, global_count)   # in the model's parameters
    stats = step.update(gradients)                                       # clip, learning rate, AdamW

Two calls, so that whoever runs the step can do what must come before the update between them (the
training loop: the previous step's report and checkpoint, `pipeline.train.loop`); ``step(...)`` makes both.
It runs under Ray Train workers, under `torchrun`, or in one plain process, which is how
`jobs/benchmark.py train` measures a variant on a bare GPU machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipeline.train.config import TrainConfig
from pipeline.train.step.mixing import mix_seed
from pipeline.train.step.objective import Objective, objective_for
from pipeline.train.step.optim import build_optimizer, lr_factor


@dataclass
class Gradients:
    """One step's gradients, in the model's parameters (reduced over the ranks), and the sums of the
    forward and backward passes on this rank that made them."""

    step: int  # the optimizer step (0-based) they belong to
    loss_sum: torch.Tensor  # sum of per-sample losses on this rank (the objective's)
    correct: torch.Tensor  # top-1 hits on this rank (0 for an objective without classes)
    count: int  # samples on this rank


@dataclass
class StepStats:
    """Local sums for one optimizer step; reduce across ranks before reporting."""

    loss_sum: torch.Tensor  # sum of per-sample losses on this rank (the objective's)
    correct: torch.Tensor  # top-1 hits on this rank (0 for an objective without classes)
    count: int  # samples on this rank
    grad_norm: torch.Tensor  # global (all ranks) gradient norm before clipping
    lr: float
    skipped: torch.Tensor  # (bool, on the device) the loss or gradient norm was not finite: no update


class TrainStep:
    """One optimizer step: `forward_backward` over micro-batches (sync on the last), then `update`."""

    def __init__(
        self, model: nn.Module, config: TrainConfig, device: torch.device, objective: Objective | None = None
    ):
        self.model = model
        self.config = config
        self.device = device
        self.objective = objective or objective_for(config)  # the loss; the step is the same for all
        self.optimizer = build_optimizer(model, config)

    def __call__(
        self,
        step: int,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        global_count: int,
        micro_steps: int | None = None,
    ) -> StepStats:
        """`forward_backward`, then `update`, with nothing between them."""
        return self.update(self.forward_backward(step, micro_batches, global_count, micro_steps))

    def forward_backward(
        self,
        step: int,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        global_count: int,
        micro_steps: int | None = None,
    ) -> Gradients:
        """The passes of optimizer step `step` (0-based) over this rank's micro-batches, each a tuple of
        the objective's columns (supervised: `(patches uint8 (B, N, K), labels (B,))`). Each micro-batch's
        Mixup/CutMix draw is a pure function of (seed, step, rank, its index): a resumed run draws alike.
        Nothing a checkpoint holds is written here (learning rate, weights, optimizer state).

        `global_count` is the number of samples in this step across all ranks: each rank scales
        its summed loss by world_size / global_count, so after FSDP2 averages gradients over ranks
        they are the gradient of the mean loss over every sample of the step, whatever the
        per-rank counts. `micro_steps` (the same on every rank; default: this rank's count, at
        least 1) is how many forward/backward passes every rank makes: FSDP2 gathers parameters in
        each one, so a rank with fewer micro-batches makes up the difference with passes of zero loss.
        """
        model, world, rank = self.model, dist.get_world_size(), dist.get_rank()
        scale = world / max(global_count, 1)
        passes = max(len(micro_batches), 1) if micro_steps is None else micro_steps
        if passes < len(micro_batches):
            raise ValueError(f"{len(micro_batches)} micro-batches for {passes} micro-steps")
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        count = 0
        for i in range(passes):
            # Reduce-scatter gradients only once, after the last micro-batch, and keep the parameters
            # gathered until then: the next micro-batch's forward would only gather them again.
            model.set_requires_gradient_sync(i == passes - 1)
            model.set_reshard_after_backward(i == passes - 1)
            if i >= len(micro_batches):
                self.objective.participate(model, self.device)
                continue
            seed = mix_seed(self.config.run.seed, step, rank, i)  # a pure function: resumes draw alike
            losses, hits = self.objective.losses(model, micro_batches[i], seed)
            (losses.sum() * scale).backward()
            loss_sum += losses.detach().sum()
            if hits is not None:
                correct += hits
            count += losses.shape[0]
        return Gradients(step, loss_sum, correct, count)

    def update(self, gradients: Gradients) -> StepStats:
        """Clip the ``gradients`` and update the weights at the learning rate of their step,
        a pure function of the step (set here: no scheduler state to checkpoint); a step whose loss or
        gradient norm is not finite changes no weight."""
        model, step = self.model, gradients.step
        # The global norm is measured either way (it is logged, and tells a non-finite step); at a
        # threshold of inf the scale is 1, so grad_clip 0 leaves the gradients as they are.
        max_norm = self.config.optim.grad_clip or math.inf
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.config.optim.lr * lr_factor(step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # layer-wise decay (`optim.param_groups`)
        # A non-finite loss on any rank makes that rank's gradients, hence the global norm, non-finite,
        # so every rank reaches the same verdict here without a collective of its own.
        skipped = ~torch.isfinite(grad_norm.detach())
        if self.optimizer.defaults.get("fused"):
            # The fused kernels skip the update on the device when `found_inf` is set (and take their
            # step count back), so the host queues the next step without waiting for this one.
            self.optimizer.found_inf = skipped.float()
            self.optimizer.step()
        elif not bool(skipped):  # other kernels: decided on the host, the step's one wait for the device
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(
            gradients.loss_sum, gradients.correct, gradients.count, grad_norm.detach(), lr, skipped
        )
