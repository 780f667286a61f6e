"""Tar streams -> members -> WebDataset samples, read front to back exactly once (pure Python, no Ray).

The parser is our own rather than `tarfile`'s streaming mode for two reasons: `tarfile` ends silently
when a shard is cut inside a member header (so a truncated shard would look complete), and it builds a
`TarInfo` per member that we do not need. We parse the ustar header, GNU long names (``L``) and pax
``path``/``size`` records; every other member kind (directories, links) is skipped. Member payloads are
kept as bytes and never interpreted here: nothing from a shard is ever unpickled.

Grouping follows the WebDataset rules: a member ``dir/abc.seg.jpg`` belongs to sample key ``dir/abc``
with extension ``seg.jpg`` (everything after the first dot of the file name, lower-cased); members of a
sample are consecutive; names without a dot (or starting with one) are ignored.

Problems become samples with ``error`` set, never exceptions, so a reader keeps every good sample:
``duplicate member``, ``split sample`` (a key seen again after other keys), ``member too large``, and,
once per shard, ``truncated tar`` / ``corrupt tar``, keyed by the member cut or damaged (key "" when
the stream stops in a header or padding). Every sample whose members all end before that point is kept.
A storage failure is no problem of the data: it raises `ShardReadError`, and the reader decides.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")  # regular file, old-style regular file, contiguous file
_METADATA = (b"L", b"K", b"x", b"g")  # GNU long name / long link, pax per-member / global records
# A larger member is skipped unread (bounds a read task's memory on hostile input); the limit still
# admits an uncompressed RGB image at the default decompression-bomb limit (2**28 / 3 pixels).
MAX_MEMBER_BYTES = 512 << 20
MAX_METADATA_BYTES = 1 << 20  # a long name or pax record this large is no real tar's: the shard is corrupt
_GZIP_MAGIC = b"\x1f\x8b"


class TarStreamError(Exception):
    """The stream cannot be parsed further; its message starts with the reason category. ``member``
    names the member whose data was cut or damaged (None when it stopped in or between headers)."""

    def __init__(self, message: str, member: str | None = None):
        super().__init__(message)
        self.member = member


class ShardReadError(OSError):
    """Storage failed mid-stream (network, service): not the shard's fault, so a reader may try again.
    Unlike `TarStreamError` it is raised out of `iter_samples`, not turned into an error sample."""


@dataclass
class Sample:
    """One WebDataset sample: its key, wanted members (extension -> bytes), and an error or ""."""

    key: str
    members: dict[str, bytes] = field(default_factory=dict)
    error: str = ""


def split_name(name: str) -> tuple[str, str] | None:
    """``"dir/abc.seg.jpg"`` -> ``("dir/abc", "seg.jpg")``; None for names without an extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:  # no dot, or a hidden file such as ".DS_Store"
        return None
    return name[:dot], name[dot + 1 :].lower()


def open_tar_stream(fileobj: IO[bytes], url: str = "") -> IO[bytes]:
    """Uncompressed tar bytes from ``fileobj``: gzip is detected by its magic bytes (or the name)."""
    gz = url.lower().endswith((".gz", ".tgz"))
    if fileobj.seekable():
        gz = fileobj.read(2) == _GZIP_MAGIC
        fileobj.seek(0)
    return gzip.GzipFile(fileobj=fileobj, mode="rb") if gz else fileobj


def iter_members(
    stream: IO[bytes], want: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, bytes | None, int]]:
    """``(name, data, size)`` for each regular member; ``data`` is None when ``want(name)`` is false
    or the member is larger than `MAX_MEMBER_BYTES` (then it is skipped, not held in memory).

    Raises `TarStreamError` ("truncated tar: ..." or "corrupt tar: ...") where the stream stops making
    sense; members before that point have been yielded.
    """
    offset = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    cut_in_padding = False
    while True:
        if cut_in_padding:  # raised only now: the member before the cut has been yielded whole
            raise TarStreamError(f"truncated tar: shard ends inside padding before byte {offset}")
        header = _read(stream, BLOCK, offset)
        if not header:
            return  # ends on a member boundary without the end-of-archive blocks: accept what is there
        if len(header) < BLOCK:
            raise TarStreamError(f"truncated tar: shard ends inside a member header at byte {offset}")
        if header == _ZERO_BLOCK:
            return  # end-of-archive marker
        _check_checksum(header, offset)
        kind = header[156:157]
        name = long_name or pax.get("path") or _header_name(header)
        size = _number(header[124:136], offset)
        if "size" in pax and kind not in _METADATA:
            size = _pax_size(pax["size"], offset)
        offset += BLOCK
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if kind in _METADATA:  # a cut here is no member's: the name it carries is not known yet
            if size > MAX_METADATA_BYTES:  # read whole below, so refused before any of it is read
                raise TarStreamError(
                    f"corrupt tar: a {size}-byte name or pax record at byte {offset - BLOCK} "
                    f"(limit {MAX_METADATA_BYTES})"
                )
            data = _read_exact(stream, padded, offset, None)[:size]
            offset += padded
            if kind == b"L":
                long_name = data.split(b"\0", 1)[0].decode("utf-8", "replace")
            elif kind == b"x":
                pax = _pax_records(data, offset)
            continue
        long_name, pax = None, {}
        if kind in _REGULAR and size <= MAX_MEMBER_BYTES and (want is None or want(name)):
            data = _read_exact(stream, size, offset, name)
        else:
            data = None
            _skip(stream, size, offset, name)
        # The padding holds no data: a cut inside it leaves this member whole.
        try:
            cut_in_padding = len(_read(stream, padded - size, offset + size)) < padded - size
        except TarStreamError as e:
            if not str(e).startswith("truncated tar"):
                raise
            cut_in_padding = True
        offset += padded
        if kind in _REGULAR:
            yield name, data, size


def iter_samples(stream: IO[bytes], wanted: Callable[[str], bool] | None = None) -> Iterator[Sample]:
    """Group consecutive members into samples; keep only members whose extension ``wanted`` accepts.

    Every member name takes part in duplicate and split detection, wanted or not.
    """
    current: Sample | None = None
    exts: set[str] = set()
    seen_keys: set[str] = set()

    def want(name: str) -> bool:
        parts = split_name(name)
        return parts is not None and (wanted is None or wanted(parts[1]))

    try:
        for name, data, size in iter_members(stream, want):
            parts = split_name(name)
            if parts is None:
                continue
            key, ext = parts
            if current is None or key != current.key:
                if current is not None:
                    yield current
                current, exts = Sample(key), set()
                if key in seen_keys:
                    current.error = f"split sample: members of {key!r} are not consecutive in the shard"
                seen_keys.add(key)
            if ext in exts and not current.error:
                current.error = f"duplicate member: {name!r} appears twice in one sample"
            if size > MAX_MEMBER_BYTES and not current.error:
                current.error = f"member too large: {name!r} holds {size} bytes (limit {MAX_MEMBER_BYTES})"
            exts.add(ext)
            if data is not None:
                current.members[ext] = data
    except TarStreamError as e:
        # Keep the sample in progress when the members it has are whole, that is, unless the member
        # cut or damaged is its own; the error row takes the key of the member cut, when known.
        parts = split_name(e.member) if e.member is not None else None
        if current is not None and parts is not None and parts[0] == current.key:
            yield Sample(current.key, {}, str(e))
            return
        if current is not None:
            yield current
        yield Sample(parts[0] if parts is not None else "", {}, str(e))
        return
    if current is not None:
        yield current


def _read(stream: IO[bytes], n: int, offset: int, name: str | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = stream.read(n - got)
        except EOFError as e:  # gzip stream cut before its end marker
            raise TarStreamError(
                f"truncated tar: compressed stream ends early near byte {offset + got}", name
            ) from e
        except (zlib.error, gzip.BadGzipFile) as e:
            raise TarStreamError(
                f"corrupt tar: bad compressed data near byte {offset + got} ({e})", name
            ) from e
        except Exception as e:  # network or storage errors mid-stream (after the filesystem's own retries)
            raise ShardReadError(f"{type(e).__name__}: {e} near byte {offset}") from e
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _read_exact(stream: IO[bytes], n: int, offset: int, name: str | None) -> bytes:
    data = _read(stream, n, offset, name)
    if len(data) < n:
        where = f"member {name!r}" if name is not None else "a member header"
        raise TarStreamError(f"truncated tar: shard ends inside {where} at byte {offset + len(data)}", name)
    return data


def _skip(stream: IO[bytes], n: int, offset: int, name: str | None) -> None:
    while n > 0:
        step = min(n, 1 << 20)
        _read_exact(stream, step, offset, name)
        n -= step
        offset += step


def _check_checksum(header: bytes, offset: int) -> None:
    stored = _number(header[148:156], offset)
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32  # the checksum field counts as spaces
    if stored == unsigned:
        return
    # Some old writers summed signed chars; accept that form too.
    high = sum(1 for b in header if b > 127) - sum(1 for b in header[148:156] if b > 127)
    if stored != unsigned - 256 * high:
        raise TarStreamError(f"corrupt tar: bad header checksum at byte {offset}")


def _number(field_bytes: bytes, offset: int) -> int:
    if field_bytes[:1] and field_bytes[0] & 0x80:  # GNU base-256 for values that do not fit octal
        return int.from_bytes(field_bytes[1:], "big")
    text = field_bytes.rstrip(b"\0 ").lstrip(b" ").split(b"\0", 1)[0]
    try:
        return int(text, 8) if text else 0
    except ValueError as e:
        raise TarStreamError(f"corrupt tar: unreadable number in header at byte {offset}") from e


def _pax_size(text: str, offset: int) -> int:
    try:
        return int(text)
    except ValueError as e:
        raise TarStreamError(f"corrupt tar: unreadable pax size before byte {offset}") from e


def _header_name(header: bytes) -> str:
    name = header[0:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\x00":  # POSIX ustar keeps long paths split into prefix + name
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "replace")


def _pax_records(data: bytes, offset: int) -> dict[str, str]:
    """Parse ``"<len> <key>=<value>\\n"`` records; we use only ``path`` and ``size``."""
    records, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
            key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        except ValueError as e:
            raise TarStreamError(f"corrupt tar: unreadable pax record before byte {offset}") from e
        if length <= 0:
            raise TarStreamError(f"corrupt tar: unreadable pax record before byte {offset}")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos += length
    return records
