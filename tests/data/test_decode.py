"""Decode, crop math and patchify, and every kind of bad image, without Ray."""

from __future__ import annotations

import io
import random
import struct
import zlib
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from PIL import Image, ImageFile

from pipeline.data.config import DataConfig
from pipeline.data.decode import (
    ImageError,
    crop_resize,
    draft_factor,
    eval_crop_box,
    open_image,
    preprocess_batch,
    sample_seed,
    train_crop_box,
    transform_image,
)
from vit.patchify import unpatchify

PHOTO = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"  # 512x600 RGB JPEG


def encode(pixels: np.ndarray | Image.Image, fmt: str = "PNG", **kw) -> bytes:
    im = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    out = io.BytesIO()
    im.save(out, format=fmt, **kw)
    return out.getvalue()


def quadrants(size: int) -> np.ndarray:
    """Red, green / blue, white quadrants: (size, size, 3) uint8."""
    h = size // 2
    img = np.zeros((size, size, 3), np.uint8)
    img[:h, :h] = (255, 0, 0)
    img[:h, h:] = (0, 255, 0)
    img[h:, :h] = (0, 0, 255)
    img[h:, h:] = (255, 255, 255)
    return img


def batch_of(images: list[bytes], errors: list[str] | None = None) -> dict:
    n = len(images)
    return {
        "key": np.array([f"{i:04d}" for i in range(n)], dtype=object),
        "url": np.array(["/shards/a.tar"] * n, dtype=object),
        "image": np.array([*images, b""], dtype=object)[:n],
        "label": np.arange(n, dtype=np.int64),
        "error": np.array(errors or [""] * n, dtype=object),
    }


def fallback_box(w: int, h: int, ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """The whole image clamped to ``ratio`` and centered: what ten failed tries end in."""
    cw, ch = w, h
    if w / h < ratio[0]:
        ch = min(h, round(w / ratio[0]))
    elif w / h > ratio[1]:
        cw = min(w, round(h * ratio[1]))
    return (w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch


def test_train_crop_box_stays_inside_and_within_scale_and_ratio():
    rng = random.Random(0)
    shares, fallbacks = [], 0
    for _ in range(500):
        w = rng.randint(40, 900)  # aspect within 1/2..2: a sampled crop fits within ten tries
        h = max(20, min(900, round(w * rng.uniform(0.5, 2))))
        box = train_crop_box(w, h, rng, (0.08, 1.0), (3 / 4, 4 / 3))
        left, top, right, bottom = box
        assert 0 <= left < right <= w and 0 <= top < bottom <= h
        cw, ch = right - left, bottom - top
        if box == fallback_box(w, h, (3 / 4, 4 / 3)):
            fallbacks += 1
        elif min(cw, ch) > 10:  # rounding aside, a sampled crop obeys scale and ratio
            assert 0.07 <= cw * ch / (w * h) <= 1.0
            assert 3 / 4 * 0.85 <= cw / ch <= 4 / 3 * 1.15
            shares.append(cw * ch / (w * h))
    # Such images fit a sampled crop within ten tries almost always (none of these 500 falls back):
    # a crop that always or often falls back fails here.
    assert fallbacks <= 5, fallbacks
    assert min(shares) < 0.15 and max(shares) > 0.9 and 0.4 < float(np.mean(shares)) < 0.65  # U(0.08, 1)


def test_train_crop_box_is_a_pure_function_of_the_rng_seed_and_falls_back_to_a_centered_crop():
    boxes = [
        train_crop_box(500, 375, random.Random(sample_seed(1, 2, "u", "k")), (0.08, 1), (0.75, 1.33))
        for _ in "ab"
    ]
    assert boxes[0] == boxes[1]
    # A 1000x10 strip cannot hold a 3/4..4/3 crop of any sampled area: the fallback clamps the aspect.
    assert train_crop_box(1000, 10, random.Random(0), (0.9, 1.0), (3 / 4, 4 / 3)) == (493, 0, 506, 10)


def test_sample_seed_is_stable_across_processes():
    assert sample_seed(0, 0, "u", "k") == 10259092021831906427  # blake2b, not Python's salted hash
    assert sample_seed(0, 1, "u", "k") != sample_seed(0, 0, "u", "k")


def test_eval_box_is_the_centered_short_side_crop_and_draft_keeps_the_crop_large_enough():
    assert eval_crop_box(400, 200, 224, 0.875) == (112.5, 12.5, 287.5, 187.5)
    assert eval_crop_box(100, 100, 32, 1.0) == (0.0, 0.0, 100.0, 100.0)
    assert draft_factor((0, 0, 500, 375), 224) == 1
    assert draft_factor((0, 0, 500, 460), 224) == 2
    assert draft_factor((10, 10, 1900, 1910), 224) == 8
    assert draft_factor((0, 0, 900, 300), 64) == 4  # the short side decides


def test_known_pattern_lands_in_the_right_patches():
    config = DataConfig(image_size=32, patch_size=8, crop_fraction=1.0, require_labels=False)
    out = preprocess_batch(batch_of([encode(quadrants(64))]), config=config, train=False, epoch=0)
    patches = out["patches"][0]  # (16, 192): a 4x4 grid, row-major
    assert patches.shape == (16, 8 * 8 * 3) and patches.dtype == np.uint8
    colors = patches.reshape(16, 64, 3).mean(axis=1).round()  # mean color of each patch
    grid = colors.reshape(4, 4, 3)
    np.testing.assert_allclose(grid[0, 0], (255, 0, 0), atol=1)  # top-left: red
    np.testing.assert_allclose(grid[0, 3], (0, 255, 0), atol=1)  # top-right: green
    np.testing.assert_allclose(grid[3, 0], (0, 0, 255), atol=1)  # bottom-left: blue
    np.testing.assert_allclose(grid[3, 3], (255, 255, 255), atol=1)  # bottom-right: white
    # Channels are innermost inside a patch: pixel 0 of the top-left patch is (R, G, B) = (255, 0, 0).
    assert tuple(patches[0, :3]) == (255, 0, 0)


def test_eval_transform_matches_resize_then_center_crop():
    config = DataConfig(image_size=224, patch_size=16, jpeg_draft=False, require_labels=False)
    data = PHOTO.read_bytes()
    got = transform_image(data, config, train=False, rng=None).astype(np.float32)
    im = Image.open(io.BytesIO(data)).convert("RGB")  # 512 x 600: short side -> 256
    resized = im.resize((256, round(600 * 256 / 512)), Image.Resampling.BICUBIC)
    top = (resized.height - 224) // 2
    reference = np.asarray(resized.crop((16, top, 240, top + 224)), dtype=np.float32)
    assert got.shape == (224, 224, 3)
    assert np.abs(got - reference).mean() < 2.0  # same transform; sub-pixel rounding of the box aside


def test_jpeg_draft_decoding_stays_close_to_a_full_decode():
    data = PHOTO.read_bytes()
    full = DataConfig(image_size=64, patch_size=16, jpeg_draft=False, require_labels=False)
    fast = DataConfig(image_size=64, patch_size=16, jpeg_draft=True, require_labels=False)
    a = transform_image(data, full, train=False, rng=None).astype(np.float32)
    b = transform_image(data, fast, train=False, rng=None).astype(np.float32)
    assert 0 < np.abs(a - b).mean() < 3.0  # drafted (4x DCT reduction) yet nearly the same pixels


@pytest.mark.parametrize(
    "make",
    [
        lambda: encode(Image.open(PHOTO).convert("L"), "JPEG"),
        lambda: encode(Image.open(PHOTO).convert("CMYK"), "JPEG"),
        lambda: encode(Image.open(PHOTO).convert("P"), "PNG"),
        lambda: encode(Image.open(PHOTO).convert("P"), "PNG", transparency=0),
        lambda: encode(Image.open(PHOTO).convert("RGBA"), "PNG"),
        lambda: encode(Image.open(PHOTO).convert("LA"), "PNG"),
        lambda: encode(Image.open(PHOTO), "WEBP"),
        # 16-bit grayscale, built from an array (older Pillow cannot convert RGB to I;16).
        lambda: encode(Image.fromarray(np.asarray(Image.open(PHOTO).convert("L"), np.uint16) * 257), "PNG"),
    ],
    ids=["gray-jpeg", "cmyk-jpeg", "palette", "palette-alpha", "rgba", "gray-alpha", "webp", "16-bit"],
)
def test_every_mode_becomes_rgb(make):
    """The same pixels as PIL's own conversion to RGB followed by the same crop and resize."""
    data = make()
    config = DataConfig(image_size=32, patch_size=8, jpeg_draft=False, require_labels=False)
    pixels = transform_image(data, config, train=False, rng=None)
    reference = Image.open(io.BytesIO(data)).convert("RGB")
    box = eval_crop_box(*reference.size, 32, config.crop_fraction)
    expected = np.asarray(reference.resize((32, 32), Image.Resampling.BICUBIC, box=box))
    assert pixels.shape == (32, 32, 3) and pixels.dtype == np.uint8 and pixels.std() > 0
    assert np.abs(pixels.astype(int) - expected).max() <= 1  # gray is resized before it is widened


def truncated_jpeg(fraction: float, progressive: bool = False) -> bytes:
    data = encode(Image.open(PHOTO), "JPEG", quality=90, progressive=progressive)
    return data[: int(len(data) * fraction)]


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression bomb, without the memory)."""
    data = bytearray(encode(np.zeros((4, 4, 3), np.uint8)))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


@pytest.mark.parametrize(
    ("data", "category"),
    [
        (b"", "empty image"),
        (b"\x00\x01garbage" * 50, "undecodable image"),
        (b"<html>not an image</html>", "undecodable image"),
        (truncated_jpeg(0.5), "truncated image"),
        (truncated_jpeg(0.97), "truncated image"),
        (truncated_jpeg(0.6, progressive=True), "truncated image"),
        (png_claiming(30_000, 30_000), "image too large"),  # 900M pixels: also past PIL's own hard limit
        (png_claiming(5_000, 5_000), "image too large"),  # 25M pixels: over the configured limit only
    ],
    ids=[
        "empty",
        "garbage",
        "html",
        "jpeg-half",
        "jpeg-97pct",
        "progressive-cut",
        "bomb-hard",
        "bomb-config",
    ],
)
def test_bad_images_become_error_rows_and_neighbours_survive(data, category):
    config = DataConfig(image_size=32, patch_size=8, max_image_pixels=20_000_000, require_labels=False)
    good = encode(quadrants(64))
    out = preprocess_batch(batch_of([good, data, good]), config=config, train=True, epoch=0)
    assert [e.split(":")[0] for e in out["error"]] == ["", category, ""]
    assert "\n" not in out["error"][1]
    assert not out["patches"][1].any() and out["patches"][0].any() and out["patches"][2].any()


def test_truncated_images_stay_errors_even_if_someone_set_load_truncated_images():
    ImageFile.LOAD_TRUNCATED_IMAGES = True  # what a library elsewhere in the process might do
    try:
        config = DataConfig(image_size=32, patch_size=8, require_labels=False)
        out = preprocess_batch(batch_of([truncated_jpeg(0.5)]), config=config, train=False, epoch=0)
        assert out["error"][0].startswith("truncated image")
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def test_size_limit_is_checked_from_the_header_before_decoding():
    with pytest.raises(ImageError, match="image too large: 5000x5000"):
        open_image(png_claiming(5_000, 5_000), max_image_pixels=1_000_000)
    assert open_image(png_claiming(1_000, 1_000), max_image_pixels=1_000_000).size == (1000, 1000)


def test_batch_keeps_read_errors_labels_and_layout():
    config = DataConfig(image_size=32, patch_size=8, crop_fraction=1.0, require_labels=False)
    images = [encode(quadrants(64)), b"", encode(quadrants(64), "JPEG", quality=95)]
    batch = batch_of(images, errors=["", "missing label: no .cls member", ""])
    out = preprocess_batch(batch, config=config, train=False, epoch=0)
    assert list(out["error"]) == ["", "missing label: no .cls member", ""]
    assert out["label"].dtype == np.int64 and list(out["label"]) == [0, 1, 2]
    assert list(out["key"]) == ["0000", "0001", "0002"]
    direct = transform_image(images[0], config, train=False, rng=None)
    np.testing.assert_array_equal(unpatchify(out["patches"][0], 8, (4, 4)), direct)


def test_train_augmentation_depends_on_seed_epoch_and_key_only():
    config = DataConfig(image_size=32, patch_size=8, require_labels=False)
    photo = PHOTO.read_bytes()
    first = preprocess_batch(batch_of([photo, photo]), config=config, train=True, epoch=0)["patches"]
    again = preprocess_batch(batch_of([photo, photo]), config=config, train=True, epoch=0)["patches"]
    later = preprocess_batch(batch_of([photo, photo]), config=config, train=True, epoch=1)["patches"]
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first[0], first[1])  # two keys, two crops
    assert not np.array_equal(first, later)  # a new epoch, new crops


def test_a_crop_is_seeded_by_the_shard_name_under_its_root_not_where_the_data_lies():
    config = DataConfig(image_size=32, patch_size=8, require_labels=False)
    batch = batch_of([PHOTO.read_bytes()] * 2)
    here = preprocess_batch(batch, config=config, train=True, epoch=0, root="/shards/")
    moved = batch | {"url": np.array(["s3://bucket/copy/a.tar"] * 2, dtype=object)}
    there = preprocess_batch(moved, config=config, train=True, epoch=0, root="s3://bucket/copy/")
    np.testing.assert_array_equal(here["patches"], there["patches"])
    assert list(there["url"]) == ["s3://bucket/copy/a.tar"] * 2  # rows still say where they came from
    renamed = batch | {"url": np.array(["/shards/b.tar"] * 2, dtype=object)}
    other = preprocess_batch(renamed, config=config, train=True, epoch=0, root="/shards/")
    assert not np.array_equal(here["patches"], other["patches"])  # another shard, other crops


def test_crop_resize_flips_nothing_and_returns_rgb_of_the_asked_size():
    im = Image.open(io.BytesIO(encode(quadrants(64))))
    out = crop_resize(im, (0, 0, 32, 32), 16, Image.Resampling.BILINEAR)
    assert out.size == (16, 16) and out.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(out)[8, 8], (255, 0, 0))
