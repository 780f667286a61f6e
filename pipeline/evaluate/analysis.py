"""What the embedding layers learned (the paper's Fig. 7, left and center), from the weights alone.

- `patch_filter_components`: the principal components of the patch-embedding filters. Each of the D
  rows of ``patch_embed.proj.weight`` ``(D, P*P*C)`` is a filter over one patch in the layout of
  `vit.patchify` (pixels row-major, channels innermost), so a component reshapes to a ``(P, P, C)``
  image. The paper shows the first 28: they look like plausible basis functions of a patch's texture.
- `position_similarity`: the cosine similarity between the position embedding of every patch and
  every other ``(gh, gw, gh, gw)``; a trained model's show its 2D grid (near patches alike, and
  row / column structure) although the embeddings are 1D.
- `similarity_by_neighbourhood`: that similarity summed up, adjacent against distant patches.
"""

from __future__ import annotations

import numpy as np


def patch_filter_components(
    weight: np.ndarray, patch_size: int, channels: int, count: int = 28
) -> tuple[np.ndarray, np.ndarray]:
    """Filters ``(D, P*P*C)`` -> their first ``count`` principal components ``(K, P, P, C)`` and the
    share of the filters' variance each explains ``(K,)``; ``K = min(count, D, P*P*C)``.

    A component's sign is arbitrary; it is fixed here so that its largest-magnitude pixel is positive,
    which makes the figure the same from run to run."""
    w = np.asarray(weight, dtype=np.float64)
    if w.shape[1] != patch_size * patch_size * channels:
        raise ValueError(
            f"patch-embedding weight has {w.shape[1]} inputs, not {patch_size}x{patch_size}x{channels}"
        )
    centered = w - w.mean(axis=0)  # (D, P*P*C): filters around their mean
    _, singular, vt = np.linalg.svd(centered, full_matrices=False)  # vt: (min(D, PPC), PPC)
    k = min(count, len(singular))
    components = vt[:k]
    peak = components[np.arange(k), np.argmax(np.abs(components), axis=1)]
    components = components * np.where(peak < 0, -1.0, 1.0)[:, None]
    variance = singular**2
    share = variance[:k] / variance.sum() if variance.sum() > 0 else np.zeros(k)
    return components.reshape(k, patch_size, patch_size, channels), share


def position_similarity(pos_embed: np.ndarray, grid: tuple[int, int], num_prefix: int = 1) -> np.ndarray:
    """Position embeddings ``(num_prefix + gh*gw, D)`` -> cosine similarities ``(gh, gw, gh, gw)``:
    ``[r, c]`` is the map of patch (r, c)'s similarity with every patch. The [CLS] row is left out."""
    gh, gw = grid
    p = np.asarray(pos_embed, dtype=np.float64)[num_prefix:]  # (N, D)
    if p.shape[0] != gh * gw:
        raise ValueError(f"{p.shape[0]} patch position embeddings do not fill a {gh}x{gw} grid")
    p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-12)
    return (p @ p.T).reshape(gh, gw, gh, gw)


def grid_distances(grid: tuple[int, int]) -> np.ndarray:
    """Euclidean distances between patch positions, in patches: ``(N, N)``, row-major like the tokens."""
    gh, gw = grid
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    return np.hypot(rows[:, None] - rows[None, :], cols[:, None] - cols[None, :])


def similarity_by_neighbourhood(similarity: np.ndarray) -> dict[str, float | str]:
    """Mean similarity of adjacent patches (the 4-neighbourhood, 1 patch apart) and of distant ones
    (at least half the grid's longer side apart), from `position_similarity`'s ``(gh, gw, gh, gw)``."""
    gh, gw = similarity.shape[:2]
    flat = similarity.reshape(gh * gw, gh * gw)
    distance = grid_distances((gh, gw))
    far = max(gh, gw) / 2
    adjacent = flat[np.isclose(distance, 1.0)]
    distant = flat[distance >= far]
    return {
        "adjacent": float(adjacent.mean()) if adjacent.size else float("nan"),
        "distant": float(distant.mean()) if distant.size else float("nan"),
        "definition": f"adjacent: 1 patch apart (4-neighbours); distant: >= {far:g} patches apart",
    }
