"""The make_shards job: its command line, its checks, and the shards it writes (`jobs/make_shards.py`).

Writes WebDataset shards from an image folder (one subfolder per class) or from the synthetic class
generator. Each sample is ``<key>.jpg`` (or .png / .webp), ``<key>.cls`` (the class index as text) and
``<key>.json`` (``{"label", "class", ...}``); shards are ``<prefix>-000000.tar``, ... . The same
arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline import cli, settings
from pipeline.data.config import MAX_IMAGE_SIZE
from pipeline.data.shards import SHARD_SUFFIXES
from pipeline.data.synthetic import CLASSES, write_synthetic_shards
from pipeline.data.writing import ShardSet, brace_url, class_folders, folder_samples, write_shards
from pipeline.settings import MAX_COUNT, MAX_SEED, setting
from pipeline.storage import check_output_dir, is_temporary

FORMATS = ("jpeg", "png")  # how generated or re-encoded images are stored


@dataclass(frozen=True)
class MakeShardsConfig(settings.Settings):
    """One make_shards run; ``jobs/make_shards.py`` maps its flags onto it field by field."""

    out: str = setting(help="directory to write the shards into", metavar="DIR", required=True)
    synthetic: int | None = setting(
        None, "generate N synthetic images of visibly different classes", metavar="N", ge=1, le=MAX_COUNT
    )
    from_folder: str | None = setting(
        None, "read DIR/<class>/<image>; labels are class indices in sorted class-name order", metavar="DIR"
    )
    samples_per_shard: int = setting(
        128, "samples per shard; use at least as many shards as training workers", metavar="N", ge=1,
        le=MAX_COUNT,
    )  # fmt: skip
    image_size: int = setting(
        64, "side of the generated images in pixels, --synthetic only", metavar="N", ge=1, le=MAX_IMAGE_SIZE
    )
    num_classes: int = setting(
        len(CLASSES), "number of synthetic classes, --synthetic only", metavar="N", ge=1, le=len(CLASSES)
    )
    max_size: int | None = setting(
        None,
        "re-encode folder images whose short side exceeds N down to N (none: keep original bytes)",
        metavar="N",
        ge=1,
        le=MAX_IMAGE_SIZE,
    )
    format: str = setting("jpeg", "encoding of generated or re-encoded images", choices=FORMATS)
    quality: int = setting(90, "JPEG quality", metavar="Q", ge=1, le=95)
    seed: int = setting(
        0, "seed of the synthetic content and of the folder's sample order", ge=0, le=MAX_SEED
    )
    prefix: str = setting("train", "shard file name prefix: <prefix>-000000.tar")
    gzip: bool = setting(False, "write gzip-compressed .tar.gz shards")
    overwrite: bool = setting(
        False,
        "delete existing <prefix>-*.tar* shards in --out first; write into an --out holding other files",
    )

    def validate(self) -> None:
        super().validate()
        if (self.synthetic is None) == (self.from_folder is None):
            raise ValueError("pass one source: --synthetic N (generated images) or --from-folder DIR")
        if not self.prefix or self.prefix.startswith(".") or set(self.prefix) & set("/\\*?[]{}"):
            raise ValueError(
                f"--prefix {self.prefix!r} must be a plain file name part (e.g. train): shards go in --out"
            )


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/make_shards.py`'s command line: the settings of `MakeShardsConfig` (one process, no Ray)."""
    return cli.job_parser(
        "make_shards.py", description, MakeShardsConfig, defaults=MakeShardsConfig(out=""), ray=False
    )


def parse_args(argv: list[str], description: str | None = None) -> MakeShardsConfig:
    """The config the arguments give, checked: a value that cannot work exits with argparse's line
    (exit code 2)."""
    p = parser(description)
    config = MakeShardsConfig(**cli.overrides(p.parse_args(argv), MakeShardsConfig))
    try:
        config.validate()
    except ValueError as e:
        p.error(str(e))
    return config


def command(args: argparse.Namespace) -> int:
    """`jobs/make_shards.py`: check, write the shards, and print what was written and the ``--data``
    that reads them (its last line)."""
    start = time.perf_counter()
    if (config := cli.configured(args, MakeShardsConfig)) is None:
        return 0
    config.validate()
    shard_set = make_shards(config, start_work=cli.start_work)
    print(
        f"wrote {len(shard_set.urls)} shards ({len(shard_set.keys)} samples, {shard_set.num_classes} classes"
        + (f", {len(shard_set.skipped)} unreadable file(s) skipped" if shard_set.skipped else "")
        + f") to {Path(config.out).resolve()} in {time.perf_counter() - start:.1f}s; use:"
    )
    print(f"  --data '{brace_url(shard_set.urls)}'")
    return 0


def owns(entries: dict[str, bool]) -> bool:
    """Whether a directory holds only what this job writes: shards (of any prefix) and temporaries."""
    return all(
        not is_dir and (name.lower().endswith(SHARD_SUFFIXES) or is_temporary(name))
        for name, is_dir in entries.items()
    )


def make_shards(config: MakeShardsConfig, start_work: Callable[[], None] = lambda: None) -> ShardSet:
    """Write the shards ``config`` asks for into ``config.out``. A ValueError (one line) for an ``--out`` that
    is a filesystem root, holds files this job did not write or already holds shards (without
    ``--overwrite``), or a folder that cannot be read; nothing is written then. ``start_work`` is called
    once the checks are done, before the first write (`pipeline.cli.start_work`: errors after it are a
    failed run, not bad input)."""
    out = Path(config.out).resolve()
    check_output_dir(str(out), job="make_shards.py", owns=owns, overwrite=config.overwrite)
    existing = sorted(out.glob(f"{config.prefix}-*.tar*")) if out.is_dir() else []
    if existing and not config.overwrite:
        raise ValueError(
            f"{out} already holds {len(existing)} {config.prefix}-* shards; pass --overwrite or another --out"
        )
    classes = [p.name for p in class_folders(config.from_folder)] if config.synthetic is None else []
    start_work()
    for path in existing:
        path.unlink() if path.is_file() else shutil.rmtree(path)
    if config.synthetic is not None:
        return write_synthetic_shards(
            out,
            config.synthetic,
            samples_per_shard=config.samples_per_shard,
            image_size=config.image_size,
            num_classes=config.num_classes,
            seed=config.seed,
            fmt=config.format,
            quality=config.quality,
            gzip=config.gzip,
            prefix=config.prefix,
        )
    shard_set = ShardSet(dir=str(out), num_classes=len(classes), class_names=classes)
    samples = folder_samples(
        config.from_folder,
        seed=config.seed,
        max_size=config.max_size,
        fmt=config.format,
        quality=config.quality,
        skipped=shard_set.skipped,
    )
    shard_set.urls = write_shards(
        _tracked(samples, shard_set),
        out,
        prefix=config.prefix,
        samples_per_shard=config.samples_per_shard,
        gzip=config.gzip,
    )
    if not shard_set.keys:
        raise ValueError(
            f"no image in {config.from_folder} could be read ({len(shard_set.skipped)} file(s) skipped, first: "
            f"{shard_set.skipped[0]}); nothing was written"
        )
    return shard_set


def _tracked(samples: Iterator[tuple[str, dict[str, bytes]]], shard_set: ShardSet) -> Iterator:
    """Pass samples through, noting each key and label in ``shard_set``."""
    for key, members in samples:
        shard_set.keys.append(key)
        shard_set.labels[key] = int(members["cls"])
        yield key, members
