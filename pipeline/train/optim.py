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


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices decay; biases, norm scales, position and CLS embeddings do not."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # ndim counts the global shape for FSDP2's DTensor parameters too.
        if param.ndim <= 1 or any(key in name for key in NO_DECAY_NAMES):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """``config.optimizer``: AdamW (pretraining), or SGD with momentum (fine-tuning, Sec. 4.1 of the
    ViT paper: momentum 0.9, no weight decay unless ``weight_decay`` asks for it)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            param_groups(model, config.weight_decay), lr=config.lr, momentum=config.momentum, foreach=True
        )
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=config.betas,
        # foreach kernels work on DTensors and on CPU; fused AdamW does not take DTensors everywhere.
        foreach=True,
    )


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warmup, then cosine or linear decay to min_lr."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    progress = min(progress, 1.0)
    floor = config.min_lr / config.lr
    if config.lr_schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)
