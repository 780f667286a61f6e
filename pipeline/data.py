"""The input pipeline of both jobs: `DataConfig`, shard order, and the one place that chains the stages.

    shards (in the order given) -> read: one task per shard, rows {key, url, image, label, error}
                                -> map_batches(preprocess_batch), fused into the read task
                                -> rows {key, url, patches uint8 (N, P*P*C), label int64, error}

Determinism: the dataset keeps ``preserve_order`` in its own context, so rows come shard by shard in
the given order and in tar order within a shard; train crops are seeded per (seed, epoch, url, key);
`shard_order` is a pure function of (shards, seed, epoch); the consumer-side shuffle buffer of
`iter_batches` is seeded per (seed, epoch, rank). The training loop builds one dataset per rank per
epoch from ``shard_order(...)[rank::world_size]``, which makes a resumed run match an uninterrupted one.

Ray is imported inside the functions that need it: this module (and `DataConfig`) imports without Ray.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.preprocess import RESAMPLE, preprocess_batch, sample_seed
from pipeline.rows import RowSpec
from pipeline.shards import ShardError, open_shard
from pipeline.tarstream import iter_samples, open_tar_stream

if TYPE_CHECKING:
    import ray.data

    from pipeline.badsamples import BadSamples

_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


@dataclass(frozen=True)
class DataConfig:
    """Everything that decides which pixels a sample becomes; saved with every checkpoint."""

    image_size: int = 224
    patch_size: int = 16
    # Train: random-resized-crop (area share, aspect w/h) + horizontal flip.
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True
    # Eval: short side to image_size / crop_fraction (224 -> 256), then the center square.
    crop_fraction: float = 0.875
    train_interpolation: str = "bilinear"
    eval_interpolation: str = "bicubic"
    jpeg_draft: bool = True  # DCT-domain downscale of JPEGs while the crop stays >= image_size
    reducing_gap: float | None = None  # PIL resize pre-reduction; None = exact filter over all pixels
    # Members: the image is the first of image_keys present; label from a member ("cls"), a .json
    # field ("json:label"), or None for unlabeled data.
    image_keys: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    label_key: str | None = "cls"
    require_labels: bool = True
    seed: int = 0
    shuffle_buffer: int = 1024  # samples in the consumer-side shuffle buffer; 0 disables it
    # Bad samples: the job fails once bad > max_bad_fraction * max(seen, bad_grace_samples).
    max_bad_fraction: float = 0.01
    bad_grace_samples: int = 1000
    max_image_pixels: int = 89_478_485  # decompression-bomb limit (PIL's default), checked from the header
    storage_options: dict | None = None  # fsspec options: {"client_kwargs": {"endpoint_url": ...}, ...}
    block_rows: int = 256  # samples per read block
    # Ray's target block size for this dataset: a decode batch is up to this much encoded data (often a
    # whole shard), an output block about this much patch data (~430 rows at 224 px, patch 14). Fewer,
    # larger blocks cost the consumer less per image: on 2 cores, 32 MiB gave 0.87x and 64 MiB 0.99x
    # the throughput of webdataset + DataLoader. Peak memory per read task is about 4 blocks.
    block_bytes: int = 64 << 20
    read_concurrency: int | None = None  # read tasks at once (None: as many as CPUs allow)

    def __post_init__(self) -> None:
        for name in ("scale", "ratio", "image_keys"):  # from_dict / JSON give lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "image_keys", tuple(k.lower().lstrip(".") for k in self.image_keys))
        problems = [
            (self.image_size <= 0 or self.patch_size <= 0, "image_size and patch_size must be positive"),
            (
                self.image_size % self.patch_size != 0,
                f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}; "
                "pick sizes that divide",
            ),
            (
                not 0 < self.scale[0] <= self.scale[1] <= 1,
                f"scale {self.scale} must satisfy 0 < lo <= hi <= 1",
            ),
            (not 0 < self.ratio[0] <= self.ratio[1], f"ratio {self.ratio} must satisfy 0 < lo <= hi"),
            (not 0 < self.crop_fraction <= 1, f"crop_fraction {self.crop_fraction} must be in (0, 1]"),
            (
                self.train_interpolation not in RESAMPLE or self.eval_interpolation not in RESAMPLE,
                f"interpolation must be one of {', '.join(RESAMPLE)}",
            ),
            (
                self.require_labels and self.label_key is None,
                "require_labels needs a label_key (e.g. 'cls' or 'json:label'); or set require_labels=False",
            ),
            (not 0 <= self.max_bad_fraction <= 1, "max_bad_fraction must be in [0, 1]"),
            (
                self.shuffle_buffer < 0 or self.block_rows <= 0,
                "shuffle_buffer >= 0 and block_rows > 0 please",
            ),
            (not self.image_keys, "image_keys must name at least one member extension, e.g. ('jpg',)"),
        ]
        for bad, message in problems:
            if bad:
                raise ValueError(f"DataConfig: {message}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def row_spec(self) -> RowSpec:
        return RowSpec(self.image_keys, self.label_key, self.require_labels)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values; secrets in ``storage_options`` are replaced by ``"***"``."""
        out = dataclasses.asdict(self)
        out["storage_options"] = _redact(self.storage_options)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any], **overrides: Any) -> DataConfig:
        """Inverse of `to_dict` (pass real ``storage_options`` as an override; saved ones are redacted)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"DataConfig has no field(s) {', '.join(unknown)}; remove them or update vitray")
        merged = {**values, **overrides}
        if merged.get("storage_options") and "***" in repr(merged["storage_options"]):
            merged["storage_options"] = None
        return cls(**merged)


def shard_order(shards: list[str], seed: int, epoch: int) -> list[str]:
    """The shards permuted by (seed, epoch): same inputs, same order; another epoch, another order."""
    order = list(shards)
    random.Random(sample_seed(seed, epoch, "shard-order", "")).shuffle(order)
    return order


def build_dataset(shards: list[str], config: DataConfig, *, train: bool, epoch: int = 0) -> ray.data.Dataset:
    """A streaming dataset of patch rows over ``shards`` in the given order, one read task per shard.

    Rows: ``key`` str, ``url`` str, ``patches`` uint8 ``(N, P*P*C)``, ``label`` int64 (-1 when absent),
    ``error`` str ("" when good; else the reason, with zero patches). Output order is deterministic:
    shard by shard as given, tar order inside a shard.
    """
    import ray.data

    from pipeline.tarsource import TarShardDatasource

    if not shards:
        raise ShardError("no shards to read; pass at least one shard URL (see pipeline.shards.expand_shards)")
    source = TarShardDatasource(
        list(shards), config.row_spec, storage_options=config.storage_options, block_rows=config.block_rows
    )
    # override_num_blocks = one per shard: Ray would otherwise split read outputs, which blocks fusion.
    ds = ray.data.read_datasource(
        source, override_num_blocks=len(shards), concurrency=config.read_concurrency
    )
    ds = ds.map_batches(
        preprocess_batch,
        batch_size=None,  # whole read blocks: keeps Read->MapBatches fused (a batch_size would split them)
        batch_format="numpy",
        zero_copy_batch=True,
        fn_kwargs={"config": config, "train": train, "epoch": epoch},
    )
    # This dataset's own context (a copy made at read time), not the process-global one.
    ds.context.execution_options.preserve_order = True
    ds.context.target_max_block_size = config.block_bytes
    # Reservation splits the CPU budget between operators and a shared pool; with our single fused
    # operator it kept about one task running on a 2-CPU node (1.1 busy cores of 2; 1.8 without it).
    ds.context.op_resource_reservation_enabled = False
    return ds


def shuffle_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of the consumer-side shuffle buffer for one (seed, epoch, rank)."""
    return sample_seed(seed, epoch, f"rank-{rank}", "local-shuffle") % (2**31)


def iter_batches(
    ds: ray.data.Dataset,
    batch_size: int,
    config: DataConfig,
    *,
    epoch: int,
    rank: int = 0,
    shuffle: bool,
    bad_samples: BadSamples | None = None,
    drop_last: bool = False,
    prefetch_batches: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Numpy batches of ``ds``; with ``shuffle``, through a seeded local shuffle buffer.

    With ``bad_samples``, error rows are recorded and removed (batches may then be smaller than
    ``batch_size``) and the bad-sample budget is checked after every batch and at the end.
    """
    use_buffer = shuffle and config.shuffle_buffer > 0
    batches = ds.iter_batches(
        batch_size=batch_size,
        batch_format="numpy",
        drop_last=drop_last,
        prefetch_batches=prefetch_batches,
        local_shuffle_buffer_size=config.shuffle_buffer if use_buffer else None,
        local_shuffle_seed=shuffle_seed(config.seed, epoch, rank) if use_buffer else None,
    )
    for batch in batches:
        if bad_samples is not None:
            batch = bad_samples.filter(batch)
            bad_samples.check_budget()
        yield batch
    if bad_samples is not None:
        bad_samples.check_budget(final=True)


def check_shards(shards: list[str], config: DataConfig, *, probe: int = 16) -> None:
    """Fail fast, before any Ray work, when the first shard cannot be what the job expects.

    Reads up to ``probe`` samples of the first shard: a `ShardError` if it cannot be opened, holds no
    image member, or (with ``require_labels``) carries no label member at all.
    """
    if not shards:
        raise ShardError("no shards to read; pass at least one shard URL")
    url, spec = shards[0], config.row_spec
    try:
        with open_shard(url, config.storage_options) as fileobj:
            samples = []
            for sample in iter_samples(open_tar_stream(fileobj, url)):
                samples.append(sample)
                if len(samples) >= probe:
                    break
    except OSError as e:
        raise ShardError(f"cannot open shard {url}: {e}; check the path and credentials") from e
    seen = sorted({ext for s in samples for ext in s.members})
    if not any(spec.image(s) is not None for s in samples):
        raise ShardError(
            f"shard {url} holds no image member among its first {len(samples)} samples (members: "
            f"{', '.join(seen) or 'none'}); set image_keys or point at image shards"
        )
    if spec.require_labels and not any(spec.label_member in s.members for s in samples):
        raise ShardError(
            f"shard {url} carries no label member .{spec.label_member} in its first {len(samples)} samples "
            f"(members: {', '.join(seen)}); set label_key, or run without labels (require_labels=False)"
        )


def _redact(value: Any, field: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact(v, field) for v in value]
    if value is not None and any(word in field.lower() for word in _SECRET_WORDS):
        return "***"
    return value
