"""An exponential moving average of the weights (`--ema-decay`), kept shard by shard under FSDP2.

    after optimizer step s, when s % every == 0:   ema <- d^every * ema + (1 - d^every) * param

Polyak averaging as DeiT and big_vision train with it (timm's `ModelEmaV3`, parameters only: the ViT's
buffers are constants). Each rank averages the local shards of its own FSDP2 parameters (the DTensors'
local tensors), in float32, with no collective: the EMA costs 4 bytes per parameter of the rank's shard
(logged at the start) and one multi-tensor lerp per update. ``d`` is a per-step decay whatever
``every``: an update every N steps uses ``d^N``, so the EMA's horizon (about ``1 / (1 - d)`` steps) does
not change with N. (timm updates every step with ``d``; at N = 1 the two agree.)

The EMA starts from the weights the run starts from (initialized, pretrained or resumed). It is saved in
every checkpoint under ``ema.<parameter name>``, as DTensors of the parameters' layout, so it reshards
like the model; a checkpoint written without it starts it afresh from the checkpoint's weights. The run
exports it as ``final_ema/`` beside ``final/``, gathered a tensor at a time like the weights. With
``--eval-data``, every evaluation scores the EMA too (`applied`: the model holds it for that forward
pass only), as ``eval_ema_accuracy`` beside ``eval_accuracy`` in the metrics row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from pipeline import compat
from pipeline.train.state import local_shard

PREFIX = "ema"  # the checkpoint's entries: ema.<parameter name>


class WeightEMA:
    """The EMA of ``model``'s parameters on this rank: one float32 tensor per local shard."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1):
        self.decay, self.every = decay, every
        self.model = model
        # Parameter names are the state dict's: wrapping (AC, compile) leaves them unchanged.
        self.params = dict(model.named_parameters())
        self.shadow = {
            name: local_shard(p).detach().to(torch.float32, copy=True) for name, p in self.params.items()
        }
        self.restored = False  # whether `load_state_dict` gave it its values (a resume)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the EMA."""
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    @torch.no_grad()
    def reset(self) -> None:
        """Start again from the weights as they are now."""
        for name, p in self.params.items():
            self.shadow[name].copy_(local_shard(p))
        self.restored = False

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (steps taken, 1-based): one update every ``every`` steps.
        A skipped step changed no weight; the EMA still moves toward the weights, as timm's does."""
        if step % self.every:
            return
        weight = 1.0 - self.decay**self.every
        compat.foreach_lerp_(
            list(self.shadow.values()), [local_shard(p) for p in self.params.values()], weight
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block the model holds the EMA in place of its weights (to evaluate it); after, its
        own weights again, bit for bit: each local shard is copied aside, then back. FSDP2 keeps the
        gathered (unsharded) weights of its last forward for the next, so the model is resharded on the
        way in (the forward gathers the EMA) and on the way out (the next step gathers its own weights
        again). Costs a copy of the rank's shards while it lasts."""
        with torch.no_grad():
            _reshard(self.model)
            kept = {name: local_shard(p).clone() for name, p in self.params.items()}
            for name, p in self.params.items():
                local_shard(p).copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                _reshard(self.model)
                for name, p in self.params.items():
                    local_shard(p).copy_(kept[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Name -> the EMA in its parameter's layout (a DTensor over the shard, no copy), for DCP."""
        return {name: _like(self.shadow[name], self.params[name]) for name in self.params}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """From `state_dict` entries that DCP filled in (in place already; copied to be sure)."""
        for name, value in state.items():
            self.shadow[name].copy_(local_shard(value))
        self.restored = True

    def model_state_dict(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """``model_state`` (the model's sharded state dict) with the EMA in place of each parameter:
        what an export of the EMA gathers (buffers stay the model's)."""
        ema = self.state_dict()
        return {name: ema.get(name, value) for name, value in model_state.items()}


def _reshard(model: nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its sharded weights (what its next forward gathers)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
