"""`EpochPosition`: what the current epoch has consumed, sample by sample, whatever the rank layout.

A sample is named by its shard (its place in the run's shard list) and its index in the shard's tar
order (`pipeline.data.rows`, every sample counted). The epoch has consumed a sample once a step trained
on it, or once a rank counted it as bad (`BadSamples`): the same moment its bad-sample count moves, so
counts and position agree at every checkpoint. Each rank tracks what it consumed; a checkpoint holds
the union over all ranks (`gathered`, one gather at checkpoint time), as `TrainState.epoch_consumed`:

- ``shards``: a fingerprint of the shard names (within their dataset), so a position is only read
  against the same shards;
- ``done``: a bitmap over the shard list, of the shards every sample of which was consumed (a rank
  learns a shard's size from its last row, `shard_size`);
- ``partial``: per other shard it has begun, the consumed indices (`Consumed.encode`): the shuffle
  buffer makes them a prefix with holes where samples still sat in a buffer or a prefetched step,
  written as intervals or as the prefix and a bitmap past it, whichever is shorter;
- ``sizes``: the sizes learned of those partial shards.

A run resumed at another world size or micro-batch size (`EpochCursor.elastic`) deals the epoch's
shards that are not done, in the epoch's shard order, to its ranks (``remaining[rank::world]``); the
read stage passes over the consumed samples of each (`skip`) before decoding them, so the rest of the
epoch trains each remaining sample once and none twice. What is not kept: the order in which those
samples come (another layout has other streams and shuffle buffers), and so which samples share a step.
A mixed run keeps one per source and pass of that source (`pipeline.train.input.source_position`).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from pipeline.data.consumed import Consumed
from pipeline.data.shards import shard_id, shard_names


def shards_fingerprint(shards: list[str]) -> str:
    """The shard list by the shards' names within their dataset (data moved elsewhere, or signed again,
    keeps it)."""
    names = json.dumps(shard_names(shards))
    return hashlib.sha256(names.encode()).hexdigest()[:16]


class EpochPosition:
    """The samples of the current epoch that a rank (or, merged, the run) has consumed."""

    def __init__(self, shards: list[str]):
        self.shards = shards
        self.fingerprint = shards_fingerprint(shards)
        # By the shard's name (`shard_id`), as rows give it: a shard list may hold signed URLs.
        self.slots = {shard_id(url): i for i, url in enumerate(shards)}
        self.done: set[int] = set()
        self.partial: dict[int, Consumed] = {}
        self.sizes: dict[int, int] = {}

    # --- what a rank consumes --------------------------------------------------------------------
    def took(self, consumed: Iterable[tuple[Any, Any, Any]], counted: Iterable[tuple[str, int, int]]) -> None:
        """A step trained on ``consumed`` ((url, index, shard_size) columns of its micro-batches);
        ``counted``: the bad samples its input counted (as `StepInput`)."""
        for urls, indices, sizes in consumed:
            self.add(zip(urls.tolist(), indices.tolist(), sizes.tolist(), strict=True))
        self.add(counted)

    def add(self, samples: Iterable[tuple[str, int, int]]) -> None:
        """Samples as (url, index, shard_size: -1 unless the shard's last row), the url a shard's name as
        rows give it (`pipeline.data.shards.shard_id`)."""
        by_slot: dict[int, list[int]] = {}
        for url, index, size in samples:
            slot = self.slots.get(url)
            if slot is None or slot in self.done:
                continue
            by_slot.setdefault(slot, []).append(index)
            if size >= 0:
                self.sizes[slot] = size
        for slot, indices in by_slot.items():
            self.partial.setdefault(slot, Consumed()).add(indices)
            self._settle(slot)

    def _settle(self, slot: int) -> None:
        """A shard whose every sample is consumed becomes done (its indices are dropped)."""
        consumed, size = self.partial.get(slot), self.sizes.get(slot)
        if (
            consumed is not None
            and size is not None
            and len(consumed.bounds) == 2
            and consumed.prefix >= size
        ):
            self.done.add(slot)
            del self.partial[slot]
            del self.sizes[slot]

    # --- the checkpoint's record -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """What `TrainState.epoch_consumed` holds (see the module docstring); {} when nothing is consumed."""
        if not self.done and not self.partial:
            return {}
        bits = bytearray((len(self.shards) + 7) // 8)
        for slot in self.done:
            bits[slot // 8] |= 1 << (slot % 8)
        return {
            "shards": self.fingerprint,
            "done": base64.b64encode(bytes(bits)).decode("ascii"),
            "partial": {str(slot): c.encode() for slot, c in sorted(self.partial.items())},
            "sizes": {str(slot): n for slot, n in sorted(self.sizes.items())},
        }

    def update(self, record: dict[str, Any]) -> EpochPosition:
        """The union with a `to_dict` record of the same shards; returns self."""
        if not record:
            return self
        if record.get("shards") != self.fingerprint:
            raise ValueError("a data position of other shards")
        bits = base64.b64decode(record["done"])
        self.done |= {slot for slot in range(len(self.shards)) if bits[slot // 8] >> (slot % 8) & 1}
        self.sizes.update({int(slot): n for slot, n in record.get("sizes", {}).items()})
        for slot, text in record.get("partial", {}).items():
            if int(slot) not in self.done:
                self.partial.setdefault(int(slot), Consumed()).update(Consumed.decode(text))
        for slot in list(self.partial):
            if slot in self.done:
                del self.partial[slot]
            else:
                self._settle(slot)
        for slot in list(self.sizes):
            if slot in self.done:
                del self.sizes[slot]
        return self

    @classmethod
    def resume(cls, shards: list[str], record: dict[str, Any]) -> EpochPosition | None:
        """The position a checkpoint recorded, or None when it recorded none for these shards."""
        if not record or record.get("shards") != shards_fingerprint(shards):
            return None
        return cls(shards).update(record)

    def fresh(self) -> EpochPosition:
        """An empty position of the same shards (an epoch's start)."""
        return EpochPosition(self.shards)

    def resumed(self, record: dict[str, Any]) -> EpochPosition | None:
        """`resume` of these shards."""
        return EpochPosition.resume(self.shards, record)

    def gathered(self, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """Collective: the union of every rank's position, as `to_dict` (the same on every rank)."""
        return union_over_ranks(self, group)

    # --- a resume at another layout --------------------------------------------------------------
    def deal(self, order: list[str], rank: int, world: int) -> tuple[list[str], dict[str, Consumed]]:
        """(A rank's shards: every ``world``-th of the shards in ``order``, the epoch's shard order, that
        still hold a sample to consume; for the read stage, the consumed samples of each that has some)."""
        slot = {url: self.slots[shard_id(url)] for url in order}
        remaining = [url for url in order if slot[url] not in self.done]
        shards = remaining[rank::world]
        return shards, {url: self.partial[slot[url]] for url in shards if slot[url] in self.partial}

    @property
    def samples(self) -> int:
        """Samples consumed in the partial shards (the done ones hold their sizes)."""
        return sum(len(c) for c in self.partial.values())


def union_over_ranks(position: Any, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Collective: the union of every rank's ``position`` (anything with ``to_dict``, ``fresh`` and
    ``update``: `EpochPosition`, `pipeline.train.input.source_position.SourcesPosition`), as its ``to_dict``."""
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, position.to_dict(), group=group)
    merged = position.fresh()
    for record in records:
        merged.update(record)
    return merged.to_dict()
