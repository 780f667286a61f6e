"""Shard URLs: from what a user types to the list of tar files a job reads, and opening one of them.

`expand_shards` accepts, alone or comma-separated:

- a local file, or a directory (every .tar / .tar.gz / .tgz directly inside it, sorted)
- a glob: ``/data/train-*.tar``, ``s3://bucket/train-*.tar``
- a brace range or list: ``train-{000000..000127}.tar``, ``{train,val}-000000.tar`` (as in WebDataset),
  expanded lazily, at most `MAX_SHARDS_PER_URL` (1,000,000) names per URL
- ``s3://``, ``gs://`` or any other fsspec URL; credentials and endpoints come from the environment
  (e.g. ``AWS_ENDPOINT_URL``) or from the options of the `pipeline.storage.Location` given (a job's
  ``--storage-options``, e.g. ``{"client_kwargs": {"endpoint_url": ...}}``), which apply to every URL it lists

It checks that every shard exists (local shards one by one, stopping at the first missing one; remote
ones with one listing per directory, not one request per shard) and fails with a `ShardError` naming
what is wrong and what to do, before any Ray work starts.

A shard is its name, not the URL that reads it: `shard_id` is its URL without userinfo, query string or
fragment (a signed URL's signature, a SAS token), a local path as it is. Everything that names a shard
takes it from there: the ``url`` column of its rows (`pipeline.data.rows`), its samples' seeds and its
place in a checkpoint (its name within the dataset, `shard_name`), the embedding output's file names,
manifest and records. The query string reaches the storage that reads the shard and nothing else, so
the same shards signed again, or read from another store or disk, are the same shards.
"""

from __future__ import annotations

import glob as globlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any

from pipeline import compat
from pipeline.redaction import public_url
from pipeline.storage import Location, as_location, is_local, local_path

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
READ_BLOCK_BYTES = 8 << 20  # remote read size: few requests per shard, little memory
# Names one URL's braces may expand to: far above any real dataset's shard count (ImageNet-21k is
# ~2,000 shards of 1 GB), far below what would exhaust the driver's memory (~100 bytes a name).
MAX_SHARDS_PER_URL = 1_000_000
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


class ShardError(ValueError):
    """A shard URL that cannot be used; the message says what is wrong and what to do."""


def expand_shards(urls: Location | str | Sequence[str]) -> list[str]:
    """Every shard named by ``urls``, in order (directories and globs sorted), without duplicates; a
    Location's URL may name several (comma-separated), all reached with its options.

    Local shards come back as absolute paths (Ray workers may run in another directory); remote
    ones as full URLs with their protocol. Raises `ShardError` when a part matches nothing.
    """
    options = urls.options if isinstance(urls, Location) else {}
    parts = [str(urls)] if isinstance(urls, Location | str) else list(urls)
    items = [p.strip() for part in parts for p in split_top_level(part, ",") if p.strip()]
    if not items:
        raise ShardError("no shard URL given; pass a path, directory, glob or brace range of .tar shards")
    shards: list[str] = []
    for item in items:
        try:
            shards.extend(_expand_one(Location(item, options)))
        except RecursionError as e:  # braces nested thousands deep
            raise ShardError(f"braces nested too deeply in {item[:80]!r}; write plain ranges") from e
    return distinct(shards)


def shard_id(url: str) -> str:
    """A shard's name: its URL without the userinfo, query string or fragment that reach it (a signed
    URL's signature, a SAS token; `pipeline.redaction.public_url`), a local path as it is. What names the
    shard in every output, record and seed (module docstring); the URL whole is only for reading it."""
    return public_url(url)


def distinct(shards: Iterable[str]) -> list[str]:
    """``shards`` in order, each once: a URL given twice is read once (its samples would repeat). Two URLs
    of one name (`shard_id`: the same shard signed twice) are a `ShardError`: which one reads it?"""
    first: dict[str, str] = {}
    for url in shards:
        name = shard_id(url)
        if first.setdefault(name, url) != url:
            raise ShardError(
                f"shard {name} is given twice, by URLs that differ only in their query string; a shard is "
                "named by its URL without it: give each shard once"
            )
    return list(first.values())


def dataset_root(shards: Sequence[str]) -> str:
    """The directory (or URL prefix) that holds every shard of a dataset: the longest common prefix of
    their names (`shard_id`), cut back to its last ``/``. A shard's name relative to it (`shard_name`) is
    what seeds its crops, masks and augmentations, so a dataset copied to another directory or bucket, or
    signed again, trains the same."""
    common: list[str] | None = None
    for url in shards:
        parts = shard_id(url).split("/")[:-1]  # the directories above the shard
        if common is None:
            common = parts
            continue
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return "/".join(common) + "/" if common else ""


def shard_name(url: str, root: str) -> str:
    """The shard's name (`shard_id`) relative to its dataset's `dataset_root` (its whole name when it is
    not under ``root``)."""
    name = shard_id(url)
    return name[len(root) :] if root and name.startswith(root) else name


def shard_names(shards: Sequence[str]) -> list[str]:
    """Every shard's name within its dataset (`shard_name` under their `dataset_root`): what a checkpoint
    fingerprints a shard list by."""
    root = dataset_root(shards)
    return [shard_name(url, root) for url in shards]


def split_top_level(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside braces: ``"a{1,2},b"`` -> ``["a{1,2}", "b"]``."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ShardError(f"unbalanced braces in {text!r}; write ranges as train-{{000000..000127}}.tar")
    out.append(text[start:])
    return out


def expand_braces(pattern: str) -> Iterator[str]:
    """Brace expansion as WebDataset does it: ``{000..002}`` keeps zero padding, ``{a,b}`` lists.

    Several groups expand as a product, leftmost slowest: ``{a,b}-{0..1}`` -> a-0, a-1, b-0, b-1.
    The names come lazily; a pattern naming more than `MAX_SHARDS_PER_URL` is a `ShardError` at once,
    before any name is made (``{0..999999999}`` would otherwise hold gigabytes of names).
    """
    count = brace_count(pattern)
    if count > MAX_SHARDS_PER_URL:
        raise ShardError(
            f"{pattern!r} names {count:,} shards, more than the {MAX_SHARDS_PER_URL:,} one URL may name; "
            "check the range, or split it into several comma-separated URLs"
        )
    return _iter_braces(pattern)


def brace_count(pattern: str) -> int:
    """How many names ``pattern`` expands to, counted without making them."""
    group = _first_group(pattern)
    if group is None:
        return 1
    _, body, tail = group
    ranged = _range(body, pattern)
    n = len(ranged[0]) if ranged else sum(brace_count(part) for part in split_top_level(body, ","))
    return n * brace_count(tail)


def _iter_braces(pattern: str) -> Iterator[str]:
    group = _first_group(pattern)
    if group is None:
        yield pattern
        return
    head, body, tail = group
    ranged = _range(body, pattern)
    if ranged:
        numbers, width = ranged
        choices: Iterable[str] = (str(i).zfill(width) for i in numbers)
    else:
        choices = (c for part in split_top_level(body, ",") for c in _iter_braces(part))
    for choice in choices:
        for rest in _iter_braces(tail):
            yield head + choice + rest


def _first_group(pattern: str) -> tuple[str, str, str] | None:
    """``"a{1..2}b{x}"`` -> ``("a", "1..2", "b{x}")``; None without braces."""
    start = pattern.find("{")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            return pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    raise ShardError(f"unbalanced braces in {pattern!r}; write ranges as train-{{000000..000127}}.tar")


def _range(body: str, pattern: str) -> tuple[range, int] | None:
    """``"007..010"`` -> ``(range(7, 11), 3)``: the numbers and their zero-padded width (0: none)."""
    match = _RANGE.match(body)
    if not match:
        return None
    lo, hi = match.group(1), match.group(2)
    if int(hi) < int(lo):
        raise ShardError(f"brace range {{{body}}} in {pattern!r} runs backwards; write {{{hi}..{lo}}}")
    width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
    return range(int(lo), int(hi) + 1), width


def is_shard_name(path: str) -> bool:
    return path.lower().endswith(SHARD_SUFFIXES)


def open_shard(shard: Location | str) -> IO[bytes]:
    """A binary file object for one shard (read sequentially; the caller closes it)."""
    if is_local(shard):
        return open(local_path(shard), "rb", buffering=1 << 20)
    fs, path = _filesystem(as_location(shard))
    # Read-ahead caching suits a tar stream read front to back exactly once.
    return fs.open(path, "rb", block_size=READ_BLOCK_BYTES, cache_type="readahead")


def _expand_one(where: Location) -> list[str]:
    item = where.url
    candidates = expand_braces(item)
    if is_local(item):
        return _expand_local((local_path(c) for c in candidates), item)
    fs, _ = _filesystem(where)
    out: list[str] = []
    plain: list[str] = []
    for candidate in candidates:
        path = compat.strip_protocol(fs, candidate)
        if globlib.has_magic(path):
            found = sorted(p for p in _call(fs.glob, path, item) if _call(fs.isfile, p, item))
            if not found:
                raise ShardError(f"{candidate} matches no files; check the pattern and bucket")
            out.extend(fs.unstrip_protocol(p) for p in found)
        elif brace_count(item) == 1 and _call(fs.isdir, path, item):
            found = sorted(p for p in _call(fs.ls, path, item, detail=False) if is_shard_name(p))
            if not found:
                raise ShardError(f"{candidate} holds no .tar/.tar.gz/.tgz shards; point at the shard files")
            out.extend(fs.unstrip_protocol(p) for p in found)
        else:
            plain.append(path)
    if plain:
        _check_remote_exist(fs, plain, item)
        out.extend(fs.unstrip_protocol(p) for p in plain)
    return out


def _expand_local(paths: Iterable[str], item: str) -> list[str]:
    """Every shard of ``paths``, checked one by one: the first missing one is the error, so that a long
    range of shards that are not there fails at once instead of after a stat of each."""
    out: list[str] = []
    for path in paths:
        path = os.path.abspath(os.path.expanduser(path))
        if globlib.has_magic(path):
            found = sorted(p for p in globlib.glob(path) if os.path.isfile(p))
            if not found:
                raise ShardError(f"{path} matches no files; check the pattern")
            out.extend(found)
        elif os.path.isdir(path):
            found = sorted(os.path.join(path, n) for n in os.listdir(path) if is_shard_name(n))
            if not found:
                raise ShardError(f"directory {path} holds no .tar/.tar.gz/.tgz shards; point at the shards")
            out.extend(p for p in found if os.path.isfile(p))
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise ShardError(f"shard not found: {path} (from {item!r}); check the path or range")
    return out


def _check_remote_exist(fs: Any, paths: list[str], item: str) -> None:
    """One listing per parent directory instead of one request per shard (ranges can be 100k long)."""
    by_parent: dict[str, list[str]] = {}
    for path in paths:
        by_parent.setdefault(path.rsplit("/", 1)[0], []).append(path)
    missing: list[str] = []
    for parent, children in by_parent.items():
        try:
            listed = {p.rstrip("/") for p in _call(fs.ls, parent, item, detail=False)}
        except ShardError:
            listed = set()
        missing.extend(c for c in children if c.rstrip("/") not in listed)
    if missing:
        more = f" and {len(missing) - 1} more of {len(paths)}" if len(missing) > 1 else ""
        raise ShardError(
            f"shard not found: {fs.unstrip_protocol(missing[0])}{more} (from {item!r}); "
            "check the URL, range and credentials"
        )


def _filesystem(where: Location) -> tuple[Any, str]:
    try:
        return where.fs()
    except ValueError as e:
        raise ShardError(f"cannot read {where.url!r}: {e}") from e


def _call(fn: Any, path: str, item: str, **kwargs: Any) -> Any:
    """A filesystem call whose failure (credentials, network, permissions) becomes a one-line ShardError."""
    try:
        return fn(path, **kwargs)
    except FileNotFoundError as e:
        raise ShardError(f"shard not found: {path} (from {item!r}); check the URL") from e
    except Exception as e:
        kind = type(e).__name__
        first = str(e).splitlines()[0] if str(e) else ""
        raise ShardError(
            f"cannot list {path} (from {item!r}): {kind}: {first}; "
            "check credentials, endpoint (AWS_ENDPOINT_URL or --storage-options) and network"
        ) from e
