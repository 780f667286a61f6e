"""`jobs/audit.py`: what a run trained, checked against its shards, from a checkpoint's ledger
(`pipeline.train.input.ledger`): every good sample of every finished epoch trained once, the current
epoch's consumed part once.

    python jobs/audit.py --run /tmp/run                                  # its latest checkpoint, its --data
    python jobs/audit.py --run s3://b/runs/h14 --data 's3://b/moved/train-{000000..002047}.tar'

It reads each shard of the run once, member headers only (the images are read past, never decoded), and
for every part of the ledger compares, shard by shard, the samples the run trained and the bad ones it
counted with what the shard holds: their count, and the hash of their keys that no order changes.

- A finished epoch: every sample of the shard, once (trained, or counted bad).
- The current epoch: the samples its position by sample names as consumed (`TrainState.epoch_consumed`),
  once each.
- Sources mixed by weight: an epoch reads each source in passes; a pass the epoch finished holds every
  sample of the source once, a pass it began only the samples its position names (the current epoch's, or
  the one the ledger kept at a finished epoch's end).
- The bad samples of the ledger, all epochs together, are the run's bad-sample counts.

Each shard whose count or hash is off is named, with how many samples it holds and how many were counted.
Exit code 0: all once; 1: some shard off (or unreadable); 2: bad input (no checkpoint, a checkpoint
without a ledger, shards that are not the run's).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pipeline import cli, dcp, storage
from pipeline.data.bad_samples import BadSamples
from pipeline.data.consumed import Consumed
from pipeline.data.rows import ShardLostError, sample_keys
from pipeline.data.shards import shard_id
from pipeline.settings import setting
from pipeline.storage import Location, Storage
from pipeline.train.input.ledger import MOD, decode_parts, key_hash, part_epoch
from pipeline.train.input.position import shards_fingerprint
from pipeline.train.state import TrainState


@dataclass(frozen=True)
class AuditConfig(Storage):
    """One audit of a run; ``jobs/audit.py`` maps its flags onto it."""

    run: str = setting(
        help="the run directory: a training run's --out (local path, s3://, gs://)", required=True
    )
    data: str | None = setting(
        None, "where the run's shards are now, when they moved (default: the run's own --data)"
    )
    checkpoint: str | None = setting(
        None, "the checkpoint to audit, e.g. checkpoint_00001000 (default: the latest)"
    )
    threads: int = setting(8, "shards read at once", ge=1, le=1024)


def audit_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/audit.py`'s command line (one process, no Ray)."""
    return cli.job_parser("jobs/audit.py", description, AuditConfig, defaults=AuditConfig(run=""), ray=False)


@dataclass(frozen=True)
class Shard:
    """What a shard holds: its samples' keys in tar order (a key's place is its sample's index) and their
    hashes."""

    keys: list[str]
    hashes: list[int]

    @classmethod
    def of(cls, keys: list[str]) -> Shard:
        return cls(keys, [key_hash(k) for k in keys])

    def expected(self, consumed: Consumed | None = None) -> tuple[int, int]:
        """(samples, hash) of all its samples, or of those ``consumed`` names."""
        if consumed is None:
            return len(self.keys), sum(self.hashes) % MOD
        bounds = consumed.bounds
        picked = [h for a, b in zip(bounds[::2], bounds[1::2], strict=True) for h in self.hashes[a:b]]
        return len(picked), sum(picked) % MOD


@dataclass(frozen=True)
class Finding:
    """A shard whose samples in one part (an epoch, or a mixed run's pass of it) are not each once."""

    part: str
    shard: str
    holds: int  # what the part should have consumed of the shard
    counted: int  # trained and counted bad
    bad: int

    def text(self) -> str:
        what = f"epoch {self.part.split('/')[0]}" + (
            f" pass {self.part.split('/')[1]}" if "/" in self.part else ""
        )
        if self.counted > self.holds:
            off = f"{self.counted - self.holds} repeated"
        elif self.counted < self.holds:
            off = f"{self.holds - self.counted} missing"
        else:
            off = "as many as it should, but other samples: some missing, others repeated"
        return f"{what}: shard {self.shard}: {self.counted} counted ({self.bad} bad) of {self.holds}: {off}"


@dataclass
class Report:
    """What an audit found: a line per part, the findings, and notes on what it could not check."""

    head: str
    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # not per shard: unreadable shards, bad counts
    finished: int = 0  # epochs checked whole

    @property
    def ok(self) -> bool:
        return not self.findings and not self.problems

    def format(self) -> str:
        """Every line of the report; the last says the verdict (`verdict`)."""
        out = [self.head, *self.lines, *(f"  {f.text()}" for f in self.findings), *self.problems]
        return "\n".join([*out, self.verdict()])

    def verdict(self) -> str:
        if self.ok:
            return (
                f"ok: every good sample of {self.finished} finished epoch(s) trained once, and the current "
                "epoch's consumed samples once"
            )
        names = sorted({f.shard for f in self.findings})
        return (
            f"{len(names)} shard(s) with missing or repeated samples"
            + (f" ({', '.join(names[:5])}{' ...' if len(names) > 5 else ''})" if names else "")
            + (f"; {len(self.problems)} other problem(s)" if self.problems else "")
        )


def audit(
    state: TrainState,
    shards: list[str],
    mixture: list[dict[str, Any]] | None,
    keys_of: Callable[[str], list[str]],
    *,
    threads: int = 8,
    head: str = "",
) -> Report:
    """The checkpoint's ``state`` against ``shards`` (the run's list, as its workers had it; ``mixture``:
    each source's ``{"name", "shards"}`` of a mixed run), each read with ``keys_of``. Raises a one-line
    ValueError when the ledger is missing or of other shards."""
    check(state, shards, head)
    ledger, report = state.ledger, Report(head)
    read: dict[int, Shard] = {}
    with ThreadPoolExecutor(threads) as pool:
        for slot, got in zip(range(len(shards)), pool.map(_reader(keys_of), shards), strict=True):
            if isinstance(got, str):
                report.problems.append(got)
            else:
                read[slot] = got
    since = ledger.get("since") or {}
    parts = decode_parts(ledger.get("parts", {}))
    for epoch in range(state.epoch + 1):
        if since and epoch <= since["epoch"]:
            report.lines.append(
                f"epoch {epoch}: not audited: the ledger begins at step {since['step']} "
                f"(epoch {since['epoch']}): "
                "the checkpoints before it predate the ledger, or trained other shards"
            )
            continue
        current = epoch == state.epoch
        if current and not state.epoch_consumed and state.epoch_position.get("micro_batches"):
            report.lines.append(f"epoch {epoch}: current: no position by sample to check it against")
            continue
        expected = _expected(epoch, current, state, shards, mixture, ledger, read)
        counted = {part: parts.get(part, {}) for part in expected} | {
            part: entries for part, entries in parts.items() if part_epoch(part) == epoch
        }
        found, total, bad = [], 0, 0
        for part in sorted(counted, key=lambda p: [int(x) for x in p.split("/")]):
            holds, entries = expected.get(part, {}), counted[part]
            for slot in sorted(set(holds) | set(entries)):
                if slot not in read:
                    continue  # unreadable: a problem of its own
                n, h = holds.get(slot, (0, 0))
                e = entries.get(slot, [0, 0, 0, 0])
                total, bad = total + e[0] + e[2], bad + e[2]
                if e[0] + e[2] != n or (e[1] + e[3]) % MOD != h:
                    found.append(Finding(part, shard_id(shards[slot]), n, e[0] + e[2], e[2]))
        state_of = "current" if current else "finished"
        verdict = f"{len({f.shard for f in found})} shard(s) off" if found else "every one once"
        report.lines.append(f"epoch {epoch}: {state_of}, {total} samples ({bad} bad): {verdict}")
        report.findings += found
        report.finished += not current and not found
    in_ledger = sum(e[2] for entries in parts.values() for e in entries.values())
    in_counts = sum(BadSamples.from_dict(one).bad for one in state.bad_samples)
    if not since and in_ledger != in_counts:
        report.problems.append(f"bad samples: {in_ledger} in the ledger, {in_counts} in the run's counts")
    return report


def check(state: TrainState, shards: list[str], head: str = "") -> None:
    """A one-line ValueError when the checkpoint holds no ledger, or one of other shards than ``shards``."""
    ledger = state.ledger
    if not ledger:
        raise ValueError(
            f"{head or 'the checkpoint'}: it holds no ledger (written before one was kept): nothing to audit"
        )
    if ledger.get("shards") != shards_fingerprint(shards):
        raise ValueError(
            f"the {len(shards)} shards found are not the run's ({ledger.get('count')} shards, named "
            "otherwise): "
            "pass --data with where the run's shards are now"
        )


def _reader(keys_of: Callable[[str], list[str]]) -> Callable[[str], Shard | str]:
    def read(url: str) -> Shard | str:
        try:
            return Shard.of(keys_of(url))
        except ShardLostError as e:
            return f"unreadable: {e}"

    return read


Expected = dict[str, dict[int, tuple[int, int]]]  # part -> slot -> (samples, hash)


def _expected(
    epoch: int,
    current: bool,
    state: TrainState,
    shards: list[str],
    mixture: list[dict[str, Any]] | None,
    ledger: dict[str, Any],
    read: dict[int, Shard],
) -> Expected:
    """What each part of ``epoch`` should have consumed of each shard: all of it for a finished epoch (a
    mixed run's finished passes), else the samples the position names."""
    from pipeline.train.input.position import EpochPosition

    slot_of = {shard_id(url): i for i, url in enumerate(shards)}
    out: Expected = {}

    def add(part: str, position: EpochPosition | None, urls: list[str]) -> None:
        for url in urls:
            slot = slot_of[shard_id(url)]
            if slot not in read:
                continue
            if position is None:
                out.setdefault(part, {})[slot] = read[slot].expected()
                continue
            local = position.slots[shard_id(url)]
            if local in position.done:
                out.setdefault(part, {})[slot] = read[slot].expected()
            elif local in position.partial:
                out.setdefault(part, {})[slot] = read[slot].expected(position.partial[local])

    if mixture is None:
        if current:
            add(str(epoch), EpochPosition(shards).update(state.epoch_consumed), shards)
        else:
            add(str(epoch), None, shards)
        return out
    record = state.epoch_consumed if current else ledger.get("ends", {}).get(str(epoch), {})
    for source in mixture:
        entry = record.get("sources", {}).get(source["name"], {})
        done = int(entry.get("passes_done", 0))
        for p in range(done):
            add(f"{epoch}/{p}", None, source["shards"])
        for p, one in entry.get("passes", {}).items():
            if int(p) >= done:
                add(f"{epoch}/{p}", EpochPosition(source["shards"]).update(one), source["shards"])
    return out


def audit_command(args: argparse.Namespace) -> int:
    """`jobs/audit.py`: the checkpoint's ledger against the run's shards; exit code 0 or 1 (module
    docstring)."""
    if (config := cli.configured(args, AuditConfig)) is None:
        return 0
    report = audit_run(config, begin=cli.start_work)
    if not report.ok:  # the report, then its verdict as the job's one error line (exit code 1)
        print("\n".join(report.format().splitlines()[:-1]), flush=True)
        raise cli.RunFailed(report.verdict())
    print(report.format(), flush=True)
    return 0


def audit_run(config: AuditConfig, begin: Callable[[], None] = lambda: None) -> Report:
    """The audit of ``config.run``'s checkpoint (`audit`), its shards those of its own config unless
    ``config.data``; ``begin`` is called once the one-line refusals are past, before the shards are read."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.driver import expand_data

    where, state, saved = checkpoint_state(config.location(config.run), config.checkpoint)
    train = TrainConfig.from_dict(saved["train"]).replace(storage_options=config.storage_options)
    if config.data:
        train = train.replace(shards=config.data)
    shards, mixture = expand_data(train)
    head = (
        f"audit of {config.run} at {where.url.rstrip('/').rsplit('/', 1)[-1]} (step {state.step}, epoch "
        f"{state.epoch}): {len(shards)} shards"
    )
    check(state, shards, head)
    begin()
    return audit(
        state,
        shards,
        mixture,
        lambda url: sample_keys(train.location(url)),
        threads=config.threads,
        head=head,
    )


def checkpoint_state(run: Location, name: str | None = None) -> tuple[Location, TrainState, dict[str, Any]]:
    """(the checkpoint, its `TrainState`, its saved config): ``name`` under ``run``, else the latest
    complete one; a one-line ValueError when there is none."""
    where = _checkpoint(run, name)
    state = TrainState.from_dict(json.loads(storage.read_text(where.join(dcp.TRAIN_STATE))))
    return where, state, json.loads(storage.read_text(where.join(dcp.CONFIG)))


def _checkpoint(run: Location, name: str | None) -> Location:
    """The checkpoint to audit: ``name`` under the run, else its latest complete one; a one-line
    ValueError."""
    if name:
        where = run.join(name)
        if not dcp.is_complete(where):
            raise ValueError(
                f"{where.url} is no complete checkpoint: name one of the run's checkpoint_* directories"
            )
        return where
    latest = dcp.latest_complete(run)
    if latest is None:
        raise ValueError(f"{run.url} holds no complete checkpoint: pass --run with a training run's --out")
    return latest
