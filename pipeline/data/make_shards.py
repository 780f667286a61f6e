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
from pathlib import Path

from pipeline import cli
from pipeline.data.shards import SHARD_SUFFIXES
from pipeline.data.synthetic import CLASSES, write_synthetic_shards
from pipeline.data.writing import ShardSet, brace_url, class_folders, folder_samples, write_shards
from pipeline.storage import check_output_dir, is_temporary


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/make_shards.py`'s command line."""
    parser = argparse.ArgumentParser(
        prog="make_shards.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--synthetic", type=int, metavar="N", help="generate N synthetic images of visibly different classes"
    )
    source.add_argument(
        "--from-folder",
        metavar="DIR",
        help="read DIR/<class>/<image>; labels are class indices in sorted class-name order",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write the shards into")
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=128,
        metavar="N",
        help="samples per shard; use at least as many shards as training workers (default: %(default)s)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=64,
        metavar="N",
        help="side of the generated images in pixels, --synthetic only (default: %(default)s)",
    )
    parser.add_argument(
        "--num-classes",
        type=int,
        default=len(CLASSES),
        metavar="N",
        help=f"number of synthetic classes, 1 to {len(CLASSES)}, --synthetic only (default: %(default)s)",
    )
    parser.add_argument(
        "--max-size",
        type=int,
        metavar="N",
        help="re-encode folder images whose short side exceeds N down to N (default: keep original bytes)",
    )
    parser.add_argument(
        "--format",
        choices=("jpeg", "png"),
        default="jpeg",
        help="encoding of generated or re-encoded images (default: %(default)s)",
    )
    parser.add_argument(
        "--quality", type=int, default=90, metavar="Q", help="JPEG quality, 1 to 95 (default: %(default)s)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic content and of the folder's sample order (default: %(default)s)",
    )
    parser.add_argument(
        "--prefix", default="train", help="shard file name prefix: <prefix>-000000.tar (default: %(default)s)"
    )
    parser.add_argument("--gzip", action="store_true", help="write gzip-compressed .tar.gz shards")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete existing <prefix>-*.tar* shards in --out first; write into an --out holding other files",
    )
    return parser


def parse_args(argv: list[str], description: str | None = None) -> argparse.Namespace:
    """The arguments, checked: a value that cannot work exits with argparse's one line (exit code 2)."""
    p = parser(description)
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        p.error(str(e))
    return args


def check(args: argparse.Namespace) -> None:
    """A ValueError (one line) for a value that cannot work."""
    if args.samples_per_shard <= 0:
        raise ValueError("--samples-per-shard must be positive")
    if args.synthetic is not None and args.synthetic <= 0:
        raise ValueError("--synthetic needs a positive number of images")
    if not 1 <= args.num_classes <= len(CLASSES):
        raise ValueError(f"--num-classes must be between 1 and {len(CLASSES)}")
    if not 1 <= args.quality <= 95:
        raise ValueError("--quality must be between 1 and 95")
    if args.image_size < 1 or (args.max_size is not None and args.max_size < 1):
        raise ValueError("--image-size and --max-size must be at least 1 pixel")
    if not args.prefix or args.prefix.startswith(".") or set(args.prefix) & set("/\\*?[]{}"):
        raise ValueError(
            f"--prefix {args.prefix!r} must be a plain file name part (e.g. train): shards go in --out"
        )


def command(args: argparse.Namespace) -> int:
    """`jobs/make_shards.py`: check, write the shards, and print what was written and the ``--data``
    that reads them (its last line)."""
    start = time.perf_counter()
    check(args)
    shard_set = make_shards(args, start_work=cli.start_work)
    print(
        f"wrote {len(shard_set.urls)} shards ({len(shard_set.keys)} samples, {shard_set.num_classes} classes"
        + (f", {len(shard_set.skipped)} unreadable file(s) skipped" if shard_set.skipped else "")
        + f") to {Path(args.out).resolve()} in {time.perf_counter() - start:.1f}s; use:"
    )
    print(f"  --data '{brace_url(shard_set.urls)}'")
    return 0


def owns(entries: dict[str, bool]) -> bool:
    """Whether a directory holds only what this job writes: shards (of any prefix) and temporaries."""
    return all(
        not is_dir and (name.lower().endswith(SHARD_SUFFIXES) or is_temporary(name))
        for name, is_dir in entries.items()
    )


def make_shards(args: argparse.Namespace, start_work: Callable[[], None] = lambda: None) -> ShardSet:
    """Write the shards ``args`` ask for into ``args.out``. A ValueError (one line) for an ``--out`` that
    is a filesystem root, holds files this job did not write or already holds shards (without
    ``--overwrite``), or a folder that cannot be read; nothing is written then. ``start_work`` is called
    once the checks are done, before the first write (`pipeline.cli.start_work`: errors after it are a
    failed run, not bad input)."""
    out = Path(args.out).resolve()
    check_output_dir(str(out), job="make_shards.py", owns=owns, overwrite=args.overwrite)
    existing = sorted(out.glob(f"{args.prefix}-*.tar*")) if out.is_dir() else []
    if existing and not args.overwrite:
        raise ValueError(
            f"{out} already holds {len(existing)} {args.prefix}-* shards; pass --overwrite or another --out"
        )
    classes = [p.name for p in class_folders(args.from_folder)] if args.synthetic is None else []
    start_work()
    for path in existing:
        path.unlink() if path.is_file() else shutil.rmtree(path)
    if args.synthetic is not None:
        return write_synthetic_shards(
            out,
            args.synthetic,
            samples_per_shard=args.samples_per_shard,
            image_size=args.image_size,
            num_classes=args.num_classes,
            seed=args.seed,
            fmt=args.format,
            quality=args.quality,
            gzip=args.gzip,
            prefix=args.prefix,
        )
    shard_set = ShardSet(dir=str(out), num_classes=len(classes), class_names=classes)
    samples = folder_samples(
        args.from_folder,
        seed=args.seed,
        max_size=args.max_size,
        fmt=args.format,
        quality=args.quality,
        skipped=shard_set.skipped,
    )
    shard_set.urls = write_shards(
        _tracked(samples, shard_set),
        out,
        prefix=args.prefix,
        samples_per_shard=args.samples_per_shard,
        gzip=args.gzip,
    )
    if not shard_set.keys:
        raise ValueError(
            f"no image in {args.from_folder} could be read ({len(shard_set.skipped)} file(s) skipped, first: "
            f"{shard_set.skipped[0]}); nothing was written"
        )
    return shard_set


def _tracked(samples: Iterator[tuple[str, dict[str, bytes]]], shard_set: ShardSet) -> Iterator:
    """Pass samples through, noting each key and label in ``shard_set``."""
    for key, members in samples:
        shard_set.keys.append(key)
        shard_set.labels[key] = int(members["cls"])
        yield key, members
