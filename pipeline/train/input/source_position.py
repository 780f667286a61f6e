"""`SourcesPosition`: what the current epoch of a mixed run has consumed, per source and per pass, by sample.

A mixed run (`pipeline.train.input.dataplan.MixedSources`) reads each source in passes: pass p of a source has its own shard
order (`pipeline.data.mixture.pass_epoch`), and a cycled source's sample comes again in its next pass. So
a sample of a mixed epoch is named by its source, its pass and, within that pass, as one source's sample
is (`pipeline.train.input.position.EpochPosition`: shard and index in the shard's tar order). The mixed stream
tags each sample it hands out, and each bad sample its sources count, with its source and pass
(`SourceReader`), and a rank keeps one `EpochPosition` per (source, pass) it has consumed from.

A pass is complete once every shard of it is done; ranks go through a source's passes in turn, so the
complete passes are a prefix, kept as a number (``passes_done``) with no shard list. A checkpoint holds
the union over ranks (`pipeline.train.input.position.union_over_ranks`) as `TrainState.epoch_consumed`:

    {"sources": {name: {"shards": fingerprint, "passes_done": d, "passes": {p: EpochPosition record}}}}

with a record only for the passes begun and not complete: at most the spread of passes the ranks are in,
each the size of a single source's position (BENCHMARKS.md). A run resumed at another layout deals, per
source, each pass from ``passes_done`` on as a single source's epoch is dealt (`EpochPosition.deal`, via
`pipeline.train.input.cursor.EpochCursor.deal`): the shards of that pass's order not done, every ``world``-th,
their consumed samples passed over by the read stage. No torch collective here but through
`union_over_ranks`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from pipeline.train.input.position import EpochPosition, shards_fingerprint, union_over_ranks


class SourcesPosition:
    """The samples of the current mixed epoch that a rank (or, merged, the run) has consumed."""

    def __init__(self, names: list[str], shards: list[list[str]]):
        self.names, self.shards = names, shards
        self.fingerprints = [shards_fingerprint(s) for s in shards]
        self.done = [0] * len(names)  # per source: its passes 0 .. done - 1 are complete
        self.passes: list[dict[int, EpochPosition]] = [{} for _ in names]  # begun, not complete

    def fresh(self) -> SourcesPosition:
        return SourcesPosition(self.names, self.shards)

    # --- what a rank consumes --------------------------------------------------------------------
    def took(self, consumed: Iterable[tuple[Any, ...]], counted: Iterable[tuple[Any, ...]]) -> None:
        """As `EpochPosition.took`; the columns and the counted samples also hold (source, pass)."""
        for columns in consumed:
            self.add(zip(*(c.tolist() for c in columns), strict=True))
        self.add(counted)

    def add(self, samples: Iterable[tuple[Any, ...]]) -> None:
        """Samples as (url, index, shard_size: -1 unless the shard's last row, source, pass)."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for url, index, size, source, passes in samples:
            groups.setdefault((int(source), int(passes)), []).append((url, index, size))
        for (source, passes), rows in groups.items():
            if passes >= self.done[source]:
                self._pass(source, passes).add(rows)
                self._settle(source)

    def _pass(self, source: int, passes: int) -> EpochPosition:
        """The position of that pass, built at its first sample only (a build hashes the source's
        whole shard list: per step it would cost milliseconds at 20k shards)."""
        position = self.passes[source].get(passes)
        if position is None:
            position = self.passes[source][passes] = EpochPosition(self.shards[source])
        return position

    def _settle(self, source: int) -> None:
        """Complete passes at the front become ``done`` (their positions are dropped)."""
        passes = self.passes[source]
        for p in [p for p in passes if p < self.done[source]]:
            del passes[p]
        while (first := passes.get(self.done[source])) is not None and len(first.done) == len(first.shards):
            del passes[self.done[source]]
            self.done[source] += 1

    # --- the checkpoint's record -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """What `TrainState.epoch_consumed` holds (module docstring); {} when nothing is consumed."""
        recorded = {}
        for s, name in enumerate(self.names):
            passes = {str(p): pos.to_dict() for p, pos in sorted(self.passes[s].items())}
            passes = {p: record for p, record in passes.items() if record}
            if self.done[s] or passes:
                recorded[name] = {
                    "shards": self.fingerprints[s],
                    "passes_done": self.done[s],
                    "passes": passes,
                }
        return {"sources": recorded} if recorded else {}

    def update(self, record: dict[str, Any]) -> SourcesPosition:
        """The union with a `to_dict` record of the same sources; returns self."""
        for name, entry in record.get("sources", {}).items():
            s = self.names.index(name)
            if entry.get("shards") != self.fingerprints[s]:
                raise ValueError("a data position of other shards")
            self.done[s] = max(self.done[s], int(entry.get("passes_done", 0)))
            for p, one in entry.get("passes", {}).items():
                if int(p) >= self.done[s]:
                    self._pass(s, int(p)).update(one)
            self._settle(s)
        return self

    def resumed(self, record: dict[str, Any]) -> SourcesPosition | None:
        """The position a checkpoint recorded, or None when it recorded none of these sources (a source
        it names is missing, or holds other shards)."""
        recorded = record.get("sources") if record else None
        if not recorded:
            return None
        for name, entry in recorded.items():
            if name not in self.names or entry.get("shards") != self.fingerprints[self.names.index(name)]:
                return None
        return self.fresh().update(record)

    def gathered(self, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """Collective: the union of every rank's position, as `to_dict` (the same on every rank)."""
        return union_over_ranks(self, group)

    # --- a resume at another layout --------------------------------------------------------------
    def of(self, source: int, passes: int) -> EpochPosition:
        """The position of one pass of one source (an empty one for a pass not begun); not to be changed."""
        return self.passes[source].get(passes) or EpochPosition(self.shards[source])

    def first_pass(self, source: int) -> int:
        """The pass a rank resumed at another layout reads the source from: the first not complete."""
        return self.done[source]

    def last_begun(self, source: int) -> int:
        """The last pass of the source that any rank had begun (-1: none); up to it, a rank's part of
        a pass may be empty."""
        return max(self.passes[source], default=self.done[source] - 1)
