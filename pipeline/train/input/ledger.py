"""`Ledger`: what each epoch consumed, per shard: how many samples, and a hash of their keys that no order
changes, the bad samples apart. Each checkpoint holds it (`TrainState.ledger`), so `jobs/audit.py` can check
a run against its shards: every good sample of every finished epoch trained once, and the current epoch's
consumed part once (`pipeline.train.audit`).

A sample's hash is the first 8 bytes of BLAKE2b over its key (UTF-8), read as an unsigned 64-bit
integer; a set of samples' hash is the sum of theirs modulo 2**64. The sum is a multiset hash: the same
whatever order the samples came in, on whichever rank, and a sample counted twice (or one left out)
moves it, as it moves the count. Per epoch and per shard the ledger holds four numbers: the samples
trained and their hash, the bad samples counted and theirs. The keys are hashed on the data thread as a
step's input is built (`tally`), so the training thread only adds a few entries a step (one per shard the
step read).

Where the numbers come from: the cursor's own moments (`pipeline.train.input.cursor.EpochCursor`): a
step's samples once it trains on them (``took``), a step input's bad samples once the rank counts them
(``saw``), so the ledger and the position by sample agree at every checkpoint. Each rank keeps what it
added since the last checkpoint; a checkpoint sums every rank's into the run's (`gathered`, one gather a
checkpoint). A resume continues from the checkpoint's: what was trained after it is trained again and
counted once, as it is in the weights. A resume at the same layout re-reads the micro-batches taken and
counts their bad samples again, as the bad-sample counts do from the epoch's start
(`EpochCursor.replay_counts`): the current epoch's bad part starts again from zero with them
(`forget_bad`).

Parts: an epoch is a part (``"3"``); a mixed run's epoch reads each source in passes, a sample coming once
a pass, so its parts are an epoch's passes (``"3/1"``: epoch 3, pass 1), a source's shards in the pass of
that source (`pipeline.train.input.source_position`). Shards are slots in the run's shard list (the
workers' ``shards``), which the record names by the fingerprint of their names within their dataset
(`pipeline.train.input.position.shards_fingerprint`): moved or signed again, the same shards.

The record (`to_dict`), per part: ``good`` and ``hash``, base64 of little-endian uint32 counts and uint64
hashes, one per shard of the run (dense) or, where fewer than half the shards were read, with ``slots``
(uint32) naming them; ``bad``: base64 of (slot uint32, count uint32, hash uint64) for the shards with bad
samples. 12 bytes a shard an epoch: docs/scaling.md gives the sizes at scale. A mixed run's finished
epochs also keep what they consumed of the passes a source had not finished (``ends``: the position by
sample at the epoch's end, every rank's union, one gather an epoch), so those passes are checked too. A
ledger that begins after a run's first step (its checkpoint predates the ledger, or a resume from other
shards) says so: ``since``.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch.distributed as dist

from pipeline.data.shards import shard_id
from pipeline.train.input.position import shards_fingerprint

MOD = 1 << 64
PLAIN = -1  # the pass of a plain run's samples (one source, no passes)
# A step's samples by (shard url, pass): [samples, hash]; lists, so a feeder's reply carries them as they are.
Tally = list[tuple[str, int, int, int]]
Entry = list[int]  # [trained, their hash, bad, their hash]


def key_hash(key: str) -> int:
    """One sample's hash: the first 8 bytes of BLAKE2b over its key, unsigned."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def keys_hash(keys: Iterable[str]) -> int:
    """The hash of a multiset of keys: the sum of theirs modulo 2**64."""
    return sum(map(key_hash, keys)) % MOD


def tally(rows: Iterable[tuple[str, str, int]]) -> Tally:
    """``(url, key, pass)`` rows summed by shard and pass: ``[(url, pass, samples, hash)]``."""
    sums: dict[tuple[str, int], list[int]] = {}
    for url, key, passes in rows:
        entry = sums.setdefault((url, passes), [0, 0])
        entry[0] += 1
        entry[1] = (entry[1] + key_hash(key)) % MOD
    return [(url, passes, n, h) for (url, passes), (n, h) in sums.items()]


def tally_batches(batches: Iterable[dict[str, np.ndarray]]) -> Tally:
    """The samples of a step's micro-batches (their ``key``, ``url`` and, mixed, ``pass`` columns)."""

    def rows() -> Iterator[tuple[str, str, int]]:
        for b in batches:
            passes = b["pass"].tolist() if "pass" in b else [PLAIN] * len(b["key"])
            yield from zip(b["url"].tolist(), b["key"].tolist(), passes, strict=True)

    return tally(rows())


def tally_keyed(keyed: Iterable[tuple[Any, ...]]) -> Tally:
    """Bad samples as `pipeline.data.bad_samples.BadSamples.keyed` holds them: (url, key, *tag), a mixed
    run's tag (source, pass)."""
    return tally((url, key, int(tag[1]) if len(tag) > 1 else PLAIN) for url, key, *tag in keyed)


def part_name(epoch: int, passes: int) -> str:
    return str(epoch) if passes == PLAIN else f"{epoch}/{passes}"


def part_epoch(part: str) -> int:
    return int(part.split("/")[0])


class Ledger:
    """One rank's ledger: the run's as of the last checkpoint (``base``, the same on every rank) and what
    this rank added since (``added``)."""

    def __init__(self, shards: list[str], epoch: int = 0, since: dict[str, int] | None = None):
        self.count = len(shards)
        self.fingerprint = shards_fingerprint(shards)
        self.slots = {shard_id(url): i for i, url in enumerate(shards)}
        self.epoch = epoch
        self.since = since  # {"step", "epoch"} where the ledger began, None: at the run's start
        self.base: dict[str, dict[int, Entry]] = {}
        self.added: dict[str, dict[int, Entry]] = {}
        # A mixed run's finished epochs: what each consumed of its sources' passes (the position by sample
        # at its end, every rank's union), for the passes a source had not finished (`ended`).
        self.ends: dict[str, dict[str, Any]] = {}

    @classmethod
    def resume(cls, shards: list[str], record: dict[str, Any], step: int, epoch: int) -> Ledger:
        """The ledger of a checkpoint's record at ``step`` (in ``epoch``); a ledger beginning there when the
        record is of other shards, or none (a checkpoint that predates it)."""
        ledger = cls(shards, epoch)
        if record and record.get("shards") == ledger.fingerprint:
            ledger.since = record.get("since")
            ledger.base = decode_parts(record.get("parts", {}))
            ledger.ends = dict(record.get("ends", {}))
        elif step:
            ledger.since = {"step": step, "epoch": epoch}
        return ledger

    # --- what a rank consumes --------------------------------------------------------------------
    def trained(self, samples: Tally) -> None:
        """A step trained on these samples (`tally_batches` of its micro-batches)."""
        self._add(samples, 0)

    def counted(self, samples: Tally) -> None:
        """These bad samples were counted (`tally_keyed`)."""
        self._add(samples, 2)

    def _add(self, samples: Tally, at: int) -> None:
        for url, passes, n, h in samples:
            slot = self.slots.get(url)
            if slot is None:  # not a shard of this run's list: nothing a checkpoint could name
                continue
            entry = self.added.setdefault(part_name(self.epoch, passes), {}).setdefault(slot, [0, 0, 0, 0])
            entry[at] += n
            entry[at + 1] = (entry[at + 1] + h) % MOD

    def next_epoch(self, ended: dict[str, Any] | None = None) -> None:
        """The epoch is over; ``ended``: a mixed run's position by sample at its end (the union over ranks,
        `pipeline.train.input.source_position.SourcesPosition.gathered`), kept for the passes it had begun."""
        if ended:
            self.ends[str(self.epoch)] = ended
        self.epoch += 1

    def forget_bad(self) -> None:
        """The current epoch's bad samples, from every rank, are counted again from its start: a resume at
        the same layout re-reads the micro-batches taken (module docstring)."""
        for part, entries in self.base.items():
            if part_epoch(part) == self.epoch:
                for entry in entries.values():
                    entry[2:] = [0, 0]

    # --- the checkpoint's record -----------------------------------------------------------------
    def gathered(self, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """Collective: every rank's additions summed into the run's ledger, which becomes every rank's
        base; the record (`to_dict`)."""
        added: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(added, self.added, group=group)
        for parts in added:
            merge(self.base, parts)
        self.added = {}
        return self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        """What `TrainState.ledger` holds (module docstring)."""
        return {
            "shards": self.fingerprint,
            "count": self.count,
            **({"since": self.since} if self.since else {}),
            "parts": {part: encode_part(entries, self.count) for part, entries in sorted(self.base.items())},
            **({"ends": self.ends} if self.ends else {}),
        }


def merge(into: dict[str, dict[int, Entry]], parts: dict[str, dict[int, Entry]]) -> None:
    """Add ``parts`` into ``into``, entry by entry."""
    for part, entries in parts.items():
        mine = into.setdefault(part, {})
        for slot, entry in entries.items():
            kept = mine.setdefault(slot, [0, 0, 0, 0])
            kept[0], kept[2] = kept[0] + entry[0], kept[2] + entry[2]
            kept[1], kept[3] = (kept[1] + entry[1]) % MOD, (kept[3] + entry[3]) % MOD


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def _array(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype)


def encode_part(entries: dict[int, Entry], count: int) -> dict[str, str]:
    """One part's entries (slot -> [trained, hash, bad, hash]) in the record's form (module docstring)."""
    good = sorted(slot for slot, e in entries.items() if e[0])
    dense = 2 * len(good) >= count
    slots = np.arange(count, dtype="<u4") if dense else np.array(good, dtype="<u4")
    record = {
        "good": _b64(np.array([entries.get(s, [0])[0] for s in slots.tolist()], dtype="<u4")),
        "hash": _b64(np.array([entries[s][1] if s in entries else 0 for s in slots.tolist()], dtype="<u8")),
    }
    if not dense:
        record["slots"] = _b64(slots)
    bad = sorted(slot for slot, e in entries.items() if e[2])
    if bad:
        rows = np.zeros(len(bad), dtype=[("slot", "<u4"), ("n", "<u4"), ("hash", "<u8")])
        rows["slot"], rows["n"] = bad, [entries[s][2] for s in bad]
        rows["hash"] = np.array([entries[s][3] for s in bad], dtype="<u8")
        record["bad"] = _b64(rows)
    return record


def decode_parts(parts: dict[str, dict[str, str]]) -> dict[str, dict[int, Entry]]:
    """The record's parts back as slot -> [trained, hash, bad, hash] (shards with nothing left out)."""
    out: dict[str, dict[int, Entry]] = {}
    for part, record in parts.items():
        good, hashes = _array(record["good"], "<u4"), _array(record["hash"], "<u8")
        slots = _array(record["slots"], "<u4") if "slots" in record else np.arange(len(good))
        entries = {
            int(s): [int(n), int(h), 0, 0] for s, n, h in zip(slots, good, hashes, strict=True) if n or h
        }
        if "bad" in record:
            rows = np.frombuffer(
                base64.b64decode(record["bad"]), dtype=[("slot", "<u4"), ("n", "<u4"), ("hash", "<u8")]
            )
            for s, n, h in rows.tolist():
                entries.setdefault(int(s), [0, 0, 0, 0])[2:] = [int(n), int(h)]
        out[part] = entries
    return out
