"""Masked autoencoding's mask, as a data stage: which patches each sample's encoder sees.

`mask_batch` maps patch rows ``{key, url, patches, label, error}`` to
``{key, url, visible, masked, ids_shuffle, label, error}``:

    visible      uint8 (B, n, P*P*C)    the encoder's whole input: n = floor(N * (1 - mask_ratio))
    masked       uint8 (B, N - n, P*P*C) the loss's targets, never the encoder's input
    ids_shuffle  int16 (B, N)           a permutation of the grid positions, visible ones first:
                                         visible[b, j] is patch ids_shuffle[b, j], masked[b, j] is
                                         patch ids_shuffle[b, n + j] (int32 past 32,767 patches)

Each sample's permutation comes from `mask_seed`, a pure function of (seed, epoch, shard name, key) kept apart
from the crop's seed, so a sample gets the same mask in the same epoch however tasks are scheduled,
another mask in another epoch, and a change to the crop's draws never moves the mask.

What travels, measured (`bytes_per_sample`): the reconstruction loss needs the masked patches' pixels,
so they travel too, and a masked row carries every pixel of the unmasked row plus ``ids_shuffle``:
at 224 px with 16 px patches, 150,528 bytes of pixels + 392 bytes of indices (+0.26%). uint8 is
already the smallest lossless form of the targets: the per-patch normalization of the loss is computed
from it exactly on the device, and normalizing or quantizing here could only lose precision; a
coarser target (fewer bits, fewer pixels) would change the objective. So masking saves no bytes in
the object store or on the way to the device; what it saves is the encoder's work and activations,
which run over n tokens instead of N (a quarter at the paper's ratio of 0.75). The split into two
columns, rather than all patches plus indices, keeps that contract in the batch itself: the encoder's
input column holds nothing but visible patches.

Native-aspect rows (`pipeline.data.native`): each image's own gh * gw patches are permuted by the same
seed and split by `pipeline.data.native.native_visible`; ``coords`` and ``mask`` take ``ids_shuffle``'s
place (`pipeline.data.native.mask_native`).

Imports no torch, like the rest of `pipeline.data`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pipeline.data.config import DataConfig, sample_seed
from pipeline.data.native import lengths, mask_native
from pipeline.data.shards import shard_name
from vit.patchify import patchify

MASK_COLUMNS = ("visible", "masked", "ids_shuffle")


def num_visible(num_patches: int, mask_ratio: float) -> int:
    """Patches the encoder sees: ``floor(N * (1 - mask_ratio))``, as in the paper (49 of 196 at 0.75)."""
    if not 0 < mask_ratio < 1:
        raise ValueError(
            f"mask_ratio must be strictly between 0 and 1 (the paper's is 0.75), got {mask_ratio}"
        )
    n = math.floor(num_patches * (1 - mask_ratio) + 1e-9)  # 1e-9: 10 * (1 - 0.8) is 1.999... in floats
    if not 0 < n < num_patches:
        raise ValueError(
            f"mask_ratio {mask_ratio} leaves {n} of {num_patches} patches visible; the encoder needs at "
            "least one and the loss at least one masked patch: pick a ratio nearer 0.75"
        )
    return n


def mask_seed(seed: int, epoch: int, name: str, key: str) -> int:
    """The seed of one sample's mask: `sample_seed` over a shard name tagged ``mask:``, apart from the
    crop's."""
    return sample_seed(seed, epoch, f"mask:{name}", key)


def index_dtype(num_patches: int) -> np.dtype:
    """int16 while grid positions fit it (2 bytes per patch), else int32."""
    return np.dtype(np.int16 if num_patches <= np.iinfo(np.int16).max + 1 else np.int32)


def shuffle_ids(num_patches: int, seed: int) -> np.ndarray:
    """A permutation of ``range(num_patches)`` drawn from ``seed`` ``(N,)``; its head is what stays visible."""
    return np.random.default_rng(seed).permutation(num_patches).astype(index_dtype(num_patches))


def mask_batch(
    batch: dict[str, Any], *, config: DataConfig, epoch: int, root: str = ""
) -> dict[str, np.ndarray]:
    """Patch rows -> masked rows (the function Ray fuses into each read task, after decoding); a
    sample's mask is seeded by its shard's name relative to ``root`` (`shards.shard_name`) and its key.

    In: ``key``, ``url``, ``patches`` uint8 ``(B, N, K)``, ``label``, ``error``. Out: the same minus
    ``patches``, plus ``visible`` ``(B, n, K)``, ``masked`` ``(B, N - n, K)``, ``ids_shuffle`` ``(B, N)``.
    Error rows get a mask too (of zero patches), so counts downstream stay exact.
    """
    if config.mask_ratio is None:
        raise ValueError("mask_batch needs DataConfig.mask_ratio (e.g. 0.75); it is None")
    if "grid" in batch:  # native rows: each image's own patches
        seeds = [
            mask_seed(config.seed, epoch, shard_name(u, root), k)
            for u, k in zip(batch["url"], batch["key"], strict=True)
        ]
        ids = [
            shuffle_ids(int(n), seed) if n >= 2 else None
            for n, seed in zip(lengths(batch).tolist(), seeds, strict=True)
        ]  # an error row's grid is (0, 0): no patch, no mask
        return mask_native(batch, ids, config.mask_ratio)
    patches = batch["patches"]  # (B, N, K)
    b, n_patches, _ = patches.shape
    n = num_visible(n_patches, config.mask_ratio)
    ids = np.empty((b, n_patches), dtype=index_dtype(n_patches))  # (B, N)
    for i in range(b):
        ids[i] = shuffle_ids(
            n_patches, mask_seed(config.seed, epoch, shard_name(batch["url"][i], root), batch["key"][i])
        )
    shuffled = np.take_along_axis(patches, ids[:, :, None], axis=1)  # (B, N, K), visible first
    out = {name: column for name, column in batch.items() if name != "patches"}
    # Copies, so neither column keeps the other's pixels alive in the object store.
    out["visible"] = np.ascontiguousarray(shuffled[:, :n])  # (B, n, K)
    out["masked"] = np.ascontiguousarray(shuffled[:, n:])  # (B, N - n, K)
    out["ids_shuffle"] = ids
    return out


def row_bytes(batch: dict[str, np.ndarray]) -> dict[str, int]:
    """Bytes per row of each fixed-width column of a batch (what its block holds per sample)."""
    return {
        name: column.nbytes // len(column)
        for name, column in batch.items()
        if column.dtype != object and len(column)
    }


def bytes_per_sample(config: DataConfig, mask_ratio: float = 0.75) -> dict[str, Any]:
    """Bytes one sample's row carries, without and with masking, measured on the stages' own outputs.

    Returns ``{"unmasked": {column: bytes}, "masked": {column: bytes}, "unmasked_total",
    "masked_total", "encoder_input_unmasked", "encoder_input_masked", "mask_ratio"}``; string columns
    (key, url, error) are the same in both and left out.
    """
    side = config.image_size
    # Pixel values do not change sizes; one synthetic row of the configured shape is enough.
    pixels = np.zeros((1, side, side, 3), np.uint8)
    plain = {
        "key": np.array(["k"], dtype=object),
        "url": np.array(["u"], dtype=object),
        "patches": patchify(pixels, config.patch_size),
        "label": np.zeros(1, np.int64),
        "error": np.array([""], dtype=object),
    }
    masked_config = dataclasses.replace(config, mask_ratio=mask_ratio)
    unmasked, masked = row_bytes(plain), row_bytes(mask_batch(plain, config=masked_config, epoch=0))
    return {
        "mask_ratio": mask_ratio,
        "unmasked": unmasked,
        "masked": masked,
        "unmasked_total": sum(unmasked.values()),
        "masked_total": sum(masked.values()),
        "encoder_input_unmasked": unmasked["patches"],
        "encoder_input_masked": masked["visible"],
    }
