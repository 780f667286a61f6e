"""The three panels of the paper's Fig. 7 as PNG files a person reads: titles, labelled axes, colour bars.

Drawn on matplotlib `Figure` objects (no pyplot, so no display and no global state); matplotlib is the
``plot`` extra of vitray and is imported on first use.
"""

from __future__ import annotations

import math

import numpy as np

TILES_PER_ROW = 7  # 28 components as 4 rows of 7, as in the paper


def check_matplotlib() -> None:
    """A one-line ValueError, before any work, where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ValueError("the figures need matplotlib: pip install 'vitray[plot]' (or matplotlib)") from e


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=120)


def plot_patch_filters(components: np.ndarray, variance: np.ndarray, path: str) -> str:
    """Principal components ``(K, P, P, C)`` as image tiles, each stretched to its own min..max."""
    k, p, _, c = components.shape
    rows = math.ceil(k / TILES_PER_ROW)
    cols = min(k, TILES_PER_ROW)
    fig = _figure(1.3 * cols + 0.4, 1.45 * rows + 0.9)
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i >= k:
            continue
        tile = components[i]
        lo, hi = tile.min(), tile.max()
        tile = (tile - lo) / (hi - lo) if hi > lo else np.zeros_like(tile)
        ax.imshow(tile[..., 0] if c == 1 else tile, cmap="gray" if c == 1 else None, interpolation="nearest")
        ax.set_title(f"PC {i + 1}  {100 * variance[i]:.1f}%", fontsize=7)
    kind = "RGB embedding filters" if c == 3 else "Embedding filters"
    fig.suptitle(
        f"{kind}: first {k} principal components ({p}x{p} px patches)\n"
        "each tile scaled to its own range; % = share of the filters' variance",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    return path


def _tick_positions(count: int, step: int) -> tuple[list[float], list[str]]:
    every = max(1, math.ceil(count / 12))  # at most about a dozen labels per axis
    picks = list(range(0, count, every))
    return [i * step + (step - 2) / 2 for i in picks], [str(i + 1) for i in picks]


def plot_position_similarity(similarity: np.ndarray, path: str) -> str:
    """``(gh, gw, gh, gw)`` cosine similarities as a grid of grids: the tile at (row r, column c) shows
    the similarity of patch (r, c)'s position embedding with every patch's."""
    gh, gw = similarity.shape[:2]
    step_r, step_c = gh + 1, gw + 1  # one blank pixel between tiles
    mosaic = np.full((gh * step_r - 1, gw * step_c - 1), np.nan)
    for r in range(gh):
        for c in range(gw):
            mosaic[r * step_r : r * step_r + gh, c * step_c : c * step_c + gw] = similarity[r, c]
    fig = _figure(6.4, 5.6)
    ax = fig.add_subplot()
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    image = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    ticks, labels = _tick_positions(gw, step_c)
    ax.set_xticks(ticks, labels, fontsize=7)
    ticks, labels = _tick_positions(gh, step_r)
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    ax.set_title(f"Position embedding similarity ({gh}x{gw} patches)", fontsize=10)
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    bar.set_label("Cosine similarity")
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_attention_distance(
    distances: np.ndarray, path: str, *, image_size: int, uniform: float, images: int
) -> str:
    """Mean attention distance ``(depth, H)`` in pixels: one dot per head at each layer, coloured by
    head, the mean over heads as a line, and the distance of uniform attention for reference."""
    import matplotlib

    depth, heads = distances.shape
    fig = _figure(6.4, 4.4)
    ax = fig.add_subplot()
    layers = np.arange(1, depth + 1)
    cmap = matplotlib.colormaps["turbo"].resampled(heads)
    jitter = (np.arange(heads) - (heads - 1) / 2) * min(0.3 / max(heads, 1), 0.04)
    for h in range(heads):
        ax.scatter(layers + jitter[h], distances[:, h], s=18, color=cmap(h), edgecolors="none")
    ax.plot(layers, distances.mean(axis=1), color="black", linewidth=1, label="mean over heads")
    ax.axhline(
        uniform, color="gray", linestyle="--", linewidth=1, label=f"uniform attention ({uniform:.1f} px)"
    )
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xticks(layers if depth <= 16 else layers[:: math.ceil(depth / 16)])
    ax.set_ylim(0, max(float(distances.max()), uniform) * 1.1 + 1e-9)
    ax.set_title(f"Mean attention distance per head ({images} images, {image_size} px)", fontsize=10)
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(alpha=0.3)
    norm = matplotlib.colors.BoundaryNorm(np.arange(heads + 1) + 0.5, heads)
    bar = fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.02)
    bar.set_label("Head")
    bar.set_ticks(np.arange(1, heads + 1) if heads <= 16 else np.arange(1, heads + 1, math.ceil(heads / 16)))
    fig.tight_layout()
    fig.savefig(path)
    return path
