"""Stand-in rows of native-aspect images, for the tests whose fake data stages stand in for Ray Data:
`as_native` turns a batch of square stand-in rows into the rows `pipeline.data.decode.preprocess_batch`
makes with ``patches="native"`` (each key its own grid, a pure function of the key), and masks them as
`pipeline.data.masking.mask_batch` does where the config asks."""

from __future__ import annotations

import zlib

import numpy as np

from pipeline.data import native
from pipeline.data.config import DataConfig
from pipeline.data.masking import mask_batch

# Aspect ratios (width, height) of the stand-in images: wide, tall, square, a strip.
SHAPES = ((3, 1), (1, 2), (1, 1), (4, 3), (2, 5), (6, 1))


def grid_of(key: str, config: DataConfig) -> tuple[int, int]:
    width, height = SHAPES[zlib.crc32(key.encode()) % len(SHAPES)]
    return native.native_grid(100 * width, 100 * height, config.patch_budget)


def as_native(batch: dict[str, np.ndarray], config: DataConfig, epoch: int = 0) -> dict[str, np.ndarray]:
    """Square stand-in rows -> native ones of the same keys (the pixels a function of the key's first
    patches), masked for MAE where ``config.mask_ratio`` says."""
    p = config.patch_size
    images = []
    for i, key in enumerate(batch["key"].tolist()):
        gh, gw = grid_of(key, config)
        seed = zlib.crc32(f"{key}/{epoch}".encode())
        images.append(np.random.default_rng(seed).integers(0, 256, (gh * p, gw * p, 3), dtype=np.uint8))
        if batch["error"][i]:
            images[-1] = None
    rows = {name: column for name, column in batch.items() if name != "patches"}
    rows.update(native.native_rows(images, p, config.patch_budget))
    return mask_batch(rows, config=config, epoch=epoch) if config.mask_ratio is not None else rows
