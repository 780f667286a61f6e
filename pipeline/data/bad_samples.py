"""Counting the samples that could not be used, and failing a job when there are too many.

A consumer passes every batch through `BadSamples.filter`, which removes error rows and records
(url, key, reason), then calls `check_budget`. Counts merge across workers (`merge`, `to_dict`) for
the run summary and the embedding manifest.

The budget rule: fail when ``bad > max_bad_fraction * max(total, grace_samples)``. Early on, while
fewer than ``grace_samples`` samples have been seen, the allowance is a fixed number of bad samples
(``max_bad_fraction * grace_samples``, 10 with the defaults) instead of a share of a tiny count, so
one corrupt image in the first batch does not fail a job; past that, it is the plain share. At the end
of a pass (``final=True``) the share over everything seen decides, so a small dataset is judged by its
real share. ``max_bad_fraction=0`` fails on the first bad sample.

Lost shards: a shard that yields no readable sample (zeros, an HTML error page saved under a shard's
name, an empty tar, a tar whose every sample is bad) is no bad sample but a lost shard, marked by one
``lost shard`` row (`pipeline.data.rows.read_shard`). Lost shards are counted apart, once per shard
however often it is read (training reads it every epoch), and held to a budget of their own,
``max_lost_shards`` (0 by default: any lost shard fails the job, naming it).

Labeled jobs over unlabeled shards: when every sample seen so far lacks its label (at least
``LABEL_PROBE`` of them, or all at the end), `LabelsMissingError` says so instead of a budget error.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LABEL_PROBE = 16  # samples that must all lack labels before declaring the shards unlabeled
MISSING_LABEL = "missing label"
LOST_SHARD = "lost shard"  # the reason category of the row that marks a shard without a readable sample


class BadSampleBudgetError(RuntimeError):
    """The share of bad samples passed the configured budget."""


class LabelsMissingError(RuntimeError):
    """A job that requires labels is reading shards that carry none."""


def reason_category(reason: str) -> str:
    """``"truncated image: ..."`` -> ``"truncated image"``."""
    return reason.split(":", 1)[0].strip()


@dataclass
class BadSamples:
    """Counters of seen and bad samples, by reason category, with a bounded list of examples."""

    max_bad_fraction: float = 0.01
    grace_samples: int = 1000
    max_examples: int = 100
    total: int = 0
    bad: int = 0
    by_reason: Counter = field(default_factory=Counter)
    examples: list[dict[str, str]] = field(default_factory=list)
    max_lost_shards: int = 0
    lost: dict[str, str] = field(default_factory=dict)  # url -> why it gave no readable sample
    # Mixed sources only (`pipeline.data.mixture`): name -> {"samples", "bad", "pass", "in_pass"}.
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    # (url, index, shard_size, *tag) of the bad samples counted since `take_counted`, for a data position
    # (rows with an ``index`` column only); never saved, never merged.
    counted: list[tuple[Any, ...]] = field(default_factory=list, repr=False, compare=False)
    # (url, key, *tag) of every bad sample counted since `take_keyed`, indexed or not: for the ledger of
    # what an epoch consumed (`pipeline.train.input.ledger`); never saved, never merged.
    keyed: list[tuple[Any, ...]] = field(default_factory=list, repr=False, compare=False)
    # What the samples counted now are tagged with in ``counted``: a mixed run's (source, pass), set by
    # its `SourceReader` while it reads (`tagged`); () otherwise.
    tag: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_config(cls, config: Any) -> BadSamples:
        """From a `pipeline.data.config.DataConfig` (its ``max_bad_fraction``, ``bad_grace_samples`` and
        ``max_lost_shards``)."""
        return cls(
            max_bad_fraction=config.max_bad_fraction,
            grace_samples=config.bad_grace_samples,
            max_lost_shards=config.max_lost_shards,
        )

    def filter(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Record the batch's error rows and return the batch without them (the same dict if none)."""
        errors = batch["error"]
        bad = np.fromiter((bool(e) for e in errors), dtype=bool, count=len(errors))
        if not bad.any():
            self.total += len(errors)
            return batch
        indexed = "index" in batch and "shard_size" in batch
        for i in np.flatnonzero(bad):
            reason = str(errors[i])
            if reason_category(reason) == LOST_SHARD:
                self.lost.setdefault(str(batch["url"][i]), reason.split(":", 1)[-1].strip())
            else:
                self.total += 1
                self.record(str(batch["url"][i]), str(batch["key"][i]), reason, counted=True)
                self.keyed.append((str(batch["url"][i]), str(batch["key"][i]), *self.tag))
                if indexed and batch["index"][i] >= 0:
                    self.counted.append(
                        (str(batch["url"][i]), int(batch["index"][i]), int(batch["shard_size"][i]), *self.tag)
                    )
        self.total += int((~bad).sum())
        keep = ~bad
        return {name: column[keep] for name, column in batch.items()}

    def take_counted(self) -> list[tuple[Any, ...]]:
        """The (url, index, shard_size, *tag) of the bad samples counted since the last call."""
        taken, self.counted = self.counted, []
        return taken

    def take_keyed(self) -> list[tuple[Any, ...]]:
        """The (url, key, *tag) of the bad samples counted since the last call."""
        taken, self.keyed = self.keyed, []
        return taken

    @contextlib.contextmanager
    def tagged(self, *tag: int) -> Iterator[None]:
        """Within it, the bad samples counted carry ``tag`` in ``counted`` (a mixed run's source, pass)."""
        outer, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = outer

    def record(self, url: str, key: str, reason: str, *, counted: bool = False) -> None:
        """Count one bad sample (``counted``: it is already in ``total``)."""
        if not counted:
            self.total += 1
        self.bad += 1
        self.by_reason[reason_category(reason)] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append({"url": url, "key": key, "reason": reason})

    def check_budget(self, *, final: bool = False) -> None:
        """Raise `LabelsMissingError` or `BadSampleBudgetError` (one line each) when the rules above say so."""
        if len(self.lost) > self.max_lost_shards:
            named = [f"{url} ({why})" for url, why in list(self.lost.items())[:3]]
            more = f" and {len(self.lost) - 3} more" if len(self.lost) > 3 else ""
            raise BadSampleBudgetError(
                f"{len(self.lost)} shard(s) gave no readable sample (max_lost_shards {self.max_lost_shards}): "
                f"{', '.join(named)}{more}; replace or remove them, or raise max_lost_shards"
            )
        missing = self.by_reason.get(MISSING_LABEL, 0)
        if missing and missing == self.total and (final or self.total >= LABEL_PROBE):
            example = self.examples[0]["reason"] if self.examples else MISSING_LABEL
            raise LabelsMissingError(
                f"none of the {self.total} samples read carries a label ({example}); these shards look "
                "unlabeled: set the label key (e.g. label_key='json:label') or run without labels"
            )
        allowed = self.max_bad_fraction * (self.total if final else max(self.total, self.grace_samples))
        if self.bad > allowed:
            top = ", ".join(f"{n} {reason}" for reason, n in self.by_reason.most_common(3))
            where = self.examples[0] if self.examples else {"url": "?", "key": "?"}
            raise BadSampleBudgetError(
                f"{self.bad} of {self.total} samples are bad ({self.bad / max(self.total, 1):.1%} > "
                f"max_bad_fraction {self.max_bad_fraction:.1%}): {top}; first: {where['url']} key "
                f"{where['key']!r}; fix the shards or raise max_bad_fraction"
            )

    @property
    def fraction(self) -> float:
        return self.bad / self.total if self.total else 0.0

    def merge(self, other: BadSamples | dict[str, Any]) -> BadSamples:
        """Add another worker's counts (a `BadSamples` or its `to_dict`) into this one; returns self."""
        other = BadSamples.from_dict(other) if isinstance(other, dict) else other
        self.total += other.total
        self.bad += other.bad
        self.by_reason.update(other.by_reason)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[: max(room, 0)])
        for url, why in other.lost.items():
            self.lost.setdefault(url, why)
        for name, theirs in other.sources.items():  # counts add up; a pass is the furthest any rank is in
            mine = self.sources.setdefault(name, {})
            for key, value in theirs.items():
                mine[key] = max(mine.get(key, 0), value) if key == "pass" else mine.get(key, 0) + value
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "bad": self.bad,
            "fraction": self.fraction,
            "by_reason": dict(sorted(self.by_reason.items())),
            "examples": list(self.examples),
            "max_bad_fraction": self.max_bad_fraction,
            "grace_samples": self.grace_samples,
            "lost_shards": dict(self.lost),
            "max_lost_shards": self.max_lost_shards,
            **({"sources": {name: dict(c) for name, c in self.sources.items()}} if self.sources else {}),
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BadSamples:
        return cls(
            max_bad_fraction=values.get("max_bad_fraction", 0.01),
            grace_samples=values.get("grace_samples", 1000),
            total=values["total"],
            bad=values["bad"],
            by_reason=Counter(values.get("by_reason", {})),
            examples=list(values.get("examples", [])),
            max_lost_shards=values.get("max_lost_shards", 0),
            lost=dict(values.get("lost_shards", {})),
            sources={name: dict(c) for name, c in values.get("sources", {}).items()},
        )
