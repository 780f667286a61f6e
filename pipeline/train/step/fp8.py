"""Float8 training (``--fp8``): the blocks' Linear layers compute in float8 with torchao, under FSDP2.

Order of setup (`pipeline.train.step.model.build_model`): model on meta -> `convert_to_float8` -> activation
checkpointing -> compile -> FSDP2. The conversion swaps each chosen ``nn.Linear`` for torchao's
``Float8Linear`` (a subclass holding the same ``weight`` and ``bias``), so parameter names, state
dicts and checkpoints are those of the bf16 model, and a run can resume with or without ``--fp8``.

Which layers: the four matmuls of every block (``attn.qkv``, ``attn.proj``, ``mlp.fc1``,
``mlp.fc2``), nearly all of a ViT's FLOPs. The patch embedding and the head stay in high precision:
together they are under 1% of the FLOPs (ViT-B/16: the patch embedding is one 768x768 matmul per
token against 144 of that size in the blocks), the patch embedding sees the raw normalized pixels and the head produces the logits the
loss is taken on, where float8's 3-bit mantissa would cost accuracy for no speed. float8 matmuls
also need both dimensions to be multiples of 16, which a class count often is not.

Scaling is dynamic and per tensor. With FSDP2 the weights are all-gathered in float8 (half the bytes
of bf16), and their scales for the next step are computed in one batched reduction right after each
optimizer step (`precompute_scales_after_step`) instead of one per weight in the forward.
Speed needs torch.compile (``--compile``): in eager mode the casts run as separate kernels.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

# ".blocks.3." in the encoder, ".decoder.blocks.0." in an MAE's decoder.
_BLOCK_LINEAR = re.compile(r"(^|\.)blocks\.\d+\.")


def is_fp8_linear(module: nn.Module, fqn: str) -> bool:
    """True for the Linear layers float8 training converts: inside a block, both sides multiples of 16."""
    return (
        isinstance(module, nn.Linear)
        and _BLOCK_LINEAR.search(fqn) is not None
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_to_float8(model: nn.Module, *, emulate: bool = False) -> nn.Module:
    """Swap the blocks' Linear layers for torchao's Float8Linear in place (on meta or materialized).

    ``emulate``: compute the float8 matmuls in float32 (no float8 tensor cores needed): what the CPU
    tests use to check the conversion; a training run never emulates.
    """
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
    return float8.convert_to_float8_training(model, module_filter_fn=is_fp8_linear, config=config)


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """After every optimizer step, compute the float8 scales of all sharded weights at once (one
    all-reduce of their amaxes) for the next forward's float8 all-gather."""
    float8 = _torchao_float8()
    optimizer.register_step_post_hook(lambda *_: float8.precompute_float8_dynamic_scale_for_fsdp(model))


def check_device(device: torch.device) -> None:
    """Refuse, in one line, a device without float8 tensor cores (before building anything)."""
    if device.type != "cuda":
        raise ValueError("--fp8 needs a CUDA GPU of compute capability 8.9+ (H100, L40S); drop --fp8")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"--fp8 needs float8 tensor cores (compute capability 8.9+, e.g. H100); {name} has "
            f"{capability[0]}.{capability[1]}: drop --fp8"
        )


def _torchao_float8():
    try:
        # A CPU build of torch cannot load torchao's CUDA kernels, and torchao logs a warning per
        # library file saying so; nothing here needs them on CPU (emulation is plain torch).
        quiet = not torch.cuda.is_available()
        logger = logging.getLogger("torchao")
        level = logger.level
        if quiet:
            logger.setLevel(logging.ERROR)
        try:
            import torchao.float8 as float8
        finally:
            logger.setLevel(level)
    except ImportError as e:
        raise ImportError("--fp8 needs the torchao package: pip install 'vitray[fp8]'") from e
    return float8
