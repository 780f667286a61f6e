"""Decode -> crop -> patchify: the one per-sample stage, as a plain function over a batch dict.

`preprocess_batch` maps read rows ``{key, url, image, label, error}`` to ``{key, url, patches, label,
error}`` with ``patches`` uint8 ``(B, N, P*P*C)`` in the layout of `vit.patchify`. A sample that cannot
be used keeps its row: ``error`` says why and its patches are zeros, so counts stay exact downstream.

Crops are computed on the original image size first; JPEGs are then decoded with DCT-domain downscaling
(PIL ``draft``) by the largest factor of 2, 4 or 8 that keeps the crop at least the output size, and one
``resize`` with a source ``box`` crops and resamples in a single pass. Train: random-resized-crop
(scale, ratio) and horizontal flip, drawn from an RNG seeded by (seed, epoch, shard name, key), so a sample gets
the same crop in the same epoch however tasks are scheduled; with ``randaug_ops`` > 0, RandAugment
(`pipeline.data.augment`) then draws its ops from that same RNG, after the crop and the flip. Eval: resize the short side to
``image_size / crop_fraction`` and take the center ``image_size`` square, both in continuous coordinates.

Native-aspect patches (``patches="native"``, `pipeline.data.native`): train crops keep the image's own
aspect ratio (area share in ``scale``, `native_crop_box`) and flip; evaluation takes the whole image. The
crop is resized to the largest patch grid within ``max_patches`` that keeps its aspect ratio
(`pipeline.data.native.native_grid`), so an image becomes its own number of patches, then rows of fixed
width with coordinates and a mask (`pipeline.data.native.native_rows`); RandAugment works as for squares.

Resampling: PIL's filters widen with the downscale factor (antialiased, like torchvision's
``antialias=True``). Bilinear for training (cheaper, and augmentation dominates its effect), bicubic
for evaluation (the usual ViT evaluation transform).
"""

from __future__ import annotations

import io
import math
import random
import warnings
from typing import Any

import numpy as np
from PIL import Image, ImageFile, JpegImagePlugin, UnidentifiedImageError

from pipeline.data.augment import rand_augment
from pipeline.data.config import INTERPOLATIONS, DataConfig, sample_seed
from pipeline.data.native import native_grid, native_rows
from pipeline.data.shards import shard_name
from vit.patchify import patchify

# Decoders a shard may reach; a short list is a smaller attack surface than every plugin PIL has.
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
RESAMPLE = {name: Image.Resampling[name.upper()] for name in INTERPOLATIONS}
Box = tuple[float, float, float, float]  # (left, top, right, bottom) in source pixels


class ImageError(Exception):
    """A sample's image cannot be used; the message is ``"<category>: <detail>"``."""


def train_crop_box(
    width: int, height: int, rng: random.Random, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """Random-resized-crop box: area share in ``scale``, aspect (w/h) log-uniform in ``ratio``.

    Ten tries to fit inside the image, then the whole image clamped to ``ratio`` and centered (the
    algorithm of Szegedy et al. 2015 as torchvision implements it).
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return left, top, left + w, top + h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, min(height, round(width / ratio[0]))
    elif aspect > ratio[1]:
        w, h = min(width, round(height * ratio[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def native_crop_box(
    width: int, height: int, rng: random.Random, scale: tuple[float, float]
) -> tuple[int, int, int, int]:
    """Random-resized crop at the image's own aspect ratio: a share of the area drawn from ``scale``,
    each side shrunk by its square root, placed uniformly (it always fits: no retries)."""
    side = math.sqrt(rng.uniform(scale[0], scale[1]))
    w, h = max(1, round(width * side)), max(1, round(height * side))
    left, top = rng.randint(0, width - w), rng.randint(0, height - h)
    return left, top, left + w, top + h


def eval_crop_box(width: int, height: int, image_size: int, crop_fraction: float) -> Box:
    """The source box that "resize short side to image_size / crop_fraction, center crop" keeps."""
    side = min(width, height) * crop_fraction  # the crop, measured in source pixels
    left, top = (width - side) / 2, (height - side) / 2
    return left, top, left + side, top + side


def draft_factor(box: Box, size: int | tuple[int, int]) -> int:
    """Largest JPEG DCT reduction (8, 4, 2, 1) that keeps the crop at least ``size`` pixels each way
    (a square's side, or (width, height))."""
    w, h = box[2] - box[0], box[3] - box[1]
    out_w, out_h = (size, size) if isinstance(size, int) else size
    for factor in (8, 4, 2):
        if w / factor >= out_w and h / factor >= out_h:
            return factor
    return 1


def open_image(data: bytes, max_image_pixels: int) -> Image.Image:
    """Open (header only) and vet an encoded image: known format, at most ``max_image_pixels``."""
    if not data:
        raise ImageError("empty image: zero-byte image member")
    try:
        im = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError(f"image too large: {e}") from e
    except UnidentifiedImageError as e:
        raise ImageError(f"undecodable image: not a recognised image ({', '.join(FORMATS)})") from e
    width, height = im.size
    if width * height > max_image_pixels:  # checked from the header, before any pixel is decoded
        raise ImageError(
            f"image too large: {width}x{height} = {width * height} pixels > max_image_pixels={max_image_pixels}"
        )
    if width == 0 or height == 0:
        raise ImageError(f"undecodable image: empty {width}x{height} image")
    return im


def crop_resize(
    im: Image.Image,
    box: Box,
    size: int | tuple[int, int],
    resample: Image.Resampling,
    *,
    draft: bool = True,
    reducing_gap: float | None = None,
) -> Image.Image:
    """Decode ``im`` fully, crop ``box`` and resample it to ``size`` x ``size`` (or (width, height)) RGB
    in one pass."""
    if draft and im.format == "JPEG":
        factor = draft_factor(box, size)
        if factor > 1:
            source_width = im.width
            drafted = im.draft("RGB", (im.width // factor, im.height // factor))
            if drafted is not None:  # None when PIL cannot draft this file (then decode at full size)
                scale = drafted[1][2] / source_width  # reduced pixels per source pixel: 1 / factor
                box = (
                    box[0] * scale,
                    box[1] * scale,
                    min(box[2] * scale, im.width),
                    min(box[3] * scale, im.height),
                )
    try:
        im.load()  # the full decode: a truncated stream raises here (LOAD_TRUNCATED_IMAGES stays False)
    except OSError as e:
        text = str(e)
        kind = (
            "truncated image" if "truncated" in text or "broken data stream" in text else "undecodable image"
        )
        raise ImageError(f"{kind}: {text[:160]}") from e
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode not in ("RGB", "L"):
        im = im.convert("RGB")  # CMYK, alpha (dropped, as the usual RGB loaders do), 16-bit
    out = im.resize(
        (size, size) if isinstance(size, int) else size, resample, box=box, reducing_gap=reducing_gap
    )
    return out.convert("RGB") if out.mode != "RGB" else out  # gray is resized once, then widened


def transform_image(data: bytes, config: DataConfig, *, train: bool, rng: random.Random | None) -> np.ndarray:
    """Encoded image -> uint8 ``(S, S, 3)``, S = ``config.image_size``; native: ``(gh P, gw P, 3)`` on the
    crop's own grid (`pipeline.data.native.native_grid`). Raises `ImageError`."""
    im = open_image(data, config.max_image_pixels)
    size: int | tuple[int, int] = config.image_size
    if train:
        assert rng is not None, "train crops need the sample's RNG"
        if config.native:
            box: Box = native_crop_box(im.width, im.height, rng, config.scale)
        else:
            box = train_crop_box(im.width, im.height, rng, config.scale, config.ratio)
        flip = config.hflip and rng.random() < 0.5
        resample = RESAMPLE[config.train_interpolation]
    else:
        box, flip = (0, 0, im.width, im.height), False  # native: the whole image
        if not config.native:
            box = eval_crop_box(im.width, im.height, size, config.crop_fraction)
        resample = RESAMPLE[config.eval_interpolation]
    if config.native:
        gh, gw = native_grid(round(box[2] - box[0]), round(box[3] - box[1]), config.patch_budget)
        size = (gw * config.patch_size, gh * config.patch_size)
    out = crop_resize(im, box, size, resample, draft=config.jpeg_draft, reducing_gap=config.reducing_gap)
    if train and config.randaug_ops:
        # Before the flip, whose draw came first: every op is mirror-symmetric in distribution (the
        # signed ones draw their sign), so this is the distribution of timm's flip-then-augment.
        out = rand_augment(out, config.randaug_ops, config.randaug_magnitude, rng)
    pixels = np.asarray(out)
    return pixels[:, ::-1] if flip else pixels


def decode_sample(
    data: bytes, config: DataConfig, *, train: bool, rng: random.Random | None
) -> tuple[np.ndarray | None, str]:
    """One image through `transform_image`: ``(pixels, "")``, or ``(None, reason)`` for its error row."""
    try:
        return transform_image(data, config, train=train, rng=rng), ""
    except Exception as e:  # any decoder failure is this sample's, not the job's
        return None, sample_error(e)


def sample_error(e: Exception) -> str:
    """The error row's reason for an image that failed: an `ImageError`'s own, else "undecodable"."""
    return str(e) if isinstance(e, ImageError) else f"undecodable image: {type(e).__name__}: {str(e)[:160]}"


def pin_pil(config: DataConfig) -> None:
    """PIL's settings are process-global; pin the two that decide what counts as a bad image."""
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    Image.MAX_IMAGE_PIXELS = config.max_image_pixels


def device_decodable(im: Image.Image) -> bool:
    """Whether a GPU's JPEG decoder (nvJPEG) takes this vetted image: a sequential (baseline or
    extended) JPEG, gray or YCbCr, at 4:4:4, 4:2:2 or 4:2:0. Everything else (PNG and the other
    formats, progressive JPEGs, CMYK, Adobe RGB-coded, rarer subsamplings) decodes on a CPU."""
    if im.format != "JPEG" or im.mode not in ("RGB", "L"):
        return False
    if im.info.get("progressive") or im.info.get("progression") or im.info.get("adobe_transform") == 0:
        return False
    return im.mode == "L" or JpegImagePlugin.get_sampling(im) in (0, 1, 2)


def vet_batch(batch: dict[str, Any], *, config: DataConfig) -> dict[str, np.ndarray]:
    """Read rows -> the same rows with each image's header vetted, for a consumer that decodes the
    images itself (the embedding job's ``--decode gpu``). The checks are `open_image`'s (format, pixel
    count): a sample that fails them becomes an error row here, as in `preprocess_batch`; the bytes go
    on unchanged, and ``device`` (bool) says whether a GPU's JPEG decoder takes the image
    (`device_decodable`, and the stream ends with its end-of-image marker).
    """
    pin_pil(config)
    images, errors = batch["image"], batch["error"]
    device = np.zeros(len(images), bool)
    out_errors = np.empty(len(images), dtype=object)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        for i in range(len(images)):
            error = errors[i]
            if not error:
                try:
                    im = open_image(images[i], config.max_image_pixels)
                    # A stream without its end marker is truncated, which a GPU decoder may not say:
                    # the CPU path names it (its error row) or, for mere trailing bytes, decodes it.
                    device[i] = device_decodable(im) and images[i].rstrip(b"\0").endswith(b"\xff\xd9")
                except Exception as e:  # a header PIL cannot parse is this sample's, not the job's
                    error = sample_error(e)
            out_errors[i] = error.replace("\n", " ")
    return {**batch, "error": out_errors, "device": device}


def preprocess_batch(
    batch: dict[str, Any], *, config: DataConfig, train: bool, epoch: int, root: str = ""
) -> dict[str, np.ndarray]:
    """Read rows -> patch rows (the function Ray fuses into each read task). A training crop is
    seeded by the sample's shard name relative to ``root`` (`shards.shard_name`) and its key.

    In: ``key``, ``url`` (str), ``image`` (bytes), ``label`` (int64), ``error`` (str) arrays of length B.
    Out: ``key``, ``url``, ``patches`` uint8 ``(B, N, P*P*3)``, ``label`` int64 ``(B,)``, ``error``,
    and ``index`` and ``shard_size`` as they came in; native (`pipeline.data.native`): ``patches``
    ``(B, M, P*P*3)`` with ``coords``, ``mask`` and ``grid``, M = ``max_patches``.
    """
    pin_pil(config)
    keys, urls, images, errors = batch["key"], batch["url"], batch["image"], batch["error"]
    size = config.image_size
    # (B, H, W, C), error rows zero; native: each image its own array, None for an error row.
    pixels: Any = [None] * len(keys) if config.native else np.zeros((len(keys), size, size, 3), np.uint8)
    out_errors = np.empty(len(keys), dtype=object)
    with warnings.catch_warnings():
        # PIL warns before our header check rejects an oversized image; the error row is the record.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        for i in range(len(keys)):
            error = errors[i]
            if not error:
                name = shard_name(urls[i], root)
                rng = random.Random(sample_seed(config.seed, epoch, name, keys[i])) if train else None
                decoded, error = decode_sample(images[i], config, train=train, rng=rng)
                if decoded is not None:
                    pixels[i] = decoded
            out_errors[i] = error.replace("\n", " ")
    if config.native:
        columns = native_rows(pixels, config.patch_size, config.patch_budget)  # (B, M, ...) each
    else:
        columns = {"patches": patchify(pixels, config.patch_size)}  # (B, N, P*P*3)
    return {
        "key": keys,
        "url": urls,
        **columns,
        "label": np.asarray(batch["label"], dtype=np.int64),
        "error": out_errors,
        # A sample's place in its shard, and the shard's size on its last row (`pipeline.data.rows`).
        **{name: batch[name] for name in ("index", "shard_size") if name in batch},
    }
