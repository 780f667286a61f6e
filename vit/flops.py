"""Forward FLOPs of a ViT, counted from its config (for MFU and for sizing runs).

FLOPs = 2 x multiply-adds of the matrix products: patch embedding, QKV, attention scores
(Q K^T), attention-weighted sum (A V), output projection, MLP, head. Normalization, softmax, GELU
and bias adds are left out: they are O(T D) per block against O(T D^2) for the products, and MFU
convention counts matmul FLOPs only. With T = 1 + N tokens, width D, MLP width M, one block is

    2 * (T D 3D  +  T^2 D  +  T^2 D  +  T D^2  +  2 T D M)

This reproduces the ViT papers' figures: 35.2 / 123.2 / 334.8 GFLOPs for B/16, L/16, H/14 at 224.
A hybrid adds its ResNet's convolutions ("backbone"; GroupNorm, ReLU and max-pool left out as
above), and its patch embedding is the 1x1 projection of the feature map, N C' D.
Masked autoencoding (`mae_flops_breakdown`): the encoder's blocks over 1 + n visible tokens, the
decoder's over 1 + N (ViT-L/16 at 224 with the paper's 8 x 512 decoder: 41.3 GFLOPs against 123.1).
A training step (forward + backward) costs 3x the forward; recomputation under activation
checkpointing is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from vit.config import ViTConfig

if TYPE_CHECKING:
    from vit.mae import MAEConfig


def backbone_macs(config: ViTConfig) -> int:
    """Multiply-adds of the hybrid's ResNet convolutions for one image (0 for a plain ViT).

    "SAME" padding: a layer of stride s turns h positions into ceil(h / s), as in `vit.hybrid`.
    """
    if config.backbone_layers is None:
        return 0
    width, size = config.backbone_width, config.image_size

    def conv(size_in: int, c_in: int, c_out: int, kernel: int, stride: int = 1) -> tuple[int, int]:
        size_out = math.ceil(size_in / stride)
        return size_out, size_out**2 * kernel**2 * c_in * c_out

    size, macs = conv(size, config.num_channels, width, 7, stride=2)
    size = math.ceil(size / 2)  # the stem's max-pool
    channels = width
    for i, units in enumerate(config.backbone_layers):
        mid, out = width * 2**i, 4 * width * 2**i
        for j in range(units):
            stride = 2 if i > 0 and j == 0 else 1
            if channels != out or stride != 1:  # the shortcut's 1x1 projection
                macs += conv(size, channels, out, 1, stride)[1]
            macs += conv(size, channels, mid, 1)[1]
            size, m = conv(size, mid, mid, 3, stride)
            macs += m + conv(size, mid, out, 1)[1]
            channels = out
    return macs


def flops_breakdown(config: ViTConfig, num_patches: int | None = None) -> dict[str, int]:
    """Forward FLOPs per image, by part (all blocks summed); ``num_patches``: an image of that many
    patches (native-aspect input) instead of the config's square grid."""
    n, d, m = num_patches or config.num_patches, config.embed_dim, config.mlp_dim
    t = 1 + n
    blocks = config.depth
    head = 0
    if config.head == "pretrain":
        head += d * config.pre_logits_dim
    head += config.pre_logits_dim * config.num_classes
    patch_in = config.patch_dim if config.backbone_layers is None else config.backbone_channels
    macs = {
        "backbone": backbone_macs(config),
        "patch_embed": n * patch_in * d,
        "qkv": blocks * t * d * 3 * d,
        "attention_scores": blocks * t * t * d,  # Q K^T over all heads
        "attention_values": blocks * t * t * d,  # softmax(Q K^T) V
        "attention_proj": blocks * t * d * d,
        "mlp": blocks * 2 * t * d * m,
        "head": head,
    }
    return {part: 2 * v for part, v in macs.items()}


def count_flops(config: ViTConfig, num_patches: int | None = None) -> int:
    """Forward FLOPs for one image (2 x multiply-adds); of ``num_patches`` patches where given."""
    return sum(flops_breakdown(config, num_patches).values())


def _block_macs(tokens: int, dim: int, mlp_dim: int) -> int:
    # One pre-LN block over `tokens` tokens: QKV, Q K^T, A V, output projection, MLP.
    return (
        tokens * dim * 3 * dim + 2 * tokens * tokens * dim + tokens * dim * dim + 2 * tokens * dim * mlp_dim
    )


def mae_flops_breakdown(
    config: ViTConfig, mae: MAEConfig, num_visible: int, num_patches: int | None = None
) -> dict[str, int]:
    """Forward FLOPs per image of masked autoencoding, by part: the encoder over [CLS] + ``num_visible``
    tokens, the decoder over [CLS] + all N (``num_visible`` from `pipeline.data.masking.num_visible`)."""
    n, d = num_patches or config.num_patches, config.embed_dim
    dd = mae.decoder_dim
    dm = mae.decoder_mlp_dim or 4 * dd
    macs = {
        "encoder_patch_embed": num_visible * config.patch_dim * d,
        "encoder_blocks": config.depth * _block_macs(1 + num_visible, d, config.mlp_dim),
        "decoder_embed": (1 + num_visible) * d * dd,
        "decoder_blocks": mae.decoder_depth * _block_macs(1 + n, dd, dm),
        "decoder_pred": n * dd * config.patch_dim,
    }
    return {part: 2 * v for part, v in macs.items()}


def count_mae_flops(
    config: ViTConfig, mae: MAEConfig, num_visible: int, num_patches: int | None = None
) -> int:
    """Forward FLOPs of one image under masked autoencoding (2 x multiply-adds); a training step is 3x.
    ``num_patches``: an image of that many patches (native-aspect input)."""
    return sum(mae_flops_breakdown(config, mae, num_visible, num_patches).values())
