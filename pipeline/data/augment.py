"""RandAugment (Cubuk et al. 2020, "RandAugment: Practical automated data augmentation with a reduced
search space") on a training crop, per sample, with PIL: ``num_ops`` ops drawn uniformly (with
replacement) from the paper's 14, each applied at one magnitude M.

M is on the 0..10 level scale of timm and big_vision (`MAX_MAGNITUDE`; AugReg's ``randaug(2, 10)`` is
2 ops at M = 10, DeiT's ``rand-m9`` M = 9); each op maps ``level = M / 10`` to its own range:

    Identity, AutoContrast, Equalize   no magnitude
    Rotate                             +-30 degrees x level
    ShearX, ShearY                     +-0.3 x level (shear factor, about the top-left corner)
    TranslateX, TranslateY             +-0.45 x level of the image side (timm's relative translate;
                                       big_vision's 100 px at M = 10 is 0.45 of 224)
    Solarize                           invert pixels >= 256 - 256 x level
    Posterize                          keep 8 - round(4 x level) bits (8 -> 4)
    Color, Contrast, Brightness,
    Sharpness                          enhance by 1 +- 0.9 x level (0.1 .. 1.9 at M = 10)

Signed ops draw their sign per op. Severity grows with M for every op (timm's "increasing" mapping,
DeiT's ``inc1``), so at M = 0 all ops but AutoContrast and Equalize are the identity. Geometric ops
take the nearest source pixel and fill what they uncover with grey 128, as big_vision's (AugReg's)
implementation does; bilinear resampling (timm's) costs 13x more per op at 224 px with PIL (1.05 ms
against 0.08), which made RandAugment(2, 10) cost a third of the data stage's throughput.

Each chosen op is always applied, as in the paper and big_vision (timm applies each with probability
0.5 instead). Invert, SolarizeAdd and Cutout, which timm's and big_vision's op sets add to the paper's,
are not included.

Every draw comes from the caller's ``random.Random``: `pipeline.data.decode` passes the sample's own
RNG, seeded by (seed, epoch, shard name, key), after the crop and flip have drawn from it; a sample's ops are
then a pure function of those four, whatever the scheduling.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from PIL import Image, ImageEnhance, ImageOps

from pipeline.data.config import MAX_MAGNITUDE

FILL = 128  # grey, per band
NEAREST = Image.Resampling.NEAREST

# (image, level in [0, 1], rng, fill) -> image
Op = Callable[[Image.Image, float, random.Random, "int | tuple[int, ...]"], Image.Image]


def _signed(value: float, rng: random.Random) -> float:
    return -value if rng.random() < 0.5 else value


def _affine(im: Image.Image, matrix: tuple[float, ...], fill: int | tuple[int, ...]) -> Image.Image:
    """``im`` resampled through an affine map (output pixel -> source pixel), uncovered pixels ``fill``."""
    return im.transform(im.size, Image.Transform.AFFINE, matrix, NEAREST, fillcolor=fill)


def _enhance(kind: type) -> Op:
    def op(im, level, rng, fill):
        return kind(im).enhance(1.0 + _signed(0.9 * level, rng))

    return op


OPS: dict[str, Op] = {
    "Identity": lambda im, level, rng, fill: im,
    "AutoContrast": lambda im, level, rng, fill: ImageOps.autocontrast(im),
    "Equalize": lambda im, level, rng, fill: ImageOps.equalize(im),
    "Rotate": lambda im, level, rng, fill: im.rotate(_signed(30.0 * level, rng), NEAREST, fillcolor=fill),
    "Solarize": lambda im, level, rng, fill: ImageOps.solarize(im, 256 - round(256 * level)),
    "Posterize": lambda im, level, rng, fill: ImageOps.posterize(im, 8 - round(4 * level)),
    "Color": _enhance(ImageEnhance.Color),
    "Contrast": _enhance(ImageEnhance.Contrast),
    "Brightness": _enhance(ImageEnhance.Brightness),
    "Sharpness": _enhance(ImageEnhance.Sharpness),
    "ShearX": lambda im, level, rng, fill: _affine(im, (1, _signed(0.3 * level, rng), 0, 0, 1, 0), fill),
    "ShearY": lambda im, level, rng, fill: _affine(im, (1, 0, 0, _signed(0.3 * level, rng), 1, 0), fill),
    "TranslateX": lambda im, level, rng, fill: _affine(
        im, (1, 0, _signed(0.45 * level * im.width, rng), 0, 1, 0), fill
    ),
    "TranslateY": lambda im, level, rng, fill: _affine(
        im, (1, 0, 0, 0, 1, _signed(0.45 * level * im.height, rng)), fill
    ),
}
_CHOICES = tuple(OPS.values())


def rand_augment(im: Image.Image, num_ops: int, magnitude: float, rng: random.Random) -> Image.Image:
    """``im`` through ``num_ops`` ops drawn uniformly from `OPS` at ``magnitude`` (0..10); same size, mode."""
    level = magnitude / MAX_MAGNITUDE
    bands = len(im.getbands())
    fill = FILL if bands == 1 else (FILL,) * bands
    for _ in range(num_ops):
        im = _CHOICES[rng.randrange(len(_CHOICES))](im, level, rng, fill)
    return im
