"""Hostile shards: member names that climb out of a directory, decompression bombs, huge members.

Nothing from a shard becomes a path, a decoded bomb or a member held whole in memory. The huge members
are never built: a lazy stream hands out a header claiming 1 GiB followed by zeros, chunk by chunk,
and stops the test when the reader starts holding what it read. No Ray.
"""

from __future__ import annotations

import io
import struct
import tarfile
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from pipeline.data import decode
from pipeline.data.config import DataConfig
from pipeline.data.rows import RowSpec, read_shard
from pipeline.data.tar import MAX_MEMBER_BYTES, iter_samples
from pipeline.data.writing import tar_bytes

GIB = 1 << 30
HELD_LIMIT = 64 << 20  # Python memory a reader may hold while passing a 1 GiB member (it needs ~1 MiB)


# --- member names --------------------------------------------------------------------------------


CLIMBING = ["../../../escape", "a/../../b", "./../c", "C:\\Windows\\e"]


def hostile_shard(tmp_path: Path, members: list[tuple[str, bytes]], monkeypatch: pytest.MonkeyPatch) -> Path:
    """``members`` as the shard ``shards/hostile-000000.tar`` below ``tmp_path``, with this process's
    working directory moved deeper below ``tmp_path`` (``work/one/two/three``) than `CLIMBING` climbs."""
    shard = tmp_path / "shards" / "hostile-000000.tar"
    shard.parent.mkdir()
    shard.write_bytes(tar_bytes(members))
    cwd = tmp_path / "work" / "one" / "two" / "three"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    return shard


def test_climbing_and_absolute_member_names_are_keys_never_paths(tmp_path, monkeypatch):
    """The parser writes nothing: such names come back as plain keys, and no file appears anywhere
    they point (the reader runs deeper below tmp_path than any `../` climbs, so such a write would land
    inside it where this test looks, and the absolute name points inside it too)."""
    names = [*CLIMBING, str(tmp_path / "planted" / "absolute")]
    members = [(f"{name}.{ext}", data) for name in names for ext, data in (("cls", b"1"), ("jpg", b"J"))]
    shard = hostile_shard(tmp_path, members, monkeypatch)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rows = pa.concat_tables(read_shard(str(shard), RowSpec(require_labels=True), 4)).to_pylist()
    assert [(r["key"], r["image"], r["label"], r["error"]) for r in rows] == [
        (name, b"J", 1, "") for name in names
    ]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# --- decompression bombs ---------------------------------------------------------------------------


def _small(fmt: str) -> bytearray:
    out = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(out, format=fmt)
    return bytearray(out.getvalue())


def png_bomb(width: int, height: int) -> bytes:
    data = _small("PNG")
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


def jpeg_bomb(width: int, height: int) -> bytes:
    data = _small("JPEG")
    sof = data.index(b"\xff\xc0")  # baseline frame header: marker, length, precision, height, width
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def webp_bomb(width: int, height: int) -> bytes:
    data = _small("WEBP")
    start = data.index(b"\x9d\x01\x2a")  # VP8 key frame start code, then 14-bit width and height
    data[start + 3 : start + 7] = struct.pack("<HH", width, height)
    return bytes(data)


def gif_bomb(width: int, height: int) -> bytes:
    data = _small("GIF")
    data[6:10] = struct.pack("<HH", width, height)  # logical screen
    return bytes(data)


def gif_frame_bomb(width: int, height: int) -> bytes:
    """A 16x16 screen whose first frame claims ``width`` x ``height``: the frame grows the image."""
    data = _small("GIF")
    frame = data.index(b"\x2c\x00\x00\x00\x00")  # image descriptor at (0, 0)
    data[frame + 5 : frame + 9] = struct.pack("<HH", width, height)
    return bytes(data)


BOMBS = {"png": png_bomb, "jpeg": jpeg_bomb, "webp": webp_bomb, "gif": gif_bomb, "gif-frame": gif_frame_bomb}
LIMIT = 20_000_000  # pixels


@pytest.mark.parametrize("fmt", list(BOMBS))
@pytest.mark.parametrize(
    "side",
    [5_000, 16_383],  # 25M pixels: over the configured limit only; 268M: over PIL's own hard limit too
    ids=["over-config", "over-hard"],
)
def test_a_decompression_bomb_is_refused_from_its_header_and_never_decoded(fmt, side, monkeypatch):
    decoded = []
    original = decode.crop_resize
    monkeypatch.setattr(
        decode, "crop_resize", lambda im, *a, **k: decoded.append(im.size) or original(im, *a, **k)
    )
    bomb = BOMBS[fmt](side, side)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # PIL's own check off: is the file what it claims?
    assert Image.open(io.BytesIO(bomb)).size == (side, side)
    good = bytes(_small("PNG"))
    config = DataConfig(image_size=16, patch_size=8, max_image_pixels=LIMIT, require_labels=False)
    batch = {
        "key": np.array(["good", "bomb", "after"], object),
        "url": np.array(["s.tar"] * 3, object),
        "image": np.array([good, bomb, good], object),
        "label": np.zeros(3, np.int64),
        "error": np.array(["", "", ""], object),
    }
    out = decode.preprocess_batch(batch, config=config, train=False, epoch=0)
    assert [e.split(":")[0] for e in out["error"]] == ["", "image too large", ""]
    assert decoded == [(16, 16), (16, 16)]  # the neighbours were decoded; the bomb never was
    assert not out["patches"][1].any()


# --- huge members ------------------------------------------------------------------------------------


class LazyTar(io.RawIOBase):
    """A read-once tar stream of ``parts`` (bytes, or an int: that many zero bytes), served in chunks of
    at most 1 MiB, that fails the read once the reader holds more than `HELD_LIMIT` of Python memory."""

    def __init__(self, parts: list[bytes | int]):
        self.parts = list(parts)

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if tracemalloc.get_traced_memory()[0] > HELD_LIMIT:
            raise MemoryError(f"the reader holds {tracemalloc.get_traced_memory()[0]} bytes of the stream")
        while self.parts and self.parts[0] in (0, b""):
            self.parts.pop(0)
        if not self.parts:
            return b""
        n = min(n if n >= 0 else 1 << 20, 1 << 20)
        head = self.parts[0]
        if isinstance(head, int):
            self.parts[0] = head - min(n, head)
            return bytes(min(n, head))
        self.parts[0] = head[n:]
        return head[:n]


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def padded(size: int) -> int:
    return (size + 511) // 512 * 512


def members(pairs: list[tuple[str, bytes]]) -> bytes:
    """Member headers and data without the end-of-archive blocks: more members may follow."""
    return b"".join(header(name, len(data)) + data.ljust(padded(len(data)), b"\0") for name, data in pairs)


BEFORE = members([("before.cls", b"1"), ("before.jpg", b"B")])
AFTER = tar_bytes([("after.cls", b"2"), ("after.jpg", b"J")])


def read_lazily(parts: list[bytes | int]):
    tracemalloc.start()
    try:
        return [(s.key, s.members, s.error) for s in iter_samples(LazyTar(parts), RowSpec().wanted)]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("size", [GIB, MAX_MEMBER_BYTES + 1], ids=["1GiB", "limit+1"])
def test_a_member_over_the_limit_is_skipped_unheld_and_its_neighbours_kept(size):
    assert MAX_MEMBER_BYTES < 10**9  # a 1 GB image member is never held
    got = read_lazily([BEFORE, header("big.jpg", size), padded(size), AFTER])
    assert [(k, e.split(":")[0]) for k, _, e in got] == [
        ("before", ""),
        ("big", "member too large"),
        ("after", ""),
    ]
    assert got[0][1] == {"cls": b"1", "jpg": b"B"} and got[2][1] == {"cls": b"2", "jpg": b"J"}


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE], ids=["gnu-long-name", "pax"])
def test_a_huge_name_or_pax_record_ends_the_shard_as_corrupt_without_being_held(kind):
    got = read_lazily([BEFORE, header("././@LongLink", GIB, kind), GIB, AFTER])
    assert [(k, e.split(":")[0]) for k, _, e in got] == [("before", ""), ("", "corrupt tar")]
