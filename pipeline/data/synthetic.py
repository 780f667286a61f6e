"""A synthetic image-classification dataset whose classes a tiny ViT learns in a short CPU run.

Each class is a shape or texture in its own color family (red circle, green square, blue triangle,
...), drawn at a random position and scale, with jittered color, on a random background with pixel
noise: not trivial (no fixed pixel gives the class away), but learnable to >90% in minutes on CPU.

Content is a pure function of (seed, sample index): the same arguments write the same bytes,
whatever the shard size. Labels cycle through the classes (``index % num_classes``), so every shard
holds every class.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipeline.data.writing import ShardSet, write_shards

# (name, base RGB color, drawing): the color family and the shape both identify the class.
CLASSES: tuple[tuple[str, tuple[int, int, int], str], ...] = (
    ("red circle", (220, 40, 40), "circle"),
    ("green square", (40, 190, 60), "square"),
    ("blue triangle", (50, 80, 230), "triangle"),
    ("yellow ring", (235, 215, 40), "ring"),
    ("magenta cross", (210, 50, 200), "cross"),
    ("cyan stripes", (40, 210, 220), "hstripes"),
    ("orange checker", (245, 140, 30), "checker"),
    ("white diamond", (240, 240, 240), "diamond"),
    ("purple dots", (130, 60, 190), "dots"),
    ("black bars", (20, 20, 20), "vstripes"),
)


def render(
    index: int, *, seed: int = 0, image_size: int = 64, num_classes: int = 10
) -> tuple[np.ndarray, int]:
    """Sample ``index`` as uint8 ``(image_size, image_size, 3)`` pixels and its label."""
    if not 1 <= num_classes <= len(CLASSES):
        raise ValueError(f"num_classes must be between 1 and {len(CLASSES)}, got {num_classes}")
    rng = np.random.default_rng([seed, index])
    label = index % num_classes
    _, base, kind = CLASSES[label]
    size = image_size
    background = tuple(int(c) for c in rng.integers(60, 196, size=3))
    im = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(im)
    color = tuple(int(np.clip(c + rng.integers(-30, 31), 0, 255)) for c in base)
    extent = rng.uniform(0.35, 0.7) * size  # object side, in pixels
    cx, cy = rng.uniform(extent / 2, size - extent / 2, size=2)
    box = (cx - extent / 2, cy - extent / 2, cx + extent / 2, cy + extent / 2)
    _draw(draw, kind, box, color, background)
    noise = rng.normal(0.0, 12.0, size=(size, size, 3))
    pixels = np.clip(np.asarray(im, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return pixels, label


def encode(pixels: np.ndarray, fmt: str = "jpeg", quality: int = 90) -> bytes:
    """uint8 ``(H, W, 3)`` -> JPEG or PNG bytes."""
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG" if fmt == "png" else "JPEG", quality=quality)
    return out.getvalue()


def synthetic_samples(
    num_samples: int,
    *,
    seed: int = 0,
    image_size: int = 64,
    num_classes: int = 10,
    fmt: str = "jpeg",
    quality: int = 90,
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {jpg|png, cls, json})`` for samples 0..num_samples-1; keys are ``"%08d" % index``."""
    ext = "png" if fmt == "png" else "jpg"
    for index in range(num_samples):
        pixels, label = render(index, seed=seed, image_size=image_size, num_classes=num_classes)
        meta = {"label": label, "class": CLASSES[label][0]}
        members = {
            ext: encode(pixels, fmt, quality),
            "cls": str(label).encode(),
            "json": json.dumps(meta).encode(),
        }
        yield f"{index:08d}", members


def write_synthetic_shards(
    out_dir: str | Path,
    num_samples: int,
    *,
    samples_per_shard: int = 128,
    image_size: int = 64,
    num_classes: int = 10,
    seed: int = 0,
    fmt: str = "jpeg",
    quality: int = 90,
    gzip: bool = False,
    prefix: str = "train",
) -> ShardSet:
    """Write a synthetic shard set and describe it (shard paths, keys, labels)."""
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    samples = synthetic_samples(
        num_samples, seed=seed, image_size=image_size, num_classes=num_classes, fmt=fmt, quality=quality
    )
    urls = write_shards(samples, out_dir, prefix=prefix, samples_per_shard=samples_per_shard, gzip=gzip)
    keys = [f"{i:08d}" for i in range(num_samples)]
    return ShardSet(
        dir=str(Path(out_dir).resolve()),
        urls=sorted(str(Path(u).resolve()) for u in urls),
        keys=keys,
        labels={key: i % num_classes for i, key in enumerate(keys)},
        num_classes=num_classes,
        image_size=image_size,
        class_names=[name for name, _, _ in CLASSES[:num_classes]],
    )


def _draw(
    draw: ImageDraw.ImageDraw, kind: str, box: tuple[float, ...], color: tuple, background: tuple
) -> None:
    x0, y0, x1, y1 = box
    cx, cy, w = (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0
    if kind == "circle":
        draw.ellipse(box, fill=color)
    elif kind == "square":
        draw.rectangle(box, fill=color)
    elif kind == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=color)
    elif kind == "ring":
        draw.ellipse(box, outline=color, width=max(2, round(w / 6)))
    elif kind == "cross":
        t = w / 6
        draw.rectangle((x0, cy - t, x1, cy + t), fill=color)
        draw.rectangle((cx - t, y0, cx + t, y1), fill=color)
    elif kind == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=color)
    elif kind in ("hstripes", "vstripes"):
        step = max(2, round(w / 6))
        for i in range(6):
            if kind == "hstripes":
                draw.rectangle((x0, y0 + i * step, x1, y0 + i * step + step / 2), fill=color)
            else:
                draw.rectangle((x0 + i * step, y0, x0 + i * step + step / 2, y1), fill=color)
    elif kind == "checker":
        step = w / 4
        for i in range(4):
            for j in range(4):
                fill = color if (i + j) % 2 == 0 else background
                draw.rectangle(
                    (x0 + i * step, y0 + j * step, x0 + (i + 1) * step, y0 + (j + 1) * step), fill=fill
                )
    elif kind == "dots":
        r = w / 10
        for i in range(3):
            for j in range(3):
                px, py = x0 + (i + 0.5) * w / 3, y0 + (j + 0.5) * w / 3
                draw.ellipse((px - r, py - r, px + r, py + r), fill=color)
    else:
        raise ValueError(f"unknown drawing {kind!r}")
