"""Position-embedding resampling: use a ViT at another resolution or patch grid than it was trained on.

The [CLS] embedding is kept; the patch embeddings, laid out on their 2D grid, are interpolated to
the new grid. Bicubic, not bilinear: it keeps the embeddings smooth across the old grid cells
(bilinear makes them piecewise linear, with kinks at every old cell), and it is what timm and
transformers use by default, so a converted model resamples as it would in its source library.
(The original ViT code used a first-order spline, i.e. bilinear; the two differ little in accuracy.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def square_grid(num_patches: int) -> tuple[int, int]:
    """The (gh, gw) of a square grid of `num_patches`; a one-line error if there is none."""
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(
            f"{num_patches} patch position embeddings do not form a square grid; "
            "pass old_grid=(gh, gw) to resample_pos_embed"
        )
    return side, side


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: int | tuple[int, int],
    old_grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Position embeddings ``(T, D)`` or ``(1, T, D)`` -> ``(1+GH*GW, D)`` (same rank as given).

    ``T = num_prefix_tokens + gh*gw``; the prefix ([CLS]) rows are kept as they are, the grid rows
    are interpolated bicubically from ``old_grid`` (square when not given) to ``new_grid``.
    Resampling to the grid it already has returns the input unchanged.
    """
    batched = pos_embed.dim() == 3
    x = pos_embed[0] if batched else pos_embed  # (T, D)
    gh_new, gw_new = (new_grid, new_grid) if isinstance(new_grid, int) else tuple(new_grid)
    prefix, grid = x[:num_prefix_tokens], x[num_prefix_tokens:]  # (1, D), (gh*gw, D)
    gh, gw = old_grid if old_grid is not None else square_grid(grid.shape[0])
    if gh * gw != grid.shape[0]:
        raise ValueError(f"old_grid {gh}x{gw} does not hold {grid.shape[0]} patch position embeddings")
    if (gh, gw) == (gh_new, gw_new):
        return pos_embed
    dim = grid.shape[-1]
    grid = grid.reshape(1, gh, gw, dim).permute(0, 3, 1, 2)  # (1, D, gh, gw)
    # Interpolate in float32: bicubic is not implemented for every low-precision dtype and device.
    grid = F.interpolate(grid.float(), size=(gh_new, gw_new), mode="bicubic", align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(gh_new * gw_new, dim).to(x.dtype)  # (GH*GW, D)
    out = torch.cat([prefix, grid], dim=0)  # (1 + GH*GW, D)
    return out.unsqueeze(0) if batched else out
