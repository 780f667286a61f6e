"""AdamW with the ViT recipe's decay rules (or SGD with momentum, the paper's fine-tuning), and the
warmup-then-decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from pipeline.train.config import TrainConfig

# Parameters that are embeddings rather than weights of a linear map: decaying them towards zero
# only fights the signal they carry (position, the CLS query).
NO_DECAY_NAMES = ("pos_embed", "cls_token")


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0) -> list[dict]:
    """AdamW groups: matrices decay; biases, norm scales, position and CLS embeddings do not. With
    ``layer_decay`` < 1 (layer-wise learning-rate decay, as MAE and BEiT fine-tune) each of those splits
    by layer (`layer_of`), and a group's ``lr_scale`` is ``layer_decay ** (depth + 1 - layer)``: the
    embeddings learn slowest, the head at the full rate. At 1, the two groups without a scale."""
    depth = 1 + max(
        (int(n.split(".")[1]) for n, _ in model.named_parameters() if n.startswith("blocks.")), default=-1
    )
    groups: dict[tuple[int, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # ndim counts the global shape for FSDP2's DTensor parameters too.
        decays = not (param.ndim <= 1 or any(key in name for key in NO_DECAY_NAMES))
        layer = layer_of(name, depth) if layer_decay != 1 else depth + 1
        groups.setdefault((layer, decays), []).append(param)
    if layer_decay == 1:
        return [
            {"params": groups.get((depth + 1, True), []), "weight_decay": weight_decay},
            {"params": groups.get((depth + 1, False), []), "weight_decay": 0.0},
        ]
    return [
        {
            "params": params,
            "weight_decay": weight_decay if decays else 0.0,
            "lr_scale": layer_decay ** (depth + 1 - layer),
        }
        for (layer, decays), params in sorted(groups.items())
    ]


def layer_of(name: str, depth: int) -> int:
    """A parameter's layer for layer-wise lr decay: 0 for the patch embedding (a hybrid's CNN too), [CLS]
    and position embeddings; i + 1 for block i; ``depth + 1`` for the final norm and the head."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    if name.startswith(("patch_embed", "cls_token", "pos_embed")):
        return 0
    return depth + 1


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """``config.optim.optimizer``: AdamW (pretraining), or SGD with momentum (fine-tuning, Sec. 4.1 of the
    ViT paper: momentum 0.9, no weight decay unless ``weight_decay`` asks for it)."""
    if config.optim.optimizer == "sgd":
        return torch.optim.SGD(
            param_groups(model, config.optim.weight_decay, config.optim.layer_decay),
            lr=config.optim.lr,
            momentum=config.optim.momentum,
            foreach=True,
        )
    impl = adamw_impl(config.speed.optimizer_impl, _device_of(model))
    optimizer = torch.optim.AdamW(
        param_groups(model, config.optim.weight_decay, config.optim.layer_decay),
        lr=config.optim.lr,
        betas=config.optim.betas,
        foreach=impl == "foreach",
        fused=impl == "fused",
    )
    if config.speed.fp8:
        from pipeline.train.step.fp8 import precompute_scales_after_step

        precompute_scales_after_step(optimizer, model)
    return optimizer


def adamw_impl(requested: str, device: torch.device) -> str:
    """The AdamW kernels to use: ``fused`` (one kernel over every parameter: the least launch and
    DTensor-dispatch overhead per step), ``foreach`` (a few multi-tensor kernels per op) or
    ``for-loop`` (one parameter at a time: the reference the other two are tested against).
    ``auto`` takes fused on CUDA, where FSDP2's DTensor parameters support it, and foreach elsewhere.
    """
    if requested == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return requested


def optimizer_kernels(optimizer: torch.optim.Optimizer) -> str:
    """What the optimizer was built with, as recorded in its defaults: fused, foreach or for-loop."""
    if optimizer.defaults.get("fused"):
        return "fused"
    return "foreach" if optimizer.defaults.get("foreach") else "for-loop"


def _device_of(model: nn.Module) -> torch.device:
    # A DTensor parameter reports the device of its local shard.
    return next(model.parameters()).device


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warmup, then cosine or linear decay to min_lr."""
    if step < config.optim.warmup_steps:
        return (step + 1) / config.optim.warmup_steps
    progress = (step - config.optim.warmup_steps) / max(1, config.optim.max_steps - config.optim.warmup_steps)
    progress = min(progress, 1.0)
    floor = config.optim.min_lr / config.optim.lr
    if config.optim.lr_schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)
