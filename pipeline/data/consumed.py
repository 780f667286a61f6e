"""`Consumed`: the samples of one shard an epoch has used, as index intervals; small when near a prefix.

A sample is named by its shard and its index in the shard's tar order (every sample counts, bad ones
too: the read rows' ``index`` column, `pipeline.data.rows`). A rank reads a shard in tar order through
its shuffle buffer, so what it has trained on is a prefix of the shard with holes where samples still
sit in the buffer: a handful of intervals ``[start, end)``. The read stage skips the samples of a
`Consumed` before it parses them (`pipeline.data.rows.read_shard`), which is how a run resumed at
another world size trains each remaining sample of the epoch once (`pipeline.train.input.position`).

`encode` writes the intervals' bounds as deltas in LEB128 varints (a bound costs a byte or two, whatever
the shard's size), or, where holes are dense, the prefix and a bitmap of the window past it, whichever
is shorter, in base64.
"""

from __future__ import annotations

import base64
import bisect
import itertools
from collections.abc import Iterable


class Consumed:
    """Sorted, disjoint, non-adjacent intervals ``[start, end)`` of sample indices in one shard."""

    __slots__ = ("bounds",)

    def __init__(self, bounds: Iterable[int] = ()):
        self.bounds: list[int] = list(bounds)  # start0, end0, start1, end1, ...; starts ascending

    def __contains__(self, index: int) -> bool:
        # An index is inside an interval when an odd number of bounds sit at or below it.
        return bisect.bisect_right(self.bounds, index) % 2 == 1

    def __len__(self) -> int:
        """Samples consumed."""
        return sum(self.bounds[i + 1] - self.bounds[i] for i in range(0, len(self.bounds), 2))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Consumed) and self.bounds == other.bounds

    def __repr__(self) -> str:
        pairs = zip(self.bounds[::2], self.bounds[1::2], strict=True)
        return f"Consumed({', '.join(f'[{a}, {b})' for a, b in pairs)})"

    @property
    def prefix(self) -> int:
        """Samples ``0 .. prefix - 1`` are all consumed."""
        return self.bounds[1] if self.bounds and self.bounds[0] == 0 else 0

    def add(self, indices: Iterable[int]) -> Consumed:
        """Add sample indices (any order, repeats allowed); returns self."""
        fresh = sorted({int(i) for i in indices if int(i) >= 0 and int(i) not in self})
        if fresh:
            runs: list[int] = []
            for i in fresh:
                if runs and runs[-1] == i:
                    runs[-1] = i + 1
                else:
                    runs += [i, i + 1]
            self.update(Consumed(runs))
        return self

    def update(self, other: Consumed) -> Consumed:
        """The union with ``other``, in place; returns self."""
        pairs = sorted(
            zip(self.bounds[::2] + other.bounds[::2], self.bounds[1::2] + other.bounds[1::2], strict=True)
        )
        merged: list[int] = []
        for start, end in pairs:
            if merged and start <= merged[-1]:  # overlapping or adjacent: one interval
                merged[-1] = max(merged[-1], end)
            else:
                merged += [start, end]
        self.bounds = merged
        return self

    def encode(self) -> str:
        """Base64 of the shorter of two forms (`decode` reads either): a 0 byte, then the bounds as
        varint deltas; or a 1 byte, then the prefix and the window past it as varints, then one bit
        per sample of the window (consumed or not): the denser the holes, the better the bitmap."""
        intervals = b"\0" + _varints(b - a for a, b in zip([0, *self.bounds], self.bounds, strict=False))
        prefix, end = self.prefix, self.bounds[-1] if self.bounds else 0
        if (end - prefix) // 8 < len(intervals):  # else the bitmap cannot be the shorter
            bits = bytearray((end - prefix + 7) // 8)
            for a, b in zip(self.bounds[::2], self.bounds[1::2], strict=True):
                for i in range(max(a, prefix) - prefix, b - prefix):
                    bits[i // 8] |= 1 << (i % 8)
            bitmap = b"\1" + _varints([prefix, end - prefix]) + bytes(bits)
            intervals = min(intervals, bitmap, key=len)
        return base64.b64encode(intervals).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> Consumed:
        raw = base64.b64decode(text)
        if raw[:1] == b"\1":
            (prefix, window), rest = _read_varints(raw[1:], 2)
            if len(rest) != (window + 7) // 8:
                raise ValueError(DAMAGED)
            consumed = cls([0, prefix] if prefix else [])
            return consumed.add(prefix + i for i in range(window) if rest[i // 8] >> (i % 8) & 1)
        if raw[:1] != b"\0":
            raise ValueError(DAMAGED)
        deltas, _ = _read_varints(raw[1:], None)
        bounds = list(itertools.accumulate(deltas))
        if len(bounds) % 2 or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(DAMAGED)
        return cls(bounds)


DAMAGED = "not the samples of a data position; the checkpoint's train_state.json is damaged"


def _varints(values: Iterable[int]) -> bytes:
    """LEB128: 7 bits a byte, low first, the high bit set on every byte but a number's last."""
    out = bytearray()
    for value in values:
        while True:
            byte, value = value & 0x7F, value >> 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                break
    return bytes(out)


def _read_varints(raw: bytes, count: int | None) -> tuple[list[int], bytes]:
    """(``count`` numbers, or all, from the start of ``raw``; the bytes after them)."""
    values, value, shift = [], 0, 0
    for n, byte in enumerate(raw):
        if count is not None and len(values) == count:
            return values, raw[n:]
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            values.append(value)
            value, shift = 0, 0
    if shift or (count is not None and len(values) != count):
        raise ValueError(DAMAGED)
    return values, b""
