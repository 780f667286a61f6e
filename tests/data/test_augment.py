"""RandAugment in the decode stage, without Ray: off is today's transform to the bit, on is a pure
function of (seed, epoch, url, key), every op keeps size and mode, eval never augments, and a sample
that fails anywhere in it is an error row."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from PIL import Image

from pipeline import settings
from pipeline.data import augment
from pipeline.data.augment import OPS, rand_augment
from pipeline.data.config import DataConfig, sample_seed
from pipeline.data.decode import RESAMPLE, crop_resize, preprocess_batch, train_crop_box, transform_image
from tests.data.test_decode import PHOTO, batch_of, encode, quadrants

CONFIG = DataConfig(image_size=32, patch_size=8, require_labels=False)
RANDAUG = CONFIG.replace(randaug_ops=2, randaug_magnitude=10)
NO_MAGNITUDE = ("Identity", "AutoContrast", "Equalize")  # the ops that ignore M


def photo(size: int = 64, mode: str = "RGB") -> Image.Image:
    return Image.open(PHOTO).convert(mode).resize((size, size), Image.Resampling.BILINEAR)


def test_off_is_the_crop_and_flip_alone_to_the_bit():
    """randaug_ops 0 (the default) leaves the train transform as it was: the sample's RNG draws the
    crop, then the flip, and nothing else touches the pixels."""
    data = PHOTO.read_bytes()
    for key in ("a", "b", "c", "d"):
        seed = sample_seed(0, 0, "u", key)
        rng = random.Random(seed)
        im = Image.open(io.BytesIO(data))
        box = train_crop_box(im.width, im.height, rng, CONFIG.scale, CONFIG.ratio)
        flip = rng.random() < 0.5
        out = np.asarray(crop_resize(im, box, 32, RESAMPLE[CONFIG.train_interpolation]))
        expected = out[:, ::-1] if flip else out
        for config in (CONFIG, CONFIG.replace(randaug_magnitude=10)):
            got = transform_image(data, config, train=True, rng=random.Random(seed))
            np.testing.assert_array_equal(got, expected)


def test_randaug_is_a_pure_function_of_seed_epoch_url_and_key():
    data = PHOTO.read_bytes()

    def patches(config, epoch=0, images=(data, data, data)):
        return preprocess_batch(batch_of(list(images)), config=config, train=True, epoch=epoch)["patches"]

    first, again = patches(RANDAUG), patches(RANDAUG)
    np.testing.assert_array_equal(first, again)
    # The same sample alone in its batch (another task, another schedule): the same pixels.
    np.testing.assert_array_equal(patches(RANDAUG, images=(data,))[0], first[0])
    assert not np.array_equal(first[0], first[1])  # another key, other ops
    assert not np.array_equal(first, patches(RANDAUG, epoch=1))  # another epoch, other ops
    assert not np.array_equal(first, patches(RANDAUG.replace(seed=1)))
    assert not np.array_equal(first, patches(CONFIG))  # and it does augment


def test_randaug_draws_only_from_the_given_rng():
    im = photo()
    runs = [np.asarray(rand_augment(im, 3, 10, random.Random(7))) for _ in range(2)]
    np.testing.assert_array_equal(*runs)
    others = {np.asarray(rand_augment(im, 3, 10, random.Random(s))).tobytes() for s in range(8)}
    assert len(others) > 4  # eight seeds, (almost surely) several different results


@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("name", list(OPS))
def test_every_op_keeps_size_and_mode_and_is_the_identity_at_magnitude_0(name, mode):
    im = photo(48, mode)
    fill = 128 if mode == "L" else (128, 128, 128)
    before = np.asarray(im)
    for level in (0.0, 0.5, 1.0):
        out = OPS[name](im, level, random.Random(3), fill)
        pixels = np.asarray(out)
        assert out.size == im.size and out.mode == mode
        assert pixels.shape == before.shape and pixels.dtype == np.uint8
        if level == 0.0 and name not in NO_MAGNITUDE:
            np.testing.assert_array_equal(pixels, before)
        if level == 1.0 and name != "Identity" and (name, mode) != ("Color", "L"):  # gray has no color
            assert not np.array_equal(pixels, before), f"{name} at magnitude 10 changed nothing"


@pytest.mark.parametrize("name", ["Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY"])
def test_geometric_ops_fill_what_they_uncover_with_grey(name):
    black = Image.new("RGB", (40, 40))
    for seed in range(4):  # both signs
        pixels = np.asarray(OPS[name](black, 1.0, random.Random(seed), (128, 128, 128)))
        uncovered = pixels.any(axis=-1)
        assert uncovered.any() and set(np.unique(pixels[uncovered])) <= set(range(1, 129))
        assert (pixels == 128).all(axis=-1).sum() > 40  # a band of pure fill, not just blended edges


def test_signed_ops_take_both_signs():
    """Rotate at M = 10 turns a marker left or right depending on the draw: both happen."""
    im = np.zeros((41, 41, 3), np.uint8)
    im[2:6, 18:23] = 255  # a block above the center
    sides = set()
    for seed in range(16):
        out = np.asarray(OPS["Rotate"](Image.fromarray(im), 1.0, random.Random(seed), (0, 0, 0)))
        cols = np.nonzero(out[..., 0] > 128)[1]
        sides.add(int(np.sign(cols.mean() - 20)))
    assert sides == {-1, 1}


def test_gray_images_stay_gray_through_randaug():
    """A grayscale source is widened to RGB before augmenting; every op treats the channels alike,
    and the fill is grey, so the patches stay gray."""
    data = encode(Image.open(PHOTO).convert("L"), "JPEG", quality=90)
    config = RANDAUG.replace(randaug_ops=4)
    out = preprocess_batch(batch_of([data] * 6), config=config, train=True, epoch=0)
    assert not any(out["error"])
    pixels = out["patches"].reshape(6, -1, 3)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()


def test_eval_never_augments():
    data = PHOTO.read_bytes()
    plain = transform_image(data, CONFIG, train=False, rng=None)
    np.testing.assert_array_equal(transform_image(data, RANDAUG, train=False, rng=None), plain)
    evaluated = DataConfig.for_eval(RANDAUG.to_dict(), image_size=32, patch_size=8, require_labels=False)
    out = preprocess_batch(batch_of([data]), config=evaluated, train=False, epoch=0)["patches"]
    ref = preprocess_batch(batch_of([data]), config=CONFIG, train=False, epoch=0)["patches"]
    np.testing.assert_array_equal(out, ref)


def test_a_sample_that_fails_in_randaug_is_an_error_row(monkeypatch):
    good = encode(quadrants(64))
    out = preprocess_batch(batch_of([good, b"garbage" * 20, good]), config=RANDAUG, train=True, epoch=0)
    assert [e.split(":")[0] for e in out["error"]] == ["", "undecodable image", ""]

    def broken(im, level, rng, fill):
        raise OSError("image has wrong mode")

    monkeypatch.setattr(augment, "_CHOICES", (broken,))
    out = preprocess_batch(batch_of([good, good]), config=RANDAUG, train=True, epoch=0)
    assert list(out["error"]) == ["undecodable image: OSError: image has wrong mode"] * 2
    assert not out["patches"].any()
    off = preprocess_batch(batch_of([good]), config=CONFIG, train=True, epoch=0)  # off: no op runs
    assert not any(off["error"])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("randaug_ops", -1),
        ("randaug_magnitude", -0.5),
        ("randaug_magnitude", 11),
        ("randaug_magnitude", math.nan),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(field, value):
    with pytest.raises(ValueError, match=settings.flag(DataConfig, field)) as info:
        CONFIG.replace(**{field: value})
    assert "\n" not in str(info.value)


def test_settings_round_trip_and_old_configs_mean_off():
    assert DataConfig.from_dict(RANDAUG.to_dict()) == RANDAUG
    old = {k: v for k, v in CONFIG.to_dict().items() if not k.startswith("randaug")}
    assert DataConfig.from_dict(old).randaug_ops == 0
