"""Native-aspect patches as a data stage (`pipeline.data.native`, and its parts in `decode` and `masking`):
each image on the largest patch grid of its own aspect ratio within the budget, rows that carry it with
coordinates and a mask, MAE masks over an image's own patches, and micro-batches of one token budget
with little padding. No Ray."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from PIL import Image

from pipeline.data import native
from pipeline.data.config import DataConfig
from pipeline.data.decode import native_crop_box, preprocess_batch
from pipeline.data.masking import mask_batch
from vit.patchify import unpatchify


@pytest.mark.parametrize("budget", [16, 64, 196, 256, 576])
def test_the_grid_is_the_largest_that_fits_the_budget_at_the_images_aspect_ratio(budget):
    rng = random.Random(budget)
    for _ in range(300):
        width, height = rng.randint(1, 4000), rng.randint(1, 4000)
        gh, gw = native.native_grid(width, height, budget)
        assert 1 <= gh * gw <= budget
        # The aspect ratio is kept within half a patch on one side of the grid (or the image is longer
        # than the budget can be: one row, or one column, of as many patches as fit).
        kept = abs(gw - gh * width / height) <= 0.5 or abs(gh - gw * height / width) <= 0.5
        assert kept or (gh, gw) in ((1, budget), (budget, 1))
        # No grid of the same kind with more patches fits (each side count with its rounded partner).
        for side in range(1, budget + 1):
            by_rows = (side, max(1, math.floor(side * width / height + 0.5)))
            by_cols = (max(1, math.floor(side * height / width + 0.5)), side)
            for h, w in (by_rows, by_cols):
                assert h * w > budget or h * w <= gh * gw
    side = math.isqrt(budget)
    assert native.native_grid(640, 640, budget) == (side, side)  # a square image: the square grid
    assert native.native_grid(10_000, 1, budget) == (1, budget)  # a strip: one row, every patch in it


def test_images_of_usual_aspect_ratios_fill_most_of_the_budget():
    rng = random.Random(0)
    fill = [
        np.prod(native.native_grid(round(1000 * math.exp(rng.uniform(-1.1, 1.1))), 1000, 256)) / 256
        for _ in range(2000)
    ]
    assert np.mean(fill) > 0.94 and min(fill) > 0.85


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")  # lossless: the eval rows are its exact pixels
    return out.getvalue()


def read_rows(images: list[bytes], keys: list[str] | None = None) -> dict[str, np.ndarray]:
    n = len(images)
    keys = keys or [f"k{i}" for i in range(n)]
    return {
        "key": np.array(keys, dtype=object),
        "url": np.array(["/data/train-0.tar"] * n, dtype=object),
        "image": np.array(images, dtype=object),
        "label": np.arange(n, dtype=np.int64),
        "error": np.array([""] * n, dtype=object),
    }


NATIVE = DataConfig(image_size=32, patch_size=8, patches="native", max_patches=24)


def test_an_eval_row_is_the_whole_image_on_its_own_grid_with_coordinates_and_a_mask():
    image = jpeg(96, 32)  # 3:1 -> a 3 x 8 grid of 8 px patches: 24 patches, 24 x 64 px
    rows = preprocess_batch(read_rows([image, b"not an image"]), config=NATIVE, train=False, epoch=0)
    assert rows["patches"].shape == (2, 24, 8 * 8 * 3) and rows["mask"].shape == (2, 24)
    assert rows["grid"].tolist() == [[3, 8], [0, 0]] and rows["error"][1].startswith("undecodable")
    n = 24
    assert rows["mask"][0].sum() == n and not rows["mask"][1].any()
    assert rows["coords"][0, :n].tolist() == [[r, c] for r in range(3) for c in range(8)]
    # The patches are the image resized to 64 x 24, row-major over its grid.
    expected = np.asarray(Image.open(io.BytesIO(image)).resize((64, 24), Image.Resampling.BICUBIC))
    assert np.array_equal(unpatchify(rows["patches"][0, :n], 8, (3, 8)), expected)


def test_a_train_crop_keeps_the_images_aspect_ratio_and_is_the_same_whatever_the_batch():
    images = [jpeg(120, 40, seed=1), jpeg(40, 100, seed=2), jpeg(64, 64, seed=3)]
    config = NATIVE.replace(scale=(0.3, 1.0))
    together = preprocess_batch(read_rows(images), config=config, train=True, epoch=3)
    for i, image in enumerate(images):
        alone = preprocess_batch(read_rows([image], [f"k{i}"]), config=config, train=True, epoch=3)
        for column in native.INPUTS:
            assert np.array_equal(alone[column][0], together[column][i]), column
    assert together["grid"].tolist() == [[3, 8], [8, 3], [4, 4]]  # each image's own aspect ratio
    again = preprocess_batch(read_rows(images), config=config, train=True, epoch=4)
    assert not np.array_equal(again["patches"], together["patches"])  # another epoch, other crops
    rng = random.Random(0)
    for _ in range(200):
        left, top, right, bottom = native_crop_box(300, 100, rng, (0.08, 1.0))
        assert 0 <= left < right <= 300 and 0 <= top < bottom <= 100
        assert abs((right - left) / (bottom - top) - 3) < 0.35  # rounding on a crop of a few pixels


def test_mae_masks_an_images_own_patches_and_keeps_their_places():
    config = NATIVE.replace(mask_ratio=0.75)
    rows = preprocess_batch(read_rows([jpeg(96, 32), jpeg(40, 40), b""]), config=config, train=False, epoch=0)
    masked = mask_batch(rows, config=config, epoch=0)
    wide = native.native_visible(24, 0.75)  # 6 visible slots in every row
    assert masked["visible"].shape == (3, wide, 192) and masked["masked"].shape == (3, 24 - wide, 192)
    for i, (gh, gw) in enumerate([(3, 8), (4, 4)]):
        n, v = gh * gw, native.native_visible(gh * gw, 0.75)
        real = masked["mask"][i]
        assert real[:v].all() and not real[v:wide].any() and real[wide : wide + n - v].all()
        places = np.concatenate([masked["coords"][i, :v], masked["coords"][i, wide : wide + n - v]])
        assert sorted(map(tuple, places.tolist())) == [(r, c) for r in range(gh) for c in range(gw)]
        # Each slot holds the patch of its coordinates.
        pixels = np.concatenate([masked["visible"][i, :v], masked["masked"][i, : n - v]])
        for (r, c), patch in zip(places.tolist(), pixels, strict=True):
            assert np.array_equal(patch, rows["patches"][i, r * gw + c])
    assert not masked["mask"][2].any()  # the error row: no patch, no mask
    again = mask_batch(rows, config=config, epoch=0)
    assert np.array_equal(again["coords"], masked["coords"])  # a pure function of (seed, epoch, name, key)


def stream(lengths: list[int], budget: int, chunk: int = 7, mae: bool = False):
    """Native rows of these lengths (grids 1 x n), ``chunk`` a batch, keys their order."""
    images = [np.full((8, 8 * n, 3), i % 251, np.uint8) for i, n in enumerate(lengths)]
    for lo in range(0, len(images), chunk):
        batch = native.native_rows(images[lo : lo + chunk], 8, budget)
        batch["key"] = np.array([f"{i:05d}" for i in range(lo, lo + len(batch["grid"]))])
        batch["label"] = np.arange(lo, lo + len(batch["grid"]))
        if mae:
            ids = [np.random.default_rng(i).permutation(n) for i, n in enumerate(native.lengths(batch))]
            batch = native.mask_native(batch, ids, 0.75)
        yield batch


def usual_lengths(count: int, budget: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [
        int(np.prod(native.native_grid(round(1000 * math.exp(rng.uniform(-1.1, 1.1))), 1000, budget)))
        for _ in range(count)
    ]


def test_micro_batches_hold_one_token_budget_with_little_padding_and_every_row_once():
    budget, size = 256, 16
    lengths = usual_lengths(3000, budget)
    batches = list(native.pack(stream(lengths, budget), size, budget))
    keys = [k for b in batches for k in b["key"]]
    assert sorted(keys) == [f"{i:05d}" for i in range(len(lengths))]  # every row once
    step = native.length_step(budget)
    shapes = {b["patches"].shape[1] for b in batches}
    assert all(length % step == 0 or length == budget for length in shapes) and len(shapes) <= 8
    for b in batches:
        tokens = b["patches"].shape[0] * b["patches"].shape[1]
        assert tokens <= size * budget  # never past the budget
        assert (b["mask"].sum(1) == native.lengths(b)).all()  # each row its own patches, then padding
    full = batches[:-1]
    assert np.mean([b["mask"].size for b in full]) / (size * budget) > 0.99  # the budget, nearly all
    padding = 1 - sum(b["mask"].sum() for b in batches) / sum(b["mask"].size for b in batches)
    underfill = 1 - np.mean(lengths) / budget  # the padding of rows padded to max_patches
    assert padding < 0.03 < underfill  # grouped: under half of what fixed-width rows would waste
    # Bounded waiting: no row leaves more than two windows after it arrives.
    arrival = {k: i for i, k in enumerate(f"{i:05d}" for i in range(len(lengths)))}
    emitted = 0
    for b in batches:
        emitted += len(b["key"])
        assert all(emitted - arrival[k] <= 2 * native.WINDOW * size + budget for k in b["key"])


def test_micro_batches_are_a_pure_function_of_the_stream_however_it_is_chunked():
    budget, lengths = 64, usual_lengths(500, 64, seed=1)
    a = list(native.pack(stream(lengths, budget, chunk=3), 8, budget))
    b = list(native.pack(stream(lengths, budget, chunk=50), 8, budget))
    assert [x["key"].tolist() for x in a] == [y["key"].tolist() for y in b]
    assert all(np.array_equal(x["patches"], y["patches"]) for x, y in zip(a, b, strict=True))


def test_mae_micro_batches_cut_the_visible_and_masked_slots_of_their_length():
    budget, size = 64, 4
    lengths = [*usual_lengths(200, budget, seed=2), 20, 7, 2]
    out = list(native.pack(stream(lengths, budget, mae=True), size, budget, 0.75))
    assert sorted(k for b in out for k in b["key"]) == sorted(f"{i:05d}" for i in range(len(lengths)))
    for b in out:
        n_visible, n_masked = b["visible"].shape[1], b["masked"].shape[1]
        assert b["coords"].shape[1] == b["mask"].shape[1] == n_visible + n_masked
        for i, n in enumerate(native.lengths(b)):
            v = native.native_visible(int(n), 0.75)
            real = b["mask"][i]
            assert real[:v].all() and not real[v:n_visible].any()
            assert real[n_visible : n_visible + n - v].all() and not real[n_visible + n - v :].any()
            # The visible patch in each slot is the one at its coordinates (grids are 1 x n: col = index).
            cols = b["coords"][i, :v, 1]
            assert (b["visible"][i, :v] == int(b["key"][i]) % 251).all() and (cols < n).all()


def test_the_budget_defaults_to_the_square_crops_patches_and_eval_configs_say_it():
    config = DataConfig(image_size=224, patch_size=16, patches="native")
    assert config.patch_budget == 196 and DataConfig(image_size=224, patch_size=16).patch_budget == 196
    evaluated = DataConfig.for_eval(config.to_dict(), image_size=256, patch_size=16)
    assert (evaluated.patches, evaluated.max_patches) == ("native", 256)  # the model's size, as a number
    square = DataConfig.for_eval(DataConfig(max_patches=100).to_dict(), image_size=224, patch_size=16)
    assert square.max_patches is None  # no budget where it does not apply
    with pytest.raises(ValueError, match="--max-patches must be from 4 to 65,536, got 2"):
        DataConfig(patches="native", max_patches=2)
    with pytest.raises(ValueError, match="--patches must be one of square, native"):
        DataConfig(patches="wide")
