"""The patch layout: the one contract between the data pipeline and the model.

``patches[b, n, k]`` has shape ``(B, N, P*P*C)`` with ``N = (H/P) * (W/P)``. ``n`` walks the patch
grid row-major (top-left first, left to right); ``k`` walks the pixels of one patch row-major with
channels innermost. In einops: ``b (gh p1) (gw p2) c -> b (gh gw) (p1 p2 c)``.

Both functions work on numpy arrays and torch tensors alike (only ``reshape`` and ``swapaxes``),
on any number of leading batch dimensions, so the pipeline (numpy, uint8) and the model (torch,
float) share one definition.
"""

from __future__ import annotations

from typing import TypeVar

Array = TypeVar("Array")  # numpy.ndarray or torch.Tensor


def patchify(images: Array, patch_size: int) -> Array:
    """Channels-last images ``(..., H, W, C)`` -> patches ``(..., N, P*P*C)``.

    ``H`` and ``W`` must be multiples of ``patch_size``.
    """
    *lead, h, w, c = images.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by patch size {p}; pick a size that is")
    gh, gw = h // p, w // p
    x = images.reshape(*lead, gh, p, gw, p, c)  # (..., gh, p1, gw, p2, c)
    x = x.swapaxes(-4, -3)  # (..., gh, gw, p1, p2, c)
    return x.reshape(*lead, gh * gw, p * p * c)


def unpatchify(patches: Array, patch_size: int, grid_size: tuple[int, int], channels: int = 3) -> Array:
    """Patches ``(..., N, P*P*C)`` -> channels-last images ``(..., H, W, C)``; inverse of `patchify`."""
    *lead, n, k = patches.shape
    p, (gh, gw) = patch_size, grid_size
    if n != gh * gw or k != p * p * channels:
        raise ValueError(
            f"patches of shape {tuple(patches.shape)} do not fit a {gh}x{gw} grid of "
            f"{p}x{p}x{channels} patches"
        )
    x = patches.reshape(*lead, gh, gw, p, p, channels)  # (..., gh, gw, p1, p2, c)
    x = x.swapaxes(-4, -3)  # (..., gh, p1, gw, p2, c)
    return x.reshape(*lead, gh * p, gw * p, channels)
