"""A FAISS index over an embedding output: chosen from its size and a memory budget, built from a stream.

    <index>/index.faiss   the FAISS index; vector id i is row i of ids.parquet
    <index>/ids.parquet   id int64, key string, url string: the rows in the order they were added
    <index>/_index.json   what it was built from (outputs, model, weights sha256, normalize, dtype, D),
                          its kind, metric and parameters, rows; written last: an index counts once it is

Metric: inner product on an output embedded with ``--normalize`` (cosine similarity), squared L2 otherwise.
Kinds (`choose`): ``flat`` is exact, ``n * D * 4`` bytes, each query a scan of every row; ``hnsw`` is a
graph over the full vectors (``M`` links a row): no training, high recall, about ``n * (4 D + 8 M)``
bytes (both peak at about twice their vectors while rows are added); ``ivfpq`` keeps ``m`` bytes a row (product quantization) in ``nlist`` inverted lists: the one
that fits where full vectors do not, at a lower recall (BENCHMARKS.md, "Index"). ``auto`` takes flat up
to `EXACT_MAX_ROWS`, else hnsw where it fits ``--memory-gb``, else ivfpq with the largest code that fits.

Streaming: the Parquet files are read in record batches of ``--batch-rows`` (`OutputReader.iter_batches`),
and each batch is added and dropped, so only the index itself is held. ivfpq first trains its coarse
quantizer and codebooks on a sample (every k-th row, a first pass over the files), then adds in chunks:
an output larger than memory indexes within the budget.

Past one machine (``--ray-tasks N``, `pipeline.index.distributed`): the driver trains once, Ray tasks add
the rows of groups of files to copies of the trained index, and the driver merges those shards in file
order into the index this module would have built (`trained_index`, `add_rows`, `commit` are the phases
both builds share). HNSW is a graph over every row: it does not merge, so it is built in one process.

One index holds one model's embeddings: several outputs (``--embeddings a,b``) must name one identity
(`pipeline.embed.identity`), and an ``--out`` that holds an index of another identity is refused unless
``--overwrite``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.embed import identity
from pipeline.embed.reader import OutputReader, features
from pipeline.index.config import IndexConfig

INDEX_FILE, IDS_FILE, INDEX_MANIFEST = "index.faiss", "ids.parquet", "_index.json"
FORMAT = "vitray-index"
EXACT_MAX_ROWS = 50_000  # flat below this: a query scans 50,000 x D floats in a few ms
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 80, 128
DIMS_PER_CODE = (2, 4, 8, 16, 32)  # ivfpq: dimensions a code byte covers, best recall first
TRAIN_POINTS_PER_LIST = 40  # ivfpq: sample rows per inverted list (faiss asks for at least 39)
GIB = 1 << 30


@dataclass
class IndexSpec:
    """The index to build: kind, metric, its parameters and the bytes it will take."""

    kind: str
    metric: str  # "ip" (normalized outputs: cosine) or "l2"
    rows: int
    dim: int
    params: dict[str, int] = field(default_factory=dict)
    bytes: int = 0

    def describe(self) -> str:
        params = ", ".join(f"{k} {v}" for k, v in self.params.items())
        return (
            f"{self.kind} index ({self.metric}{', ' + params if params else ''}) over {self.rows:,} rows, "
            f"D = {self.dim}, about {self.bytes / GIB:.2f} GiB"
        )


def estimate(kind: str, rows: int, dim: int, params: dict[str, int]) -> int:
    """Bytes an index takes while it is built: the index, plus for ivfpq its training sample. FAISS
    grows the storage of full vectors by doubling as rows are added: flat and hnsw peak at twice theirs
    (measured: BENCHMARKS.md, "Index")."""
    if kind == "flat":
        return 2 * rows * dim * 4
    if kind == "hnsw":
        return int(rows * (2 * dim * 4 + params["M"] * 2 * 4 * 1.25))  # level 0 holds 2M links, upper ~M/4
    sample = min(rows, params["nlist"] * TRAIN_POINTS_PER_LIST) * dim * 4
    return rows * (params["m"] + 8) + params["nlist"] * dim * 4 + sample  # codes + ids, centroids


def choose(
    kind: str, rows: int, dim: int, metric: str, memory_bytes: int, *, mergeable: bool = False
) -> IndexSpec:
    """The index for ``rows`` vectors of ``dim`` under ``memory_bytes``; a one-line ValueError when the
    kind asked for (or, for auto, every kind) does not fit. ``mergeable``: only kinds built from shards
    (flat, ivfpq), for ``--ray-tasks``."""
    nlist = max(1, min(2 ** round(math.log2(max(1.0, math.sqrt(rows)))), rows // TRAIN_POINTS_PER_LIST))
    candidates = {
        "flat": [{}],
        "hnsw": [{"M": HNSW_M, "ef_construction": HNSW_EF_CONSTRUCTION, "ef_search": HNSW_EF_SEARCH}],
        "ivfpq": [
            {"nlist": nlist, "m": dim // d, "nbits": min(8, max(1, int(math.log2(max(2, rows // 39))))),
             "nprobe": min(nlist, 16)}
            for d in DIMS_PER_CODE
            if dim % d == 0
        ],
    }  # fmt: skip
    if kind == "ivfpq" and rows < 2 * TRAIN_POINTS_PER_LIST:
        raise ValueError(
            f"--kind ivfpq trains its codes on at least {2 * TRAIN_POINTS_PER_LIST} rows; these outputs hold "
            f"{rows:,}: pass --kind flat (exact, and small at this size)"
        )
    if kind == "auto":
        order = ["flat", "hnsw", "ivfpq"] if rows <= EXACT_MAX_ROWS else ["hnsw", "ivfpq"]
        order = [name for name in order if not (mergeable and name == "hnsw")]
    else:
        order = [kind]
    for name in order:
        for params in candidates[name]:
            need = estimate(name, rows, dim, params)
            if need <= memory_bytes:
                return IndexSpec(name, metric, rows, dim, params, need)
    smallest = min(estimate(name, rows, dim, p) for name in order for p in candidates[name] or [{}])
    raise ValueError(
        f"{rows:,} rows of D = {dim} need about {smallest / GIB:.2f} GiB as {' or '.join(order)}, over "
        f"--memory-gb {memory_bytes / GIB:g}; raise --memory-gb"
        + (", or pass --kind ivfpq (compressed codes)" if kind in ("flat", "hnsw") else "")
    )


def open_outputs(config: IndexConfig) -> list[OutputReader]:
    """Each output of ``--embeddings``, checked to be one model's; one-line ValueErrors."""
    readers: list[OutputReader] = []
    uris = [u.strip() for u in config.embeddings.split(",") if u.strip()]
    if not uris:
        raise ValueError(
            f"--embeddings {config.embeddings!r} names no output; pass embedding directories, comma-separated"
        )
    for uri in uris:
        reader = OutputReader.open(config.location(uri), name="--embeddings")
        twice = {_file(f.url) for f in reader.files} & {_file(f.url) for r in readers for f in r.files}
        if twice:
            raise ValueError(
                f"--embeddings names {uri}'s files twice (first: {sorted(twice)[0]}): each row would be "
                "indexed twice, its own nearest neighbour; name each output once"
            )
        readers.append(reader)
        why = identity.difference(readers[0].about, reader.about, f"in {readers[0].uri}", f"in {uri}")
        if why is not None:
            raise ValueError(
                f"--embeddings mixes outputs of two configurations ({why}); one index holds one model's "
                "embeddings: build one index per output"
            )
    return readers


def _file(url: str) -> str:
    """A file's URL with a local one made an absolute path (``out``, ``./out/`` and ``file://`` alike)."""
    return os.path.abspath(storage.local_path(url)) if storage.is_local(url) else url


def count_rows(readers: list[OutputReader]) -> tuple[list[int], int]:
    """(rows of each file, in the order they are added; D) from the Parquet footers (one small read a
    file), every file checked against its output."""
    rows, dims = [], set()
    for reader in readers:
        for location in reader.files:
            fs, path = location.fs()
            try:
                with fs.open(path, "rb") as f:
                    meta = pq.ParquetFile(f).metadata
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"--embeddings {location} is not an embedding file: {e}") from e
            dims.add(reader.check(location.url, meta.schema.to_arrow_schema()))
            rows.append(meta.num_rows)
    if len(dims) != 1:
        raise ValueError(f"--embeddings mixes embedding widths {sorted(dims)}; one index holds one model's")
    if sum(rows) == 0:
        raise ValueError(f"--embeddings {readers[0].uri} holds no rows")
    return rows, dims.pop()


def source_of(readers: list[OutputReader], dim: int) -> dict[str, Any]:
    """What the index is of: its outputs and their identity (model, weights, normalize, dtype, D)."""
    about = readers[0].about
    return {
        "embeddings": [r.uri for r in readers],
        "model": (about.get("model") or {}).get("name"),
        "weights sha256": (about.get("weights") or {}).get("sha256"),
        "embedding": about.get("embedding"),
        "output": about.get("output") or identity.DEFAULT_OUTPUT_OPTIONS,
        "dim": dim,
        "image_size": about.get("image_size"),
        "about": about,  # the manifest (or footer): model config, preprocessing, for queries by image
    }


def check_out(config: IndexConfig, source: dict[str, Any]) -> None:
    """``--out`` is empty, this job's index of the same model (rebuilt), or ``--overwrite``."""
    out = config.location(config.out)
    storage.check_output_dir(
        out, job="the index job", owns=lambda entries: INDEX_MANIFEST in entries, overwrite=config.overwrite
    )
    there = out.join(INDEX_MANIFEST)
    if config.overwrite or not storage.exists(there):
        return
    try:
        old = json.loads(storage.read_text(there))["source"]["about"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{there} is not a vitray index manifest; pass --overwrite to replace it") from e
    why = identity.difference(old, source["about"], "there", "now")
    if why is not None:
        raise ValueError(
            f"--out {config.out} holds an index of other embeddings ({why}); pass --overwrite to replace "
            "it, or choose another --out"
        )


def new_index(spec: IndexSpec) -> Any:
    import faiss

    metric = faiss.METRIC_INNER_PRODUCT if spec.metric == "ip" else faiss.METRIC_L2
    if spec.kind == "flat":
        return faiss.IndexFlat(spec.dim, metric)
    if spec.kind == "hnsw":
        index = faiss.IndexHNSWFlat(spec.dim, spec.params["M"], metric)
        index.hnsw.efConstruction = spec.params["ef_construction"]
        index.hnsw.efSearch = spec.params["ef_search"]
        return index
    quantizer = faiss.IndexFlat(spec.dim, metric)
    p = spec.params
    index = faiss.IndexIVFPQ(quantizer, spec.dim, p["nlist"], p["m"], p["nbits"], metric)
    index.nprobe = p["nprobe"]
    return index


def training_sample(readers: list[OutputReader], spec: IndexSpec, config: IndexConfig) -> np.ndarray:
    """Every k-th row of the outputs, float32 ``(s, D)``, ``s`` about nlist x `TRAIN_POINTS_PER_LIST`."""
    want = min(spec.rows, spec.params["nlist"] * TRAIN_POINTS_PER_LIST, 2 ** spec.params["nbits"] * 256)
    want = max(want, min(spec.rows, 2 ** spec.params["nbits"] * 39))
    stride, seen, parts = max(1, spec.rows // want), 0, []
    for reader in readers:
        for batch in reader.iter_batches(["embedding"], config.batch_rows):
            first = (-seen) % stride  # the first row of this batch at a multiple of stride
            if first < batch.num_rows:
                # A copy: a strided view would keep the whole batch alive, every batch of the output.
                parts.append(features(batch.column(0), spec.dim)[first::stride].copy())
            seen += batch.num_rows
    return np.ascontiguousarray(np.concatenate(parts)[:want])


@dataclass
class BuildSummary:
    """What a build did, for people (`format`) and for the benchmark."""

    out: str
    spec: IndexSpec
    rows: int
    train_s: float
    add_s: float
    seconds: float
    ray_tasks: int = 0

    def format(self) -> str:
        tasks = f" in {self.ray_tasks} Ray tasks" if self.ray_tasks else ""
        return (
            f"indexed {self.rows:,} rows as {self.spec.describe()}\n"
            f"time: {self.seconds:.1f} s ({self.train_s:.1f} s training, {self.add_s:.1f} s adding{tasks})\n"
            f"index: {self.out}\n"
            f"search it: python jobs/search.py --index {self.out} --key KEY"
        )


@dataclass
class IndexPlan:
    """Everything the checks found out, before any vector is read."""

    config: IndexConfig
    readers: list[OutputReader]
    spec: IndexSpec
    source: dict[str, Any]
    file_rows: list[int]  # rows of each file of ``readers``, in order


def prepare(config: IndexConfig) -> IndexPlan:
    """Every check that reads no vector, cheapest first; raises a one-line ValueError."""
    config.validate()
    readers = open_outputs(config)
    file_rows, dim = count_rows(readers)
    source = source_of(readers, dim)
    check_out(config, source)
    metric = "ip" if source["output"].get("normalize") else "l2"
    memory = int(config.memory_gb * GIB)
    spec = choose(config.kind, sum(file_rows), dim, metric, memory, mergeable=config.ray_tasks > 0)
    return IndexPlan(config, readers, spec, source, file_rows)


def trained_index(plan: IndexPlan) -> Any:
    """An empty index of ``plan.spec``; ivfpq trained on a sample of every file (`training_sample`)."""
    index = new_index(plan.spec)
    if plan.spec.kind == "ivfpq":
        index.train(training_sample(plan.readers, plan.spec, plan.config))
    return index


def add_rows(
    index: Any, readers: list[OutputReader], dim: int, batch_rows: int, first_id: int = 0
) -> tuple[list[pa.Array], list[pa.Array]]:
    """Add every row of ``readers``' files to ``index``, batch by batch; returns the keys and urls in
    order. An ivf index gets ids from ``first_id`` on (the rows' ids in the whole index, so shards
    merge as they are); a flat one numbers its rows by position (shards merge by concatenation)."""
    import faiss

    keys, urls, next_id = [], [], first_id
    ivf = isinstance(index, faiss.IndexIVF)
    for reader in readers:
        for batch in reader.iter_batches(["key", "url", "embedding"], batch_rows):
            vectors = features(batch.column(2), dim)
            if not np.isfinite(vectors).all():
                raise ValueError(f"--embeddings {reader.uri} holds NaN or inf rows; embed them again")
            if ivf:
                index.add_with_ids(vectors, np.arange(next_id, next_id + len(vectors), dtype=np.int64))
            else:
                index.add(vectors)
            next_id += len(vectors)
            keys.append(batch.column(0))
            urls.append(batch.column(1))
    return keys, urls


def build(plan: IndexPlan) -> BuildSummary:
    """Train (ivfpq), add every row in batches, then `commit`."""
    start = time.perf_counter()
    index = trained_index(plan)
    train_s = time.perf_counter() - start
    keys, urls = add_rows(index, plan.readers, plan.spec.dim, plan.config.batch_rows)
    return commit(plan, index, keys, urls, start=start, train_s=train_s)


def commit(
    plan: IndexPlan, index: Any, keys: list[pa.Array], urls: list[pa.Array], *, start: float, train_s: float
) -> BuildSummary:
    """Write ``index.faiss``, ``ids.parquet`` and, last, ``_index.json`` into ``--out``; ``start`` is
    when the build began (`time.perf_counter`), ``train_s`` how long its training took."""
    import faiss

    config, spec = plan.config, plan.spec
    add_s = time.perf_counter() - start - train_s
    if index.ntotal != spec.rows:
        raise ValueError(f"--embeddings changed while it was indexed ({index.ntotal} rows, not {spec.rows})")
    ids = pa.table(
        {
            "id": pa.array(np.arange(spec.rows, dtype=np.int64)),
            "key": pa.chunked_array(keys, pa.string()),
            "url": pa.chunked_array(urls, pa.string()),
        }
    )
    manifest = {
        "format": FORMAT,
        "version": 1,
        "source": plan.source,
        "kind": spec.kind,
        "metric": spec.metric,
        "params": spec.params,
        "rows": spec.rows,
        "dim": spec.dim,
        "build": {
            "seconds": round(time.perf_counter() - start, 3),
            "train_seconds": round(train_s, 3),
            "add_seconds": round(add_s, 3),  # with --ray-tasks: the tasks' and the merge
            "estimated_bytes": spec.bytes,
            "ray_tasks": config.ray_tasks,
        },
    }
    with tempfile.TemporaryDirectory(prefix="vitray-index-") as local:
        faiss.write_index(index, os.path.join(local, INDEX_FILE))
        pq.write_table(ids, os.path.join(local, IDS_FILE), compression="zstd")
        with open(os.path.join(local, INDEX_MANIFEST), "w") as f:
            f.write(json.dumps(manifest, indent=1) + "\n")
        # The manifest marks a complete index: the old one goes first, the new one comes last.
        out = config.location(config.out)
        storage.remove(out.join(INDEX_MANIFEST))
        storage.upload_dir(local, out, commit_last=INDEX_MANIFEST)
    seconds = time.perf_counter() - start
    return BuildSummary(config.out, spec, spec.rows, train_s, add_s, seconds, config.ray_tasks)
