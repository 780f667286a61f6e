"""Mean attention distance (the paper's Fig. 7, right): how far across the image each head looks.

For one query patch, the distance is the attention-weighted mean of the pixel distances between its
centre and the centres of the patches it attends to; a head's value is the mean over query patches and
images, per layer. Only patch-to-patch attention counts: the [CLS] token has no place in the image, so
each query's weights on the patches are renormalized to sum to one. A head attending only to its own
patch scores 0; uniform attention scores the mean distance between two patches of the grid.

The weights come from `vit.VisionTransformer.attention_maps` (softmax(QK^T/sqrt(d)) of each block,
computed explicitly), the model's public inspection path, so the model file is untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pipeline.evaluate.analysis import grid_distances


def patch_distances(grid: tuple[int, int], pixels_per_patch: float) -> torch.Tensor:
    """Pixel distances between patch centres ``(N, N)`` (float64), tokens row-major over the grid."""
    return torch.from_numpy(grid_distances(grid) * pixels_per_patch)


def mean_attention_distance(
    attention: torch.Tensor, distances: torch.Tensor, num_prefix: int = 1
) -> torch.Tensor:
    """Attention ``(B, H, T, T)`` (``T = num_prefix + N``, rows summing to 1) and distances ``(N, N)``
    -> the mean attention distance of each head ``(H,)``, averaged over the B images and N queries."""
    a = attention[:, :, num_prefix:, num_prefix:].double()  # (B, H, N, N): patch queries -> patch keys
    a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    per_query = (a * distances.to(a.device)).sum(dim=-1)  # (B, H, N)
    return per_query.mean(dim=(0, 2))


@torch.inference_mode()
def attention_distances(
    model: torch.nn.Module, batches: Iterable[torch.Tensor], *, device: torch.device
) -> tuple[np.ndarray, int]:
    """Mean attention distance per layer and head ``(depth, H)`` in pixels over every image of
    ``batches`` (uint8 patches ``(B, N, P*P*C)``), and the number of images seen."""
    config = model.config
    grid = (config.grid_size, config.grid_size)
    distances = patch_distances(grid, config.image_size / config.grid_size).to(device)
    total: torch.Tensor | None = None
    seen = 0
    for x in batches:
        maps = model.attention_maps(x.to(device))  # depth x (B, H, T, T)
        per_layer = torch.stack([mean_attention_distance(m.float(), distances) for m in maps])  # (depth, H)
        weighted = per_layer * len(x)
        total = weighted if total is None else total + weighted
        seen += len(x)
    if total is None:
        raise ValueError("no images to measure attention distances on")
    return (total / seen).cpu().numpy(), seen
