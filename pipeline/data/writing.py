"""Writing WebDataset shards: fixed-size tar (or tar.gz) files of samples, byte-for-byte reproducible.

A sample is a key plus members ``{extension: bytes}``; it is written as ``<key>.<extension>`` tar
members, consecutive, extensions sorted. Shards are ``<prefix>-000000.tar``, ``<prefix>-000001.tar``, ...
written under a temporary name and renamed when complete, so a reader never sees half a shard. Headers
carry no time, owner or host, so the same samples give the same bytes.

`folder_samples` turns an image folder with one subfolder per class into samples, keeping the original
encoded bytes of JPEG, PNG and WebP files.
"""

from __future__ import annotations

import gzip as _gzip  # `gzip` is the flag that asks for it
import io
import json
import os
import random
import re
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from pipeline.storage import temporary_name

KEPT_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # stored as they are
_NUMBERED = re.compile(r"^(.*?)(\d+)(\.tar(?:\.gz)?)$")
FOLDER_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm")


@dataclass
class ShardSet:
    """What a writer produced: where, which shard files, and which samples with which labels."""

    dir: str
    urls: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    num_classes: int = 0
    image_size: int | None = None
    class_names: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files of a folder no image could be read from

    @property
    def brace_url(self) -> str:
        """One URL naming every shard, e.g. ``/data/train-{000000..000003}.tar``."""
        return brace_url(self.urls)


class ShardWriter:
    """Append samples; a new shard starts every ``samples_per_shard`` samples. Use as a context manager."""

    def __init__(
        self, out_dir: str | Path, *, prefix: str = "train", samples_per_shard: int = 1000, gzip: bool = False
    ):
        if samples_per_shard <= 0:
            raise ValueError(f"samples_per_shard must be positive, got {samples_per_shard}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.samples_per_shard, self.gzip = prefix, samples_per_shard, gzip
        self.urls: list[str] = []
        self._tar: tarfile.TarFile | None = None
        self._raw: io.BufferedWriter | None = None
        self._zip: _gzip.GzipFile | None = None
        self._count = 0

    def write(self, key: str, members: dict[str, bytes]) -> None:
        if "." in key.rsplit("/", 1)[-1]:
            raise ValueError(f"sample key {key!r} contains a dot; WebDataset keys end at the first dot")
        if self._tar is None or self._count == self.samples_per_shard:
            self._finish_shard()
            self._start_shard()
        assert self._tar is not None
        for ext in sorted(members):
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode, info.mtime = len(members[ext]), 0o644, 0
            self._tar.addfile(info, io.BytesIO(members[ext]))
        self._count += 1

    def close(self) -> list[str]:
        """Finish the last shard; returns every shard path written."""
        self._finish_shard()
        return self.urls

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._raw is not None:  # leave no partial shard behind
            self._raw.close()
            os.unlink(self._raw.name)
            self.urls.pop()

    def _start_shard(self) -> None:
        suffix = ".tar.gz" if self.gzip else ".tar"
        path = self.out_dir / f"{self.prefix}-{len(self.urls):06d}{suffix}"
        self.urls.append(str(path))
        self._raw = open(temporary_name(path), "wb")  # noqa: SIM115 - closed in _finish_shard
        # The gzip header names the shard, not the temporary file it is written as, and holds mtime=0:
        # the bytes depend on neither the random temporary name nor when they were written.
        self._zip = (
            _gzip.GzipFile(filename=path.name, fileobj=self._raw, mode="wb", mtime=0) if self.gzip else None
        )
        self._tar = tarfile.open(fileobj=self._zip or self._raw, mode="w", format=tarfile.GNU_FORMAT)  # noqa: SIM115

    def _finish_shard(self) -> None:
        if self._tar is None or self._raw is None:
            return
        self._tar.close()
        if self._zip is not None:
            self._zip.close()
        self._raw.close()
        os.replace(self._raw.name, self.urls[-1])
        self._tar = self._raw = self._zip = None
        self._count = 0


def write_shards(
    samples: Iterable[tuple[str, dict[str, bytes]]],
    out_dir: str | Path,
    *,
    prefix: str = "train",
    samples_per_shard: int = 1000,
    gzip: bool = False,
) -> list[str]:
    """Write ``(key, members)`` samples as shards; returns the shard paths."""
    with ShardWriter(out_dir, prefix=prefix, samples_per_shard=samples_per_shard, gzip=gzip) as writer:
        for key, members in samples:
            writer.write(key, members)
    return writer.urls


def tar_bytes(members: Iterable[tuple[str, bytes]], *, gzip: bool = False) -> bytes:
    """A tar (or tar.gz) of the named members exactly as given: any names, order or duplicates."""
    raw = io.BytesIO()
    zipped = _gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if gzip else None
    with tarfile.open(fileobj=zipped or raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    if zipped is not None:
        zipped.close()
    return raw.getvalue()


def brace_url(urls: list[str]) -> str:
    """``[.../train-000000.tar, ..., .../train-000003.tar]`` -> ``.../train-{000000..000003}.tar``."""
    if len(urls) <= 1:
        return urls[0] if urls else ""
    first, last = _NUMBERED.match(urls[0]), _NUMBERED.match(urls[-1])
    if not first or not last or (first[1], first[3]) != (last[1], last[3]):
        return ",".join(urls)
    return f"{first[1]}{{{first[2]}..{last[2]}}}{first[3]}"


def class_folders(root: str | Path) -> list[Path]:
    """The class subfolders of an image folder, sorted by name (label = position in this list)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; pass a folder with one subfolder of images per class")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"{root} has no class subfolders; put each class's images in root/<class>/")
    return classes


def folder_samples(
    root: str | Path,
    *,
    seed: int = 0,
    max_size: int | None = None,
    fmt: str = "jpeg",
    quality: int = 90,
    skipped: list[str] | None = None,
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Samples ``(key, {image, cls, json})`` from ``root/<class>/<image>``, in a seeded shuffled order.

    JPEG, PNG and WebP bytes are kept as they are; other formats (and, with ``max_size``, images
    whose short side is larger) are re-encoded as ``fmt``. Files PIL cannot open are skipped, each
    said and appended to ``skipped``.
    """
    classes = class_folders(root)
    files = [
        (label, path)
        for label, folder in enumerate(classes)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix.lower() in FOLDER_SUFFIXES
    ]
    if not files:
        raise ValueError(f"{root} holds no images ({', '.join(FOLDER_SUFFIXES)}) in its class subfolders")
    random.Random(seed).shuffle(files)  # mixed classes in every shard, so shard-level shuffling suffices
    for index, (label, path) in enumerate(files):
        data = path.read_bytes()
        try:
            with Image.open(io.BytesIO(data)) as im:
                kept = KEPT_FORMATS.get(im.format or "")
                if kept is None or (max_size is not None and min(im.size) > max_size):
                    data, kept = _reencode(im, max_size, fmt, quality), "png" if fmt == "png" else "jpg"
        except (OSError, ValueError):
            print(f"skipping {path}: not an image PIL can open")
            if skipped is not None:
                skipped.append(str(path))
            continue
        meta = {"label": label, "class": classes[label].name, "path": str(path.relative_to(root))}
        yield f"{index:08d}", {kept: data, "cls": str(label).encode(), "json": json.dumps(meta).encode()}


def _reencode(im: Image.Image, max_size: int | None, fmt: str, quality: int) -> bytes:
    im = im.convert("RGB")
    if max_size is not None and min(im.size) > max_size:
        scale = max_size / min(im.size)
        im = im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    im.save(out, format="PNG" if fmt == "png" else "JPEG", quality=quality)
    return out.getvalue()
