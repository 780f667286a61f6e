"""Read rows: which members of a WebDataset sample make a row, and Arrow blocks of rows for one shard.

Rows (one per sample, Arrow blocks of up to ``block_rows`` samples, no per-sample pandas frames):

- ``key``: str, the WebDataset ``__key__``
- ``url``: str, the shard the sample came from, by its name (`pipeline.data.shards.shard_id`: no query string)
- ``image``: binary, the encoded image member (b"" on error rows)
- ``label``: int64, -1 when the sample has none
- ``error``: str, "" for a good sample, otherwise ``"<category>: <detail>"``
- ``index``: int64, the sample's place in the shard's tar order, every sample counted (-1 on the rows
  that mark an unreadable or lost shard): with the shard, a sample's name in a data position
  (`pipeline.data.consumed`)
- ``shard_size``: int64, on the last row read of a shard the number of samples the shard holds; -1
  on every other row (a consumer learns there that the shard is done)

A shard that cannot be opened, a truncated tar or a sample with a problem becomes an error row;
reading never raises on bad data. Pure Python + pyarrow: no Ray here (`pipeline.data.source` wraps it).

Storage failures, and only they, are retried (`Retry`): a failure to open the shard or to read its bytes
(`ShardReadError`). Whatever a sample's content makes a parser raise is that sample's error row
(`sample_rows`), so it is never taken for a storage failure. A retry opens the shard again and reads it
from its start, the samples
already made into rows are skipped (their keys checked), so a retry neither repeats nor drops a sample.
A shard still unreadable after the last try ends in one ``unreadable shard`` row: its samples are
unknown, so a consumer must not count it as one bad sample (training stops with `ShardLostError`;
the embedding job commits nothing for it and retries it on its next run).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import pyarrow as pa

from pipeline.data.bad_samples import LOST_SHARD, BadSampleBudgetError
from pipeline.data.consumed import Consumed
from pipeline.data.shards import open_shard, shard_id
from pipeline.data.tar import Sample, ShardReadError, iter_samples, open_tar_stream
from pipeline.redaction import public_text
from pipeline.storage import Location

SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("url", pa.string()),
        ("image", pa.binary()),
        ("label", pa.int64()),
        ("error", pa.string()),
        ("index", pa.int64()),
        ("shard_size", pa.int64()),
    ]
)
Row = tuple[str, bytes, int, str, int, int]  # key, image, label, error, index, shard_size
MAX_BLOCK_BYTES = 64 << 20  # encoded bytes per block; far below Arrow's 2 GiB binary-array limit
UNREADABLE = "unreadable shard"
INT64_MAX = 2**63 - 1
_DIGITS = re.compile(r"[0-9]+")
_ASCII_SPACE = " \t\n\r\x0b\x0c"
# Failures that another try cannot mend: the shard is not there, or not ours to read.
_FINAL = (FileNotFoundError, IsADirectoryError, PermissionError)


class ShardLostError(BadSampleBudgetError):
    """A shard stayed unreadable after every try. A `BadSampleBudgetError`, so that consumers which stop
    cleanly (one line) on a passed budget stop on this too: its samples are unknown, not one bad one."""


class _ShardChangedError(Exception):
    """The shard read on a retry is not the one read before (another sample where the last one was)."""


@dataclass(frozen=True)
class Retry:
    """How hard a read task tries one shard: ``attempts`` tries in all, waiting ``backoff_s``, then twice
    that, and so on between them (each wait shortened by a random share of up to half, so that tasks
    failing together do not retry together): at most ``backoff_s * (2 ** (attempts - 1) - 1)`` seconds."""

    attempts: int = 4
    backoff_s: float = 0.5

    def wait(self, failures: int) -> float:
        return self.backoff_s * 2 ** (failures - 1) * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class RowSpec:
    """Which members make a row: the image (first of ``image_keys`` present) and the label.

    ``label_key`` is a member extension holding a decimal integer (``"cls"``), ``"json:<field>"`` for
    a field of the ``.json`` member (dots walk nested objects: ``"json:meta.label"``), or None.
    With ``num_classes``, a label outside ``[0, num_classes)`` makes the sample bad (``label out of
    range``): it would otherwise reach the loss as an index past the logits.
    """

    image_keys: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    label_key: str | None = "cls"
    require_labels: bool = False
    num_classes: int | None = None

    @property
    def label_member(self) -> str | None:
        if self.label_key is None:
            return None
        return "json" if self.label_key.startswith("json:") else self.label_key.lower()

    def wanted(self, ext: str) -> bool:
        """Members kept in memory; the others are read past and dropped."""
        return ext in self.image_keys or ext == self.label_member

    def image(self, sample: Sample) -> bytes | None:
        for ext in self.image_keys:
            if ext in sample.members:
                return sample.members[ext]
        return None

    def label(self, sample: Sample) -> tuple[int, str]:
        """``(label, error)``: -1 when absent, an error then only when labels are required; a label
        member that holds no class index is an error in every job (``bad label``)."""
        member = self.label_member
        if member is None:  # a job that requires labels refuses a missing label key before it reads
            return -1, "missing label: no label key given" if self.require_labels else ""
        raw = sample.members.get(member)
        if raw is None:
            if self.require_labels:
                return -1, f"missing label: no .{member} member (label_key={self.label_key!r})"
            return -1, ""
        try:
            label = parse_label(raw, self.label_key)
        except ValueError as e:
            return -1, f"bad label: {e}"
        if self.num_classes is not None and label >= self.num_classes:
            return -1, f"label out of range: {label} is not in [0, {self.num_classes}) (num_classes)"
        return label, ""


def parse_label(raw: bytes, label_key: str) -> int:
    """A class index from a label member; ValueError says why not.

    A class index is written in ASCII digits, surrounding ASCII whitespace allowed (``b"7\\n"``), and
    fits int64: Python's `int` would also take ``"٣"``, ``"７"``, ``"1_0"`` and ``"+2"``, and a number
    past int64 would break the Arrow column of the whole block. A ``.json`` field may also hold it as a
    JSON integer.
    """
    if label_key.startswith("json:"):
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
            raise ValueError(".json member is not valid JSON") from e
        for part in label_key[len("json:") :].split("."):
            if not isinstance(value, dict) or part not in value:
                raise ValueError(f".json member has no field {label_key[5:]!r}")
            value = value[part]
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"label {value} is negative")
            return _class_index(str(value) if value <= INT64_MAX else "9" * 20)
        if not isinstance(value, str):
            raise ValueError(f"field {label_key[5:]!r} holds {str(value)[:40]}, not an integer")
        text = value
    else:
        text = raw.decode("utf-8", "replace")
    return _class_index(text.strip(_ASCII_SPACE))


def _class_index(text: str) -> int:
    if not _DIGITS.fullmatch(text):
        raise ValueError(f"label {text[:40]!r} is not a class index (ASCII digits 0-9)")
    if len(text.lstrip("0")) > len(str(INT64_MAX)) or int(text) > INT64_MAX:
        raise ValueError(f"label {text[:40]} does not fit int64")
    return int(text)


def sample_rows(samples: Iterable[Sample], spec: RowSpec) -> Iterator[tuple[str, bytes, int, str]]:
    """``(key, image, label, error)`` per sample; the first problem found is the row's error.

    Whatever a sample's bytes make a parser raise is that sample's error, never an exception: one
    escaping from here would be taken for a storage failure of the whole shard.
    """
    for sample in samples:
        image, label, error = b"", -1, sample.error
        if not error:
            try:
                image, label, error = _sample_row(sample, spec)
            except Exception as e:
                error = f"bad sample: {type(e).__name__}: {_one_line(e)}"
        if error:
            image, label = b"", -1
        yield sample.key, image, label, error


def _sample_row(sample: Sample, spec: RowSpec) -> tuple[bytes, int, str]:
    found = spec.image(sample)
    if found is None:
        exts = ", ".join(sorted(sample.members)) or "none wanted"
        return b"", -1, f"missing image: no {'/'.join('.' + k for k in spec.image_keys)} member ({exts})"
    label, error = spec.label(sample)
    return found, label, error


def read_shard(
    shard: Location | str,
    spec: RowSpec,
    block_rows: int,
    retry: Retry | None = None,
    skip: Consumed | None = None,
) -> Iterator[pa.Table]:
    """Arrow blocks of rows for one shard, in tar order; never raises on bad data.

    A storage failure is retried as ``retry`` says (see the module docstring); a shard still unreadable
    then adds one ``unreadable shard`` error row (key "") after the rows read before; a shard that gives
    no readable sample (no sample at all, or only bad ones: zeros, an HTML page, a tar of broken images)
    ends with one ``lost shard`` row (key ""), counted apart from bad samples (`BadSamples.lost`).
    The samples in ``skip`` (consumed before: `pipeline.data.consumed`) are read past, never made
    into rows; a shard read before is not lost for giving no row now.
    """
    retry, url = retry or Retry(), shard_id(str(shard))  # rows name the shard, never its signature
    rows: list[Row] = []
    held: Row | None = None  # the latest row, kept back until the next: the last one carries the size
    nbytes, done, last_key = 0, 0, ""  # done: samples read past or made into rows, by every try so far
    good, first_error = 0, ""  # rows without an error; the first error row's reason
    failures, waited = 0, 0.0
    while True:
        try:
            for index, key, row in _rows_after(shard, spec, done, last_key, skip):
                done, last_key = index + 1, key
                if row is None:
                    continue
                if held is not None:
                    rows.append(held)
                    nbytes += len(held[1])
                    if len(rows) >= block_rows or nbytes >= MAX_BLOCK_BYTES:
                        yield _table(rows, url)
                        rows, nbytes = [], 0
                held = row
                good, first_error = good + (not row[3]), first_error or row[3]
            if held is not None:
                rows.append((*held[:5], done))
                held = None
            if not good and not (skip and len(skip)):  # a lost shard, counted apart (`BadSamples.lost`)
                why = (
                    f"{done} row(s), none readable, first: {first_error}"
                    if done
                    else "the tar holds no samples"
                )
                rows.append(("", b"", -1, f"{LOST_SHARD}: {why}", -1, -1))
            break
        except (ShardReadError, *_FINAL, _ShardChangedError) as e:  # storage, never a sample's content
            failures += 1
            if failures >= retry.attempts or isinstance(e, (*_FINAL, _ShardChangedError)):
                tries = "1 try" if failures == 1 else f"{failures} tries over {waited:.1f} s"
                what = (
                    _one_line(e) if isinstance(e, ShardReadError) else f"{type(e).__name__}: {_one_line(e)}"
                )
                if held is not None:
                    rows.append(held)
                rows.append(("", b"", -1, f"{UNREADABLE}: {what} ({tries}; {done} read)", -1, -1))
                break
            pause = retry.wait(failures)
            time.sleep(pause)
            waited += pause
    if rows:
        yield _table(rows, url)


def sample_keys(shard: Location | str, retry: Retry | None = None) -> list[str]:
    """The keys of a shard's samples in tar order, each sample counted as `read_shard` counts it (a key's
    place in the list is its sample's ``index``), no member read into memory. Storage failures are retried
    as `read_shard` retries them; a shard still unreadable raises `ShardLostError`."""
    retry, failures = retry or Retry(), 0
    while True:
        try:
            with _opened(shard) as stream:
                return [sample.key for sample in iter_samples(stream, lambda ext: False)]
        except (ShardReadError, *_FINAL) as e:
            failures += 1
            if failures >= retry.attempts or isinstance(e, _FINAL):
                what = (
                    _one_line(e) if isinstance(e, ShardReadError) else f"{type(e).__name__}: {_one_line(e)}"
                )
                raise ShardLostError(f"shard {shard_id(str(shard))} could not be read: {what}") from e
            time.sleep(retry.wait(failures))


def _rows_after(
    shard: Location | str, spec: RowSpec, skip: int, last_key: str, consumed: Consumed | None
) -> Iterator[tuple[int, str, Row | None]]:
    """``(index, key, row)`` of the shard's samples from its ``skip``-th on, ``row`` None for those in
    ``consumed``; sample ``skip - 1`` must have key ``last_key``."""
    with _opened(shard) as stream:
        for index, sample in enumerate(iter_samples(stream, spec.wanted)):
            if index >= skip:
                if consumed is not None and index in consumed:
                    yield index, sample.key, None
                    continue
                for key, image, label, error in sample_rows([sample], spec):
                    yield index, sample.key, (key, image, label, error, index, -1)
            elif index == skip - 1 and sample.key != last_key:
                raise _ShardChangedError(
                    f"shard changed between tries: sample {index} is {sample.key!r}, was {last_key!r}"
                )


@contextlib.contextmanager
def _opened(shard: Location | str) -> Iterator[IO[bytes]]:
    """The shard's tar stream. Whatever opening it raises is a storage failure: a `ShardReadError`
    (tried again), or one of `_FINAL` as it is (not)."""
    try:
        fileobj = open_shard(shard)
    except _FINAL:
        raise
    except Exception as e:
        raise ShardReadError(f"{type(e).__name__}: {_one_line(e)}") from e
    try:
        try:
            stream = open_tar_stream(fileobj, shard_id(str(shard)))  # reads the first bytes (gzip or not)
        except Exception as e:
            raise ShardReadError(f"{type(e).__name__}: {_one_line(e)}") from e
        yield stream
    finally:
        with contextlib.suppress(Exception):  # a read-only file: closing it loses nothing
            fileobj.close()


def raise_lost_shard(batch: dict) -> None:
    """Raise `ShardLostError` (one line) when a batch of rows holds an ``unreadable shard`` row."""
    for url, error in zip(batch["url"], batch["error"], strict=True):
        if error.startswith(UNREADABLE):
            raise ShardLostError(
                f"shard {url} was lost: {error}; its samples are unknown, so the run stops rather than "
                "skip them: check the storage, then run the same command again (it resumes from its last "
                "checkpoint)"
            )


def _table(rows: list[Row], url: str) -> pa.Table:
    keys, images, labels, errors, indices, sizes = zip(*rows, strict=True)
    return pa.Table.from_arrays(
        [
            pa.array(keys, pa.string()),
            pa.array([url] * len(rows), pa.string()),
            pa.array(images, pa.binary()),
            pa.array(labels, pa.int64()),
            pa.array(errors, pa.string()),
            pa.array(indices, pa.int64()),
            pa.array(sizes, pa.int64()),
        ],
        schema=SCHEMA,
    )


def _one_line(e: BaseException) -> str:
    """The first line of an error's message, its URLs without query string (a storage error names the URL
    it read, signature and all; error rows go into outputs)."""
    text = str(e).strip().splitlines()
    return public_text(text[0])[:200] if text else ""
