"""scikit-learn's handwritten digits as a second small real image set (1,797 8x8 images, 10 classes).

The images ship inside scikit-learn (`sklearn.datasets.load_digits`, from the UCI optical recognition
set; nothing is downloaded). Pixels of 0-16 become 0-255 and each image is upscaled to 32x32 (bicubic),
a size the `small` preset trains at. Split: per class, the first 80% train and the rest test (1,438
and 359 images), each shuffled with a fixed seed; packed as `jobs.benchmarks.fashion_mnist` packs its
images (PNG with a ``.cls`` label, webdataset's own writer).
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image

SIZE = 32
TRAIN_SHARE = 0.8


def load_images() -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (1797, 32, 32), labels int64)``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = np.clip(np.rint(digits.images * (255 / 16)), 0, 255).astype(np.uint8)  # (n, 8, 8)
    images = np.stack(
        [
            np.asarray(Image.fromarray(x, mode="L").resize((SIZE, SIZE), Image.Resampling.BICUBIC))
            for x in small
        ]
    )
    return images, digits.target.astype(np.int64)


def split(labels: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the training and the test set: per class the first 80% and the rest, shuffled."""
    train, test = [], []
    for label in np.unique(labels):
        where = np.flatnonzero(labels == label)
        cut = round(TRAIN_SHARE * len(where))
        train.extend(where[:cut].tolist())
        test.extend(where[cut:].tolist())
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(test)
    return np.asarray(train), np.asarray(test)
