"""Mixup (Zhang et al. 2018), CutMix (Yun et al. 2019) and label smoothing: the soft targets of the
supervised loss, as DeiT (Touvron et al. 2021) and "How to train your ViT" (Steiner et al. 2021) train.

    micro-batch: uint8 patches (B, N, P*P*C), labels (B,); its draw seed (`mix_seed`)
      -> `draw`: mixed or not (mix_prob), Mixup or CutMix (switch_prob), lambda ~ Beta(alpha, alpha),
         CutMix's box
      -> `mix_patches`: sample i mixed with sample B-1-i (the batch reversed, timm's batch mode):
         Mixup blends the pixels (rounded: patches stay uint8), CutMix pastes the partner's box
      -> `soft_targets`: lam * y_i + (1 - lam) * y_(B-1-i), each y one-hot smoothed (1 - eps + eps / C
         on the label, eps / C on every other class)

One draw per micro-batch, a pure function of (seed, step, rank, micro-batch): a resumed run draws what
a straight run drew. The draws are a few host scalars from a numpy Generator seeded by a hash of those
four (never a global RNG); the pixels are mixed on the device, where the micro-batch already is, so
the step waits for nothing.

CutMix's box is drawn on the pixels of the image the patches tile (the grid of `vit.unpatchify`): a
pixel mask in the patch layout picks what is pasted, so a patch on the box's edge holds both images,
as when images are mixed before they are patchified. lambda is then the share of pixels outside the
box, after the image's border has cut the box (timm's ``correct_lam``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import vit
from pipeline.train.sections import TaskConfig


@dataclass(frozen=True)
class Mix:
    """One micro-batch's draw: ``lam``, the weight of each sample's own image and label (1: unmixed),
    and for CutMix the pasted box ``(top, bottom, left, right)`` in pixels, half-open."""

    lam: float = 1.0
    box: tuple[int, int, int, int] | None = None


def mix_seed(seed: int, step: int, rank: int, micro_batch: int) -> int:
    """The seed of one micro-batch's draw: a 64-bit pure function of its arguments."""
    text = f"mix\0{seed}\0{step}\0{rank}\0{micro_batch}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def draw(task: TaskConfig, image_size: int, seed: int) -> Mix:
    """Whether and how a micro-batch is mixed, from ``seed`` alone (`mix_seed`)."""
    rng = np.random.default_rng(seed)
    apply, switch = rng.random(2)
    if apply >= task.mix_prob or not (task.mixup_alpha > 0 or task.cutmix_alpha > 0):
        return Mix()
    cutmix = task.cutmix_alpha > 0 and (task.mixup_alpha == 0 or switch < task.switch_prob)
    alpha = task.cutmix_alpha if cutmix else task.mixup_alpha
    lam = float(rng.beta(alpha, alpha))
    if not cutmix:
        return Mix(lam)
    # A square box of (1 - lam) of the area, centred anywhere in the image, cut by its border.
    side = int(image_size * math.sqrt(1.0 - lam))
    cy, cx = (int(c) for c in rng.integers(0, image_size, size=2))
    top, bottom = max(cy - side // 2, 0), min(cy + (side + 1) // 2, image_size)
    left, right = max(cx - side // 2, 0), min(cx + (side + 1) // 2, image_size)
    area = (bottom - top) * (right - left)
    if area == 0:
        return Mix()
    return Mix(1.0 - area / image_size**2, (top, bottom, left, right))


def cutmix_mask(
    box: tuple[int, int, int, int], config: vit.ViTConfig, device: torch.device | str | None = None
) -> torch.Tensor:
    """The pixels of ``box`` in the patch layout: bool ``(N, P*P*C)``, True where the partner is pasted."""
    top, bottom, left, right = box
    pixels = torch.zeros(
        config.image_size, config.image_size, config.num_channels, dtype=torch.bool, device=device
    )
    pixels[top:bottom, left:right] = True  # (H, W, C)
    return vit.patchify(pixels, config.patch_size)  # (N, P*P*C)


def mix_patches(patches: torch.Tensor, mix: Mix, config: vit.ViTConfig) -> torch.Tensor:
    """uint8 patches ``(B, N, P*P*C)`` mixed with the batch reversed -> uint8, the same shape (the input
    itself when unmixed)."""
    partner = patches.flip(0)  # sample i's partner is sample B-1-i
    if mix.box is not None:
        return torch.where(cutmix_mask(mix.box, config, patches.device), partner, patches)
    if mix.lam == 1.0:
        return patches
    # A convex blend of values in [0, 255] stays there; rounded back to the pipeline's uint8.
    blend = patches.float().mul_(mix.lam).add_(partner.float(), alpha=1.0 - mix.lam)
    return blend.round_().clamp_(0, 255).to(torch.uint8)


def soft_targets(labels: torch.Tensor, num_classes: int, lam: float, smoothing: float) -> torch.Tensor:
    """Labels ``(B,)`` -> float32 targets ``(B, C)``: lam * y_i + (1 - lam) * y_(B-1-i), each y smoothed."""
    y = F.one_hot(labels, num_classes).float() * (1.0 - smoothing) + smoothing / num_classes
    return y if lam == 1.0 else y * lam + y.flip(0) * (1.0 - lam)


class Mixer:
    """A supervised run's Mixup/CutMix: ``(patches, labels, seed) -> (mixed patches, soft targets)``."""

    def __init__(self, task: TaskConfig, config: vit.ViTConfig):
        self.task, self.config = task, config

    @staticmethod
    def wanted(task: TaskConfig) -> bool:
        return task.mix_prob > 0 and (task.mixup_alpha > 0 or task.cutmix_alpha > 0)

    def __call__(
        self, patches: torch.Tensor, labels: torch.Tensor, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mix = draw(self.task, self.config.image_size, seed)
        targets = soft_targets(labels, self.config.num_classes, mix.lam, self.task.label_smoothing)
        return mix_patches(patches, mix, self.config), targets
