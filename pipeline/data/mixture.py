"""Several data sources mixed by weight: the ``--data`` spec, the per-sample draw, the mixed stream.

    --data 'laion=s3://a/{000..999}.tar:0.7,cc=s3://b/{00..99}.tar:0.3'      NAME=URLS:WEIGHT, ...
    --data mix.yaml                                                            the same as a file

A spec whose first part does not start with ``NAME=`` is one source, read exactly as before (no draw, no
mixing). A source's URLS are anything `pipeline.data.shards.expand_shards` takes, commas included: a
part without ``NAME=`` belongs to the source before it. The weight ends the source (``:0.7``); left
out, it is 1. Weights are relative: 7 and 3 mix as 0.7 and 0.3.

Which source fills each sample place of a step is `draw_sources`: a pure function of (seed, epoch,
step of the epoch, rank, place), a counter-based generator (Philox) keyed by all but the place. The
epoch's steps count from its start, not the run's: a rank's mixed stream of an epoch is then known
before the epoch's first step (its pipeline can start while the last epoch's steps train, as a
single source's does). A run resumed mid-epoch draws what a straight run drew, and each source's own
stream (its shards `order[rank::world]` of the source's shard order, read like a single source's) is
re-read to where it stood; so a resumed mixed run trains on the samples of a straight one, in the same
order. At another layout it goes on by sample (`pipeline.train.input.source_position`): a `SourceReader`
tags what it hands out with its source and pass, and may start at a later pass.

`mixed_micro_batches` takes, for each micro-batch, the drawn number of samples from each source's
stream and puts them in the drawn places. A source's stream that runs out (its pass over its shards on
this rank is over) either starts its next pass with a new shard order (``cycle``) or ends the epoch
(``end``). With ``cycle`` the epoch ends once every source has finished a pass: an epoch is every
sample of the largest source (relative to its weight) once, the smaller ones cycled meanwhile, as
resampled WebDataset / OpenCLIP runs treat them. With ``end`` it ends when the first source runs out:
no sample repeats within an epoch, and the shares hold to the end.

Each rank counts, per source, into `BadSamples.sources`: samples taken (``samples``), bad samples read
(``bad``), the pass of this epoch it is in (``pass``, from 1) and samples taken in that pass
(``in_pass``). No torch here.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples
from pipeline.data.config import sample_seed
from pipeline.data.shards import shard_id, split_top_level

Batch = dict[str, np.ndarray]

EXHAUSTED = ("cycle", "end")  # what a source that runs out does: next pass, or the epoch's end
_NAMED = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)=(.*)$", re.S)
_WEIGHT = re.compile(r"^(.*):([^:/]*)$", re.S)
_SPEC = "write NAME=URLS:WEIGHT, comma-separated, e.g. laion=s3://a/{000..999}.tar:0.7,cc=/data/cc:0.3"


class MixtureError(ValueError):
    """A ``--data`` mixture that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class Source:
    """One named source of a mixture: its shard URLs (as typed) and its relative weight."""

    name: str
    urls: str
    weight: float = 1.0


def is_sources_file(text: str) -> bool:
    """Whether a ``--data`` names a YAML file of sources (`parse_sources` reads it) rather than a spec."""
    text = text.strip()
    return text.endswith((".yaml", ".yml")) and "," not in text


def parse_sources(text: str) -> list[Source] | None:
    """The sources of a ``--data`` spec or YAML file, or None for one plain source (read as before)."""
    text = text.strip()
    if is_sources_file(text):
        return _from_yaml(text)
    parts = split_top_level(text, ",")
    if not _NAMED.match(parts[0].strip()):
        if any(_NAMED.match(p.strip()) for p in parts[1:]):
            raise MixtureError(f"--data {text[:80]!r} names some sources but not the first; {_SPEC}")
        return None
    groups: list[tuple[str, list[str]]] = []
    for part in parts:
        named = _NAMED.match(part.strip())
        if named:
            groups.append((named.group(1), [named.group(2).strip()]))
        else:
            groups[-1][1].append(part.strip())
    sources = []
    for name, urls in groups:
        last, weight = urls[-1], 1.0
        weighted = _WEIGHT.match(last)
        if weighted and (weighted.group(2) or last.endswith(":")):
            last, weight = weighted.group(1), _weight(name, weighted.group(2))
        urls = [u for u in [*urls[:-1], last] if u]
        sources.append(Source(name, ",".join(urls), weight))
    return _checked(sources)


def _weight(name: str, text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise MixtureError(f"source {name}: weight {text!r} is not a number; {_SPEC}") from None
    return weight


def _checked(sources: list[Source]) -> list[Source]:
    names = [s.name for s in sources]
    for source in sources:
        if not source.urls.strip():
            raise MixtureError(f"source {source.name} names no shards; give it URLs: {_SPEC}")
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise MixtureError(
                f"source {source.name}: weight {source.weight} must be a positive number (a share, e.g. 0.3)"
            )
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        parts = shares([s.weight for s in sources])
    if not (np.isfinite(parts).all() and (parts > 0).all()):  # 1e308 twice: the sum overflows, shares 0
        raise MixtureError(
            f"weights {', '.join(f'{s.name}: {s.weight:g}' for s in sources)} give no share to every source "
            "(too large or too far apart); give shares such as 0.7 and 0.3"
        )
    doubles = sorted({n for n in names if names.count(n) > 1})
    if doubles:
        raise MixtureError(f"source {doubles[0]} is named twice in --data; give each source its own name")
    return sources


def _yaml_problem(error: Exception) -> str:
    """Where PyYAML stopped and why, on one line: ``line 2, column 1: expected ',' or ']' ...``."""
    problem = getattr(error, "problem", None) or (str(error).splitlines() or [type(error).__name__])[0]
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def _unique_key_loader() -> type:
    """PyYAML's safe loader (plain data, nothing constructed) that refuses a key given twice in one
    mapping, where PyYAML keeps the last and drops the block before it without a word."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, Hashable):
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            problem=f"key {key!r} given twice (the first would be dropped)",
                            problem_mark=key_node.start_mark,
                        )
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _from_yaml(path: str) -> list[Source]:
    """``sources: [{name: laion, data: s3://a/{000..999}.tar, weight: 0.7}, ...]``, read with a safe loader
    that refuses duplicate keys (plain data, nothing constructed); PyYAML comes with Ray, a dependency of
    its own."""
    import yaml

    from pipeline import storage

    try:
        values = yaml.load(storage.read_text(storage.as_location(path)), Loader=_unique_key_loader())
    except OSError as e:
        raise MixtureError(f"cannot read the sources file {path}: {str(e).splitlines()[0]}") from e
    except yaml.YAMLError as e:
        raise MixtureError(
            f"the sources file {path} is not plain YAML: {_yaml_problem(e)}; fix it there"
        ) from e
    entries = values.get("sources") if isinstance(values, dict) else None
    if not isinstance(entries, list) or not entries:
        raise MixtureError(
            f"{path} holds no list under 'sources:'; "
            "write sources: [{name: laion, data: URLS, weight: 0.7}, ...]"
        )
    sources = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"name", "data", "weight"} or "data" not in entry:
            raise MixtureError(f"{path}: source {i + 1} needs name, data and weight (got {entry!r})")
        name = str(entry.get("name") or f"source{i + 1}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float | str):  # `yes` reads as True
            raise MixtureError(f"{path}: source {name}: weight {weight!r} is not a number; {_SPEC}")
        weight = _weight(name, str(weight))  # an int past float's range reads as inf, refused below
        data = entry["data"]
        urls = ",".join(map(str, data)) if isinstance(data, list) else str(data or "")
        sources.append(Source(name, urls, weight))
    return _checked(sources)


def check_disjoint(shards: dict[str, list[str]]) -> None:
    """Refuse shards named by two sources (source name -> its expanded shard URLs; a shard by its name,
    `shard_id`, however each signs it): each of their samples would be trained twice an epoch, with the
    same crops. A `MixtureError` naming the sources and shards."""
    owner: dict[str, str] = {}
    for name, urls in shards.items():
        shared = [shard_id(url) for url in urls if owner.setdefault(shard_id(url), name) != name]
        if shared:
            first = owner[shared[0]]
            listed = ", ".join(shared[:3]) + (f" and {len(shared) - 3} more" if len(shared) > 3 else "")
            raise MixtureError(
                f"sources {first} and {name} both read {len(shared)} shard(s) ({listed}): their samples "
                "would train twice an epoch; give each shard to one source (a larger weight trains a source "
                "more often)"
            )


def shares(weights: list[float]) -> np.ndarray:
    """The weights as shares that sum to 1 (float64)."""
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def draw_sources(
    weights: list[float], seed: int, epoch: int, step: int, rank: int, places: int
) -> np.ndarray:
    """The source index of each of the ``places`` sample places of step ``step`` of ``epoch`` (counted
    from the epoch's start) on ``rank``: place i takes the i-th uniform of a Philox generator keyed by
    (``seed``, ``epoch``, ``step``, ``rank``), through the cumulative shares (inverse CDF). Place i's draw
    does not depend on ``places``; int64 ``(places,)``."""
    key = sample_seed(seed, epoch, f"rank-{rank}", f"source-mix-{step}")
    uniform = np.random.Generator(np.random.Philox(key=key)).random(places)
    cumulative = np.cumsum(shares(weights))
    cumulative[-1] = 1.0  # rounding: the last source takes everything above the others
    return np.searchsorted(cumulative, uniform, side="right").astype(np.int64)


def pass_epoch(epoch: int, passes: int) -> int:
    """The epoch number a source's pass reads with (shard order, crops, shuffle buffer): the epoch itself
    for its first pass, a number of its own for each pass after it, so a cycled source is not re-read
    in the same order with the same crops."""
    if passes == 0:
        return epoch
    return sample_seed(0, epoch, "source-pass", str(passes)) % (2**62)


class SourceReader:
    """One source's stream of good samples on this rank, taken a few at a time; ``open_pass(p)`` gives the
    micro-batches of its pass p (0-based) in this epoch.

    Each sample taken, and each bad sample its pass counts, is tagged with the source's ``index`` and the
    pass (columns ``source`` and ``pass`` where the rows carry their ``index``), for the epoch's position
    by sample. A rank resumed at another layout starts at pass ``first`` (those before it were complete)
    and may find nothing left of its part of a pass up to ``begun`` (the last one any rank had begun)."""

    def __init__(
        self,
        name: str,
        open_pass: Callable[[int], Iterator[Batch]],
        counts: BadSamples,
        *,
        index: int = 0,
        first: int = 0,
        begun: int = -1,
    ):
        self.name, self.open_pass, self.counts = name, open_pass, counts
        self.index, self.begun = index, begun
        self.entry = counts.sources.setdefault(name, {"samples": 0, "bad": 0})
        self.entry.update({"pass": first + 1, "in_pass": 0})
        self.passes, self.batches = first, open_pass(first)
        self.pending: Batch = {}  # read; its last ``left`` samples not yet taken
        self.left = 0

    def take(self, n: int) -> tuple[list[Batch], bool]:
        """Up to ``n`` samples, as pieces; True when the pass ran out first."""
        pieces: list[Batch] = []
        while n > 0:
            if self.at_end():
                return pieces, True
            batch = self.pending
            start = len(batch["key"]) - self.left
            k = min(n, self.left)
            piece = {c: v[start : start + k] for c, v in batch.items()}
            if "index" in piece:
                piece["source"] = np.full(k, self.index, dtype=np.int64)
                piece["pass"] = np.full(k, self.passes, dtype=np.int64)
            pieces.append(piece)
            self.left -= k
            n -= k
            self.entry["samples"] += k
            self.entry["in_pass"] += k
        return pieces, False

    def at_end(self) -> bool:
        """Whether this pass has no sample left (reads its next micro-batch when none is pending)."""
        while not self.left:
            bad = self.counts.bad
            with self.counts.tagged(self.index, self.passes):  # the pass's filter counts in `next`
                batch = next(self.batches, None)
            self.entry["bad"] += self.counts.bad - bad
            if batch is None:
                return True
            self.pending, self.left = batch, len(batch["key"])
        return False

    def next_pass(self) -> None:
        """Its next pass, with a new shard order; a pass that gave no sample cannot be cycled (unless it
        was resumed: its part on this rank may have been consumed before)."""
        if not self.entry["in_pass"] and self.passes > self.begun:
            raise BadSampleBudgetError(
                f"source {self.name} gave no readable sample on a worker in a whole pass; check its shards, "
                "or give it more shards than workers"
            )
        self.close()
        self.passes += 1
        self.entry.update({"pass": self.passes + 1, "in_pass": 0})
        self.batches, self.pending, self.left = self.open_pass(self.passes), {}, 0

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()


def mixed_micro_batches(
    readers: list[SourceReader],
    weights: list[float],
    *,
    seed: int,
    rank: int,
    epoch: int,
    accum: int,
    size: int,
    exhausted: str,
) -> Iterator[Batch]:
    """One rank's micro-batches of ``epoch``, each place filled from the source `draw_sources` drew for
    it; ``exhausted`` says what a source that runs out does (module doc). The last micro-batch may be
    short (the places of the source that ran out are left empty)."""
    # A source whose first pass was complete before a resume at another layout has run out on every rank.
    done = [reader.passes > 0 for reader in readers]
    try:
        if all(done) or (exhausted == "end" and any(done)):
            return
        for index in itertools.count():
            step, micro = divmod(index, accum)
            if micro == 0:
                drawn = draw_sources(weights, seed, epoch, step, rank, accum * size)
            places = drawn[micro * size : (micro + 1) * size]
            pieces, filled, over = [], [], False
            for s, reader in enumerate(readers):
                wanted = int((places == s).sum())
                got, ran_out = reader.take(wanted)
                while ran_out:
                    done[s] = True
                    if exhausted == "end" or all(done):
                        over = True
                        break
                    reader.next_pass()
                    more, ran_out = reader.take(wanted - sum(len(p["key"]) for p in got))
                    got += more
                pieces += got
                filled.append(sum(len(p["key"]) for p in got))
            # A pass that ends with this micro-batch counts as run out now, not at the next one's draw.
            done = [d or reader.at_end() for d, reader in zip(done, readers, strict=True)]
            over = over or all(done) or (exhausted == "end" and any(done))
            batch = _in_places(pieces, places, filled)
            if batch is not None:
                yield batch
            if over:
                return
    finally:
        for reader in readers:
            reader.close()


def _in_places(pieces: list[Batch], places: np.ndarray, filled: list[int]) -> Batch | None:
    """The pieces (source by source, in order) put in their drawn places; places a source could not fill
    are dropped. None when nothing was filled."""
    if not pieces:
        return None
    merged = {c: np.concatenate([p[c] for p in pieces]) for c in pieces[0]}
    offsets = np.concatenate([[0], np.cumsum(filled)[:-1]]).astype(np.int64)
    seen = np.zeros(len(filled), dtype=np.int64)
    rows = []
    for s in places.tolist():
        if seen[s] < filled[s]:
            rows.append(offsets[s] + seen[s])
        seen[s] += 1
    index = np.asarray(rows, dtype=np.int64)
    return {c: v[index] for c, v in merged.items()}
