"""Photo-like benchmark shards: what the data and embedding benchmarks read.

JPEGs of about 500x375 (the ImageNet median), each a random crop, scale, flip and color shift of
matplotlib's sample photo with a little noise, re-encoded at quality 90, so decoding costs what a
real photo's does. `make_mixed_aspect_shards`: the same photos at the aspect ratios of `ASPECTS` (web
photos, screens, documents, panoramas), each of about as many pixels.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

SHORT, LONG = 375, 500  # benchmark photo size: the ImageNet median is about 500x375
# Aspect ratios (width:height) of `make_mixed_aspect_shards`, each with its share of the images.
ASPECTS = {
    "4:3": 0.35,
    "3:4": 0.15,
    "16:9": 0.15,
    "1:1": 0.10,
    "3:2": 0.10,
    "2:3": 0.05,
    "21:9": 0.05,
    "9:21": 0.05,
}


def make_photo_shards(
    out_dir: Path, images: int, per_shard: int, seed: int = 0, aspects: dict[str, float] | None = None
) -> list[str]:
    """Photo-like JPEG shards (``.jpg`` + ``.cls``), reused when already there; ``aspects``: drawn at
    these aspect ratios (width:height -> share), each of about LONG x SHORT pixels, instead of LONG x SHORT
    (three in four) and SHORT x LONG."""
    import matplotlib
    from PIL import Image, ImageEnhance

    from pipeline.data.writing import write_shards

    existing = sorted(out_dir.glob("bench-*.tar"))
    if len(existing) == -(-images // per_shard):
        return [str(p) for p in existing]
    photo = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB")
    rng = np.random.default_rng(seed)

    names = list(aspects or {})
    shares = np.array([aspects[n] for n in names]) / sum(aspects.values()) if aspects else None

    def size() -> tuple[int, int]:
        if aspects is None:
            return (LONG, SHORT) if rng.random() < 0.75 else (SHORT, LONG)
        width, height = (int(x) for x in names[rng.choice(len(names), p=shares)].split(":"))
        scale = (LONG * SHORT / (width * height)) ** 0.5
        return round(width * scale), round(height * scale)

    def samples():
        for i in range(images):
            w, h = size()
            side = rng.uniform(0.45, 1.0)
            cw = min(photo.width, round(photo.width * side))
            ch = min(photo.height, round(cw * h / w))
            left, top = rng.integers(0, photo.width - cw + 1), rng.integers(0, photo.height - ch + 1)
            im = photo.resize((w, h), Image.Resampling.BICUBIC, box=(left, top, left + cw, top + ch))
            if rng.random() < 0.5:
                im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            im = ImageEnhance.Color(im).enhance(rng.uniform(0.3, 1.7))
            im = ImageEnhance.Brightness(im).enhance(rng.uniform(0.7, 1.3))
            noisy = np.asarray(im, np.int16) + rng.integers(-6, 7, size=(h, w, 3), dtype=np.int16)
            out = io.BytesIO()
            Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
            yield f"{i:08d}", {"jpg": out.getvalue(), "cls": str(i % 1000).encode()}

    return write_shards(samples(), out_dir, prefix="bench", samples_per_shard=per_shard)


def make_mixed_aspect_shards(out_dir: Path, images: int, per_shard: int, seed: int = 0) -> list[str]:
    """`make_photo_shards` at the aspect ratios of `ASPECTS`."""
    return make_photo_shards(out_dir, images, per_shard, seed, aspects=ASPECTS)
