"""Forward FLOPs of a ViT, counted from its config (for MFU and for sizing runs).

FLOPs = 2 x multiply-adds of the matrix products: patch embedding, QKV, attention scores
(Q K^T), attention-weighted sum (A V), output projection, MLP, head. Normalization, softmax, GELU
and bias adds are left out: they are O(T D) per block against O(T D^2) for the products, and MFU
convention counts matmul FLOPs only. With T = 1 + N tokens, width D, MLP width M, one block is

    2 * (T D 3D  +  T^2 D  +  T^2 D  +  T D^2  +  2 T D M)

This reproduces the ViT papers' figures: 35.2 / 123.2 / 334.8 GFLOPs for B/16, L/16, H/14 at 224.
A training step (forward + backward) costs 3x the forward; recomputation under activation
checkpointing is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from vit.config import ViTConfig


def flops_breakdown(config: ViTConfig) -> dict[str, int]:
    """Forward FLOPs per image, by part (all blocks summed)."""
    n, d, m = config.num_patches, config.embed_dim, config.mlp_dim
    t = 1 + n
    blocks = config.depth
    head = 0
    if config.head == "pretrain":
        head += d * config.pre_logits_dim
    head += config.pre_logits_dim * config.num_classes
    macs = {
        "patch_embed": n * config.patch_dim * d,
        "qkv": blocks * t * d * 3 * d,
        "attention_scores": blocks * t * t * d,  # Q K^T over all heads
        "attention_values": blocks * t * t * d,  # softmax(Q K^T) V
        "attention_proj": blocks * t * d * d,
        "mlp": blocks * 2 * t * d * m,
        "head": head,
    }
    return {part: 2 * v for part, v in macs.items()}


def count_flops(config: ViTConfig) -> int:
    """Forward FLOPs for one image (2 x multiply-adds)."""
    return sum(flops_breakdown(config).values())
