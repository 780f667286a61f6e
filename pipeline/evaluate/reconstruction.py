"""What a masked autoencoder sees and says: original, masked input and reconstruction of a few images.

The analyze job draws it when ``--weights`` come from an MAE run (``objective: mae`` in the
checkpoint's ``config.json``): the decoder serves pretraining only and ``final/`` holds the encoder
alone, so the whole autoencoder is read from the run's latest complete checkpoint, through
`pipeline.dcp.load_module_state` (model entries only, nothing unpickled but checkpoint metadata).
Where there is none (an export copied without its run), the figure is skipped with a note.

The masks are drawn as in training (`pipeline.data.masking.mask_batch`, epoch 0, the run's seed and
mask ratio), on the evaluation crop of each image.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import torch

import vit
from pipeline import dcp, storage
from pipeline.data.config import DataConfig
from pipeline.data.masking import mask_batch
from vit.mae import MaskedAutoencoder, reconstruction, unshuffle

MAE_PNG = "mae_reconstruction.png"
MAX_IMAGES = 6
MASKED_GRAY = 128  # how a hidden patch is drawn in the masked input


def find_mae_checkpoint(weights: storage.Location | str) -> storage.Location | None:
    """The checkpoint holding an MAE's decoder for ``weights`` (a checkpoint dir, a run dir, or a run's
    ``final/``): that checkpoint, else the latest complete one of the run; None if it is no MAE run's."""
    weights = storage.as_location(weights)
    url = weights.url.rstrip("/")
    places = [weights.at(url)]
    if url.rsplit("/", 1)[-1] == "final":  # an export inside its run directory
        places.append(weights.at(url.rsplit("/", 1)[0]))
    for where in places:
        found = where if dcp.is_complete(where) else dcp.latest_complete(where)
        if found is None:
            continue
        saved = json.loads(storage.read_text(found.join(dcp.CONFIG)))
        if saved.get("objective") == "mae" and "mae" in saved:
            return found
    return None


def load_mae(checkpoint: storage.Location | str) -> tuple[MaskedAutoencoder, dict[str, Any]]:
    """The whole autoencoder of an MAE checkpoint on CPU, and the checkpoint's ``config.json``."""
    checkpoint = storage.as_location(checkpoint)
    saved = json.loads(storage.read_text(checkpoint.join(dcp.CONFIG)))
    model = MaskedAutoencoder(
        vit.ViTConfig.from_dict(saved["model_config"]), vit.MAEConfig.from_dict(saved["mae"])
    )
    model.load_state_dict(dcp.load_module_state(checkpoint, model))
    return model.eval().requires_grad_(False), saved


@torch.no_grad()
def reconstruct(
    model: MaskedAutoencoder, patches: np.ndarray, data_config: DataConfig, mask_ratio: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 patches ``(B, N, K)`` -> (original, masked input, reconstruction), each images ``(B, H, W, C)``."""
    b = len(patches)
    rows = {
        "key": np.array([f"image-{i}" for i in range(b)], dtype=object),
        "url": np.array(["analyze"] * b, dtype=object),
        "patches": patches,
        "label": np.full(b, -1, np.int64),
        "error": np.array([""] * b, dtype=object),
    }
    drawn = mask_batch(rows, config=dataclasses.replace(data_config, mask_ratio=mask_ratio), epoch=0)
    visible, masked, ids = (
        torch.from_numpy(np.ascontiguousarray(drawn[c])) for c in ("visible", "masked", "ids_shuffle")
    )
    c = model.encoder.config
    pred = model.predict(visible, ids)  # (B, N, K), shuffled order
    filled = reconstruction(
        pred, visible, masked, ids, c.mean, c.std, norm_pix_loss=model.config.norm_pix_loss
    )
    hidden = torch.full_like(masked, MASKED_GRAY)
    shown = unshuffle(torch.cat([visible, hidden], dim=1), ids)  # (B, N, K), grid order

    def images(x: np.ndarray) -> np.ndarray:
        return vit.unpatchify(x, c.patch_size, (c.grid_size, c.grid_size), c.num_channels)

    return images(patches), images(shown.numpy()), images(filled.numpy())


def plot_reconstructions(
    original: np.ndarray, masked: np.ndarray, rebuilt: np.ndarray, path: str, *, mask_ratio: float
) -> str:
    """One row per image: original | masked input | reconstruction (visible patches kept)."""
    from matplotlib.figure import Figure

    rows = len(original)
    fig = Figure(figsize=(6.0, 2.0 * rows + 0.6), dpi=120)
    axes = fig.subplots(rows, 3, squeeze=False)
    titles = ("original", f"masked input ({100 * mask_ratio:.0f}% hidden)", "reconstruction")
    for r in range(rows):
        for col, image in enumerate((original[r], masked[r], rebuilt[r])):
            ax = axes[r, col]
            ax.imshow(
                image[..., 0] if image.shape[-1] == 1 else image,
                cmap="gray",
                vmin=0,
                vmax=255,
                interpolation="nearest",
            )
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(titles[col], fontsize=8)
    fig.suptitle("Masked autoencoder: hidden patches predicted by the decoder", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def mae_figure(
    weights: storage.Location | str, patches: np.ndarray, data_config: DataConfig, path: str
) -> dict[str, Any] | None:
    """Draw `MAE_PNG` at ``path`` when ``weights`` come from an MAE run; what analysis.json records of
    it, ``{"skipped": why}`` when the run's checkpoint is missing, None for other weights."""
    checkpoint = find_mae_checkpoint(weights)
    if checkpoint is None:
        return None
    model, saved = load_mae(checkpoint)
    if model.encoder.config.image_size != data_config.image_size:
        return {"skipped": "the checkpoint's image size differs from the analyzed images'"}
    ratio = float(saved.get("mask_ratio", 0.75))
    shown = patches[:MAX_IMAGES]
    plot_reconstructions(*reconstruct(model, shown, data_config, ratio), path, mask_ratio=ratio)
    return {"checkpoint": checkpoint.url, "images": len(shown), "mask_ratio": ratio}
