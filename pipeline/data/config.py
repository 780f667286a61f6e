"""`DataConfig`, everything that decides which pixels a sample becomes, and the seeds that make it so.

`DataConfig.for_eval` is the one evaluation transform of a trained model (resize, center crop,
patchify, from the preprocessing the model carries): the embedding job, the analyze job and
fine-tuning's evaluation all take theirs from it. Its knobs are declared once, in `EvalTransform`, a
section of `DataConfig` (training's flags) from which `EvalOverrides` is made, the section of the jobs
that read a trained model (the same flags without ``eval-``, each ``none`` by default: the model's own).

Determinism comes from pure functions of their arguments, never of scheduling: `sample_seed` seeds a
sample's crop, flip and RandAugment ops from (seed, epoch, shard name, key), `shard_order` permutes the
shards by (seed, epoch), and `shuffle_seed` seeds a rank's local shuffle buffer by (seed, epoch, rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from pipeline import settings
from pipeline.data.native import MAX_PATCHES, PATCH_MODES
from pipeline.data.rows import Retry, RowSpec
from pipeline.settings import MAX_COUNT, setting
from pipeline.storage import Storage

# Resampling filters by name (`pipeline.data.decode.RESAMPLE` maps them to PIL's).
INTERPOLATIONS = ("nearest", "box", "bilinear", "bicubic", "lanczos")
# A node label as Ray (and Kubernetes) spell one: an optional DNS-style prefix and '/', a name, '=', a
# value; names and values 63 characters at most, alphanumeric at both ends.
_LABEL_PART = r"[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?"
DECODE_LABEL = re.compile(rf"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?{_LABEL_PART}={_LABEL_PART}")
# The top of RandAugment's magnitude scale (timm's and big_vision's level scale; `pipeline.data.augment`).
MAX_MAGNITUDE = 10.0
# The largest image side a job may ask for: far above any ViT's (a 65,536 px square is 4 gigapixels).
MAX_IMAGE_SIZE = 65_536


@dataclass(frozen=True, kw_only=True)
class EvalTransform(settings.Settings):
    """How an evaluation image becomes the model's input: resize, center crop (`pipeline.data.decode`).
    A field here is a flag of training (``--eval-x`` or ``--x``) and, through `EvalOverrides`, of every
    job that reads a trained model, and `DataConfig.for_eval` applies it: one field, one knob."""

    crop_fraction: float = setting(
        0.875,
        "evaluation: short side to image_size / crop_fraction (224 -> 256), then the center square",
        gt=0,
        le=1,
    )
    eval_interpolation: str = setting("bicubic", "resize filter of evaluation crops", choices=INTERPOLATIONS)


# The jobs' section: each knob of `EvalTransform`, None where the model's stored preprocessing decides.
EvalOverrides = settings.optional(
    EvalTransform, "EvalOverrides", unset="the model's own", flag=lambda option: option.removeprefix("eval-")
)


@dataclass(frozen=True)
class DataConfig(EvalTransform, Storage):
    """Everything that decides which pixels a sample becomes; saved with every checkpoint."""

    image_size: int = setting(
        224, "input resolution in pixels (a multiple of the patch size)", ge=1, le=MAX_IMAGE_SIZE
    )
    # None until the model is known (`TrainConfig.data_for`); every dataset is built with one.
    patch_size: int | None = setting(
        16, "pixels per patch side: the model's", flag=None, ge=1, le=MAX_IMAGE_SIZE
    )
    # Native-aspect batches: `pipeline.data.native` (the grid, the rows, the micro-batches).
    patches: str = setting(
        "square",
        "square: each image cropped to --image-size squared; native: each at its own aspect ratio on the "
        "largest patch grid within --max-patches, in micro-batches of one token budget",
        choices=PATCH_MODES,
    )
    max_patches: int | None = setting(
        None,
        "native: the most patches an image becomes; a micro-batch holds --micro-batch-size times this "
        "many, padding included (none: (image size / patch size)^2, the square crop's)",
        ge=4,
        le=MAX_PATCHES,
    )
    scale: tuple[float, float] = setting(
        (0.08, 1.0),
        "random-resized-crop area share MIN,MAX, e.g. 0.08,1",
        flag="crop-scale",
        metavar="MIN,MAX",
        gt=0,
        le=1,
    )
    # An aspect past 100:1 is a strip a pixel or two wide at any ViT's size.
    ratio: tuple[float, float] = setting(
        (3 / 4, 4 / 3), "random-resized-crop aspect (w/h) MIN,MAX, e.g. 0.75,1.33", flag="crop-ratio",
        metavar="MIN,MAX", gt=0, le=100,
    )  # fmt: skip
    hflip: bool = setting(True, "random horizontal flips in training")
    randaug_ops: int = setting(
        0, "RandAugment: ops per training image, drawn from 14 (0: none; AugReg and DeiT use 2)", ge=0, le=100
    )
    randaug_magnitude: float = setting(
        9.0,
        "RandAugment: strength of every op on a 0..10 scale (AugReg's is 10, DeiT's 9)",
        ge=0,
        le=MAX_MAGNITUDE,
    )
    mask_ratio: float | None = setting(
        None,
        "MAE: share of patches hidden, drawn per sample in training (None: no mask)",
        flag=None,
        gt=0,
        lt=1,
    )
    train_interpolation: str = setting("bilinear", "resize filter of training crops", choices=INTERPOLATIONS)
    jpeg_draft: bool = setting(True, "DCT-domain downscale of JPEGs while the crop stays >= image_size")
    # PIL takes a gap of 1 or more (below: every image fails to resize, as if the shards were bad);
    # past 100 it pre-reduces nothing a ViT's input needs.
    reducing_gap: float | None = setting(
        None, "PIL resize pre-reduction (none: the exact filter over all pixels)", ge=1, le=100
    )
    image_keys: tuple[str, ...] = setting(
        ("jpg", "jpeg", "png", "webp"),
        "member extensions holding the image, first present wins",
        metavar="EXT,...",
    )
    label_key: str | None = setting(
        "cls",
        "where labels are: a member extension (cls), json:<field>, or none (unlabeled, --objective mae)",
    )
    require_labels: bool = setting(True, "a sample without a label is a bad sample", flag=None)
    # Set from training's --num-classes and --seed (`pipeline.train.config.TrainConfig`), whose bounds hold.
    num_classes: int | None = setting(
        None, "labels outside [0, num_classes) are bad samples (None: no check)", flag=None
    )
    seed: int = setting(0, "seed of shard order, crops and shuffling", flag=None)
    shuffle_buffer: int = setting(
        1024, "samples in each worker's local shuffle buffer (0: none)", ge=0, le=MAX_COUNT
    )
    max_bad_fraction: float = setting(0.01, "share of corrupt samples that fails the job", ge=0, le=1)
    max_lost_shards: int = setting(
        0,
        "shards that give no readable sample (zeros, an HTML page, an empty tar) before the job fails",
        ge=0,
        le=MAX_COUNT,
    )
    bad_grace_samples: int = setting(
        1000,
        "bad samples are held to --max-bad-fraction of at least this many samples seen",
        ge=0,
        le=MAX_COUNT,
    )
    max_image_pixels: int = setting(
        89_478_485, "decompression-bomb limit (PIL's default), checked from the header", ge=1, le=MAX_COUNT
    )
    block_rows: int = setting(256, "samples per read block", ge=1, le=MAX_COUNT)
    # Ray's target block size for this dataset: a decode batch is up to this much encoded data (often a
    # whole shard), an output block about this much patch data (~430 rows at 224 px, patch 14). Fewer,
    # larger blocks cost the consumer less per image (BENCHMARKS.md, "Data pipeline"); peak memory per
    # read task is about 4 blocks.
    block_bytes: int = setting(64 << 20, "Ray Data's target block size in bytes", ge=1, le=MAX_COUNT)
    read_concurrency: int | None = setting(
        None, "read tasks at once (none: as many as CPUs allow)", ge=1, le=MAX_COUNT
    )
    # A shard whose storage fails is tried read_attempts times in all, waiting read_backoff_s, then
    # twice that, ... between tries (at most 3.5 s with the defaults), before it counts as lost. The
    # bounds keep that wait within hours (60 s doubled 8 times: 8.5 h), never without an end.
    read_attempts: int = setting(4, "tries of a shard whose storage fails", ge=1, le=10)
    read_backoff_s: float = setting(
        0.5, "seconds before the second try of a shard, doubled each try after", ge=0, le=60
    )
    # A Ray label selector on the read + decode tasks (`build_dataset`): the shipped cluster configs
    # label their CPU-only decode nodes vitray/role=decode (docs/scaling.md, "Where decode runs").
    decode_nodes: str | None = setting(
        None,
        "decode only on Ray nodes with this label, KEY=VALUE, e.g. vitray/role=decode (none: any node)",
        metavar="KEY=VALUE",
    )

    def __post_init__(self) -> None:
        for name in ("scale", "ratio", "image_keys"):  # from_dict / JSON give lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "image_keys", tuple(k.lower().lstrip(".") for k in self.image_keys))

        settings.check(self)  # every bound a setting declares; what follows compares fields

        def flag(name: str) -> str:
            return settings.flag(DataConfig, name)

        problems = [
            (
                self.image_size % (self.patch_size or 1) != 0,
                f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}; "
                "pick sizes that divide",
            ),
            (
                not 0 < self.scale[0] <= self.scale[1] <= 1,
                f"{flag('scale')} {settings.shown(self.scale)} must be MIN,MAX with 0 < MIN <= MAX <= 1, e.g. 0.08,1",
            ),
            (
                not 0 < self.ratio[0] <= self.ratio[1],
                f"{flag('ratio')} {settings.shown(self.ratio)} must be MIN,MAX with 0 < MIN <= MAX, e.g. 0.75,1.33",
            ),
            (not self.image_keys, "image_keys must name at least one member extension, e.g. ('jpg',)"),
            (  # no flag of its own: training's --num-classes sets it (`TrainConfig.data_for`)
                self.num_classes is not None and self.num_classes <= 0,
                f"--num-classes must be at least 1, got {self.num_classes}",
            ),
            (
                self.decode_nodes is not None and DECODE_LABEL.fullmatch(self.decode_nodes) is None,
                f"{flag('decode_nodes')} {self.decode_nodes!r} must be one node label KEY=VALUE, "
                "e.g. vitray/role=decode (as the cluster config labels its decode nodes)",
            ),
        ]
        for bad, message in problems:
            if bad:
                # A message that names its flag is the user's; one that names a field, the caller's.
                raise ValueError(message if message.startswith("--") else f"DataConfig: {message}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def native(self) -> bool:
        """Images at their own aspect ratio (``--patches native``, `pipeline.data.native`)."""
        return self.patches == "native"

    @property
    def patch_budget(self) -> int:
        """The most patches an image becomes: ``max_patches``, else the square crop's."""
        return self.max_patches or self.num_patches

    @property
    def row_spec(self) -> RowSpec:
        return RowSpec(self.image_keys, self.label_key, self.require_labels, self.num_classes)

    @property
    def label_selector(self) -> dict[str, str] | None:
        """``decode_nodes`` as Ray's ``label_selector`` (None: decode may run on any node)."""
        if self.decode_nodes is None:
            return None
        key, value = self.decode_nodes.split("=", 1)
        return {key: value}

    @property
    def retry(self) -> Retry:
        return Retry(self.read_attempts, self.read_backoff_s)

    @classmethod
    def for_eval(
        cls,
        base: DataConfig | dict[str, Any] | None,
        *,
        image_size: int,
        patch_size: int,
        transform: Any = None,
        **fields: Any,
    ) -> DataConfig:
        """A model's evaluation transform, the one every job that reads a trained model uses (embed,
        analyze, fine-tuning's evaluation): short side to ``image_size / crop_fraction``, the center
        square, patchify (`build_dataset(train=False)`, `pipeline.data.decode`).

        ``base`` holds the settings the model was trained with: its stored preprocessing (`to_dict`,
        as exports and checkpoints carry it), a `DataConfig`, or None for the defaults. The model's
        ``image_size`` and ``patch_size`` replace the base's; ``transform`` (an `EvalOverrides`: the
        config of a job that takes that section) replaces each `EvalTransform` knob it sets (not None);
        ``fields`` set anything else (labels, bad-sample budget, storage options). Stored preprocessing
        never says where to decode: its ``decode_nodes`` (the labelled nodes of the cluster the model
        trained on) is dropped.
        """
        if not isinstance(base, DataConfig):
            base = cls.from_dict(base, decode_nodes=None) if base else cls()
        knobs = (f.name for f in dataclasses.fields(EvalTransform))
        given = {
            name: getattr(transform, name) for name in knobs if getattr(transform, name, None) is not None
        }
        config = dataclasses.replace(base, image_size=image_size, patch_size=patch_size, **given, **fields)
        # The budget as a number where it applies (what an embedding output's identity records), none where not.
        return dataclasses.replace(config, max_patches=config.patch_budget if config.native else None)


def sample_seed(seed: int, epoch: int, url: str, key: str) -> int:
    """A 64-bit seed that is a pure function of its arguments (no process-salted `hash`)."""
    digest = hashlib.blake2b(f"{seed}\0{epoch}\0{url}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_order(shards: list[str], seed: int, epoch: int) -> list[str]:
    """The shards permuted by (seed, epoch): same inputs, same order; another epoch, another order."""
    order = list(shards)
    random.Random(sample_seed(seed, epoch, "shard-order", "")).shuffle(order)
    return order


def shuffle_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of the consumer-side shuffle buffer for one (seed, epoch, rank)."""
    return sample_seed(seed, epoch, f"rank-{rank}", "local-shuffle") % (2**31)
