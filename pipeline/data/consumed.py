"""`Consumed`: the samples of one shard an epoch has used, as index intervals; small when near a prefix.

A sample is named by its shard and its index in the shard's tar order (every sample counts, bad ones
too: the read rows' ``index`` column, `pipeline.data.rows`). A rank reads a shard in tar order through
its shuffle buffer, so what it has trained on is a prefix of the shard with holes where samples still
sit in the buffer: a handful of intervals ``[start, end)``. The read stage skips the samples of a
`Consumed` before it parses them (`pipeline.data.rows.read_shard`), which is how a run resumed at
another world size trains each remaining sample of the epoch once (`pipeline.train.position`).

`encode` writes the intervals' bounds as deltas in LEB128 varints, base64: a bound costs a byte or
two, whatever the shard's size.
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
        """The bounds as varint deltas, base64 (`decode` reads it back)."""
        out = bytearray()
        last = 0
        for bound in self.bounds:
            delta, last = bound - last, bound
            while True:
                byte, delta = delta & 0x7F, delta >> 7
                out.append(byte | (0x80 if delta else 0))
                if not delta:
                    break
        return base64.b64encode(bytes(out)).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> Consumed:
        bounds, value, shift, last = [], 0, 0, 0
        for byte in base64.b64decode(text):
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                last += value
                bounds.append(last)
                value, shift = 0, 0
        if shift or len(bounds) % 2 or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(
                "not the intervals of a data position; the checkpoint's train_state.json is damaged"
            )
        return cls(bounds)
