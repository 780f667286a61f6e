"""Storage that fails: a shard's reads are retried, and what comes back is every sample exactly once.

The faults come from `FlakyFileSystem`, an in-memory fsspec filesystem that fails the opens and reads
its test schedules (a refused open, a connection that drops after some bytes). No Ray.
"""

from __future__ import annotations

import io
import time

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples
from pipeline.data.config import DataConfig
from pipeline.data.dataset import iter_batches
from pipeline.data.rows import Retry, RowSpec, ShardLostError, read_shard
from pipeline.data.writing import tar_bytes

SPEC = RowSpec(require_labels=True)
FAST = Retry(attempts=4, backoff_s=0.01)


class FlakyFileSystem(MemoryFileSystem):
    """Each open takes the next entry of ``faults``: "open" refuses the open, an int ``n`` opens a file
    whose connection drops once ``n`` bytes have been read, None opens a sound file."""

    protocol = "flaky"
    store: dict = {}  # noqa: RUF012 (MemoryFileSystem's own layout: one store per class)
    pseudo_dirs: list = [""]  # noqa: RUF012
    faults: list = []  # noqa: RUF012
    opens = 0

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("flaky://"))

    def _open(self, path, mode="rb", **kwargs):
        FlakyFileSystem.opens += 1
        fault = FlakyFileSystem.faults.pop(0) if FlakyFileSystem.faults else None
        if fault == "open":
            raise ConnectionError("503 Slow Down")
        f = super()._open(path, mode, **kwargs)
        return f if fault is None or "w" in mode else _DroppingFile(f, fault)


class _DroppingFile(io.RawIOBase):
    def __init__(self, inner, drop_at: int):
        self.inner, self.drop_at = inner, drop_at

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset, whence=0):
        return self.inner.seek(offset, whence)

    def tell(self):
        return self.inner.tell()

    def read(self, n=-1):
        if self.inner.tell() + (n if n >= 0 else 1 << 62) > self.drop_at:
            chunk = self.inner.read(max(self.drop_at - self.inner.tell(), 0))
            if chunk:
                return chunk  # the bytes that arrived before the drop
            raise TimeoutError("read timed out (connection reset by peer)")
        return self.inner.read(n)


@pytest.fixture
def flaky():
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    FlakyFileSystem.store.clear()
    FlakyFileSystem.faults, FlakyFileSystem.opens = [], 0
    yield FlakyFileSystem
    FlakyFileSystem.faults = []


def put(fs, name: str, data: bytes) -> str:
    fs.store.clear()
    fs().pipe(f"/{name}", data)
    return f"flaky:///{name}"


MEMBERS = [
    (f"{i:04d}.{ext}", b"J%d" % i * 200 if ext == "jpg" else b"%d" % i)
    for i in range(12)
    for ext in ("cls", "jpg")
]


def rows_of(url: str, retry: Retry = FAST, block_rows: int = 3) -> list[dict]:
    return pa.concat_tables(read_shard(url, SPEC, block_rows, retry)).to_pylist()


@pytest.mark.parametrize("gzip", [False, True])
def test_refused_opens_and_dropped_connections_are_retried_to_every_sample_once(flaky, gzip):
    raw = tar_bytes(MEMBERS, gzip=gzip)
    url = put(flaky, "s.tar.gz" if gzip else "s.tar", raw)
    clean = rows_of(url)
    assert [r["key"] for r in clean] == [f"{i:04d}" for i in range(12)] and not any(r["error"] for r in clean)
    cut = len(raw) // 2  # inside a sample's data: blocks before it have been handed on already
    for faults in (["open", "open"], [cut], [cut, "open", cut + len(raw) // 4], [len(raw) // 8, cut]):
        flaky.faults, flaky.opens = list(faults), 0
        assert rows_of(url) == clean, faults
        assert flaky.opens == len(faults) + 1


def test_a_shard_that_stays_unreadable_is_one_unreadable_row_after_bounded_tries(flaky):
    raw = tar_bytes(MEMBERS)
    url = put(flaky, "s.tar", raw)
    clean = rows_of(url)
    flaky.faults, flaky.opens = [len(raw) // 2] * 10, 0
    retry = Retry(attempts=3, backoff_s=0.05)
    start = time.perf_counter()
    got = rows_of(url, retry)
    elapsed = time.perf_counter() - start
    assert flaky.opens == 3 and elapsed < 0.05 * 3 + 1.0  # waits of at most 0.05 + 0.1 s
    *good, lost = got
    assert good == clean[: len(good)] and len(good) >= 3  # what was read stays, exactly once
    assert lost["key"] == "" and lost["error"].startswith("unreadable shard: TimeoutError: read timed out")
    assert "(3 tries over " in lost["error"] and f"; {len(good)} read)" in lost["error"]

    # A shard that is not there is not worth another try.
    flaky.opens = 0
    (gone,) = rows_of("flaky:///gone.tar")
    assert flaky.opens == 1 and gone["error"].startswith("unreadable shard: FileNotFoundError")
    assert "(1 try; 0 read)" in gone["error"]


def test_a_shard_replaced_between_tries_is_not_stitched_together(flaky):
    url = put(flaky, "s.tar", tar_bytes(MEMBERS))
    first = rows_of(url)
    cut = len(tar_bytes(MEMBERS)) // 2
    flaky.faults = [cut]
    rows = read_shard(url, SPEC, 3, FAST)
    taken = next(rows).to_pylist()  # the first block, read from the original shard
    flaky.store.clear()
    flaky().pipe("/s.tar", tar_bytes([(f"x{n}", d) for n, d in MEMBERS]))  # other keys, same sizes
    rest = pa.concat_tables(list(rows)).to_pylist()
    assert taken + rest[:-1] == first[: len(taken) + len(rest) - 1]
    assert rest[-1]["error"].startswith("unreadable shard: _ShardChangedError: shard changed between tries")


class _Rows:
    """Stands for a Ray dataset: `iter_batches` hands out the given batches."""

    def __init__(self, batches):
        self.batches = batches

    def iter_batches(self, **kwargs):
        return iter(self.batches)


def test_training_stops_in_one_line_on_a_lost_shard_instead_of_counting_one_bad_sample(flaky):
    url = put(flaky, "s.tar", tar_bytes(MEMBERS))
    flaky.faults = [5000] * 10
    table = pa.concat_tables(read_shard(url, SPEC, 256, FAST))
    batch = {k: np.asarray(v, dtype=object) for k, v in table.to_pydict().items() if k != "image"}
    bad = BadSamples(max_bad_fraction=0.5)
    config = DataConfig(image_size=32, patch_size=8)
    with pytest.raises(ShardLostError) as info:
        list(iter_batches(_Rows([batch]), 4, config, epoch=0, shuffle=False, bad_samples=bad))
    message = str(info.value)
    assert isinstance(info.value, BadSampleBudgetError)  # the training loop's one-line stop
    assert f"shard {url} was lost: unreadable shard: TimeoutError" in message and "\n" not in message
    assert "run the same command again" in message
    assert bad.bad == 0  # not one bad sample among the good ones


# --- a sample's content is never a storage failure -------------------------------------------------

HOSTILE_LABELS = [
    ("0000", b"cls", b"1"),
    ("0001", b"cls", str(2**63).encode()),  # past int64: broke the block's Arrow column, retried as storage
    ("0002", b"cls", "٣".encode()),  # a digit to Python's int(), no class index
    ("0003", b"json", b'{"label": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),  # RecursionError in json
    ("0004", b"json", b'{"label": 99999999999999999999}'),
    ("0005", b"cls", b"5"),
]


@pytest.mark.parametrize("label_key", ["cls", "json:label"])
@pytest.mark.parametrize("require_labels", [True, False], ids=["training", "embedding"])
def test_a_label_that_breaks_a_parser_is_a_bad_sample_read_once(flaky, label_key, require_labels):
    members = []
    for key, ext, raw in HOSTILE_LABELS:
        member = "cls" if label_key == "cls" else "json"
        if ext.decode() != member:  # the same label in the other member kind
            raw = b'{"label": "%s"}' % raw if member == "json" else raw.removeprefix(b'{"label": ')[:-1]
        members += [(f"{key}.{member}", raw), (f"{key}.jpg", b"J")]
    url = put(flaky, "s.tar", tar_bytes(members))
    flaky.opens = 0  # the write above opened it once
    spec = RowSpec(
        label_key=label_key, require_labels=require_labels, num_classes=10 if require_labels else None
    )
    rows = pa.concat_tables(read_shard(url, spec, 2, Retry(attempts=4, backoff_s=0.01))).to_pylist()
    assert flaky.opens == 1  # never tried again
    assert [(r["key"], r["label"]) for r in rows if not r["error"]] == [("0000", 1), ("0005", 5)]
    errors = {r["key"]: r["error"] for r in rows if r["error"]}
    assert sorted(errors) == ["0001", "0002", "0003", "0004"]
    assert all(e.startswith("bad label: ") for e in errors.values()), errors
    assert "does not fit int64" in errors["0001"] and "not a class index" in errors["0002"]


def test_any_exception_from_a_sample_is_that_samples_error_not_a_retry(flaky, monkeypatch):
    url = put(flaky, "s.tar", tar_bytes(MEMBERS))
    flaky.opens = 0  # the write above opened it once
    image = RowSpec.image

    def breaks_on_sample_3(self, sample):
        if sample.key == "0003":
            raise OverflowError("a parser's bug")
        return image(self, sample)

    monkeypatch.setattr(RowSpec, "image", breaks_on_sample_3)
    rows = rows_of(url)
    assert flaky.opens == 1
    assert [r["key"] for r in rows] == [f"{i:04d}" for i in range(12)]
    assert [r["error"] for r in rows if r["error"]] == ["bad sample: OverflowError: a parser's bug"]
