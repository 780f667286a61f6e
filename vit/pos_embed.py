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


# The cubic convolution kernel's parameter in PyTorch's bicubic upsampling (and OpenCV's); Keys' is -0.5.
_CUBIC_A = -0.75


def _cubic_taps(
    position: torch.Tensor, out_size: torch.Tensor, in_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where output ``position`` of an axis resampled from ``in_size`` to ``out_size`` (tensors of one
    shape) reads its input: the 4 source indices ``(..., 4)``, clamped to the axis, and their weights
    ``(..., 4)``. The arithmetic of ``F.interpolate(mode="bicubic", align_corners=False)``, in float32
    as its kernels compute it: source ``in/out * (i + 0.5) - 0.5``, Keys' cubic with a = -0.75."""
    scale = float(in_size) / out_size.float()
    real = scale * (position.float() + 0.5) - 0.5
    base = torch.minimum(real.floor(), torch.full_like(real, in_size - 1))
    t = (real - base).clamp(0.0, 1.0)
    a = _CUBIC_A

    def near(x: torch.Tensor) -> torch.Tensor:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = torch.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], dim=-1)  # (..., 4)
    offsets = torch.arange(-1, 3, device=position.device)
    index = (base.long().unsqueeze(-1) + offsets).clamp(0, in_size - 1)  # (..., 4)
    return index, weights


def sample_pos_embed(
    grid_embed: torch.Tensor, old_grid: tuple[int, int], coords: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """Each token's position embedding on its own image's grid: ``grid_embed`` ``(gh*gw, D)`` (the patch
    rows of a ``pos_embed``, on ``old_grid``) resampled to image b's grid ``grid[b]`` = (GH, GW) and read
    at ``coords[b, t]`` = (row, col) -> ``(B, T, D)``, in ``grid_embed``'s dtype.

    The same function as `resample_pos_embed` (bicubic, [CLS] aside) evaluated at the tokens' places,
    up to float32 rounding; on ``old_grid`` itself each token gets its row exactly. No host sync and no
    loop over the batch's grids: each token's 4 x 4 taps and weights become one row of a matrix
    ``(B, T, gh*gw)``, and one float32 matmul with the grid gives every embedding (its backward is the
    transposed matmul: no scattered accumulation). ``grid`` below 1 reads as 1.
    """
    gh, gw = old_grid
    sizes = grid.long().clamp(min=1)  # (B, 2)
    rows, cols = coords[..., 0].long(), coords[..., 1].long()  # (B, T) each
    row_index, row_weights = _cubic_taps(rows, sizes[:, :1].expand_as(rows), gh)  # (B, T, 4) each
    col_index, col_weights = _cubic_taps(cols, sizes[:, 1:].expand_as(cols), gw)
    index = (row_index.unsqueeze(-1) * gw + col_index.unsqueeze(-2)).flatten(-2)  # (B, T, 16)
    weights = (row_weights.unsqueeze(-1) * col_weights.unsqueeze(-2)).flatten(-2)  # (B, T, 16)
    # Taps clamped at the border land on one cell: their weights add up, as the kernel's reads do.
    taps = torch.zeros(*index.shape[:-1], gh * gw, device=weights.device).scatter_add_(-1, index, weights)
    return (taps @ grid_embed.float()).to(grid_embed.dtype)  # (B, T, gh*gw) @ (gh*gw, D)
