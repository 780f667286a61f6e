"""Queries on an index that `pipeline.index.build` wrote: top-k neighbours of rows or of an image, and
near-duplicate pairs.

Scores: cosine similarity on an index of normalized embeddings (metric ``ip``, higher is nearer), the
Euclidean distance otherwise (``l2``, lower is nearer); an approximate index's scores are approximate
too (ivfpq compares compressed codes). A query by key takes the indexed vector itself (ivfpq: its
decoded code), so the row is its own nearest neighbour; a query by image is embedded with the indexed
output's own model and eval transform (`pipeline.index.query`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.embed.reader import read_table
from pipeline.index.build import FORMAT, IDS_FILE, INDEX_FILE, INDEX_MANIFEST

PAIR_BATCH = 4096  # rows queried at a time when looking for near duplicates


@dataclass
class LoadedIndex:
    """An index directory in memory: the FAISS index, its manifest, and the key and url of every id."""

    uri: str
    manifest: dict[str, Any]
    index: Any  # a faiss.Index
    keys: np.ndarray  # (n,) object: id -> key
    urls: np.ndarray  # (n,) object: id -> url

    @property
    def metric(self) -> str:
        return self.manifest["metric"]

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def source(self) -> dict[str, Any]:
        return self.manifest.get("source") or {}

    def describe(self) -> str:
        model = self.source.get("model") or "an unnamed model"
        return f"{self.uri}: {self.manifest['kind']} index of {self.index.ntotal:,} rows, D = {self.dim}, {model}"

    def ids_of(self, keys: tuple[str, ...]) -> list[int]:
        """The id of each key (a key indexed twice, from two outputs, gives both); one line for a key
        that is not there."""
        where: dict[str, list[int]] = {}
        wanted = set(keys)
        for i in np.flatnonzero(np.isin(self.keys, list(wanted))):
            where.setdefault(self.keys[i], []).append(int(i))
        missing = [k for k in keys if k not in where]
        if missing:
            raise ValueError(
                f"--key {missing[0]!r} is not in {self.uri} ({len(self.keys):,} keys, e.g. "
                f"{self.keys[0]!r}); pass a key of an indexed row"
            )
        return [i for k in keys for i in where[k]]

    def vectors(self, ids: list[int] | np.ndarray) -> np.ndarray:
        """The indexed vectors of ``ids``, float32 ``(len(ids), D)``."""
        return np.stack([self.index.reconstruct(int(i)) for i in ids]).astype(np.float32)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each ``(q, k)``; id -1 where fewer than ``k`` were found. Scores as the module
        docstring says. A one-line ValueError for queries of another width."""
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(
                f"the query has D = {queries.shape[-1]} but {self.uri} has D = {self.dim}; query with "
                f"the model the index was built from ({self.source.get('model')})"
            )
        scores, ids = self.index.search(
            np.ascontiguousarray(queries, dtype=np.float32), min(k, self.index.ntotal)
        )
        if self.metric == "l2":
            scores = np.sqrt(np.maximum(scores, 0))
        return scores, ids


def tune(index: LoadedIndex, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
    """Search-time knobs: inverted lists visited (ivfpq), candidates kept (hnsw); a one-line ValueError
    for a knob the index does not have (it would change nothing)."""
    kind = index.manifest.get("kind", "this kind")
    for flag, value, owner, knob in (
        ("--nprobe", nprobe, "ivfpq", "nprobe"),
        ("--ef-search", ef_search, "hnsw", "hnsw"),
    ):
        if value is not None and not hasattr(index.index, knob):
            raise ValueError(f"{flag} tunes an {owner} index; {index.uri} is {kind}: drop {flag}")
    if nprobe is not None:
        index.index.nprobe = nprobe
    if ef_search is not None:
        index.index.hnsw.efSearch = ef_search


def load_index(where: storage.Location | str) -> LoadedIndex:
    """Read an index directory; a one-line ValueError when it is not one."""
    import faiss

    where = storage.as_location(where)
    uri = where.url.rstrip("/") or where.url
    where = where.at(uri)
    there = where.join(INDEX_MANIFEST)
    if not storage.exists(there):
        raise ValueError(
            f"--index {uri} holds no {INDEX_MANIFEST}: not an index; build one with jobs/index.py"
        )
    try:
        manifest = json.loads(storage.read_text(there))
    except ValueError as e:
        raise ValueError(f"{there} is not valid JSON ({e}); build the index again with jobs/index.py") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{there} is not a vitray index manifest; build one with jobs/index.py")
    fs, path = where.join(INDEX_FILE).fs()
    try:
        if storage.is_local(uri):
            index = faiss.read_index(path)
        else:
            index = faiss.deserialize_index(np.frombuffer(fs.cat_file(path), np.uint8))
        fs, path = where.join(IDS_FILE).fs()
        ids = read_table(fs.cat_file(path), ["key", "url"])
    except (RuntimeError, OSError, pa.ArrowException) as e:
        raise ValueError(
            f"--index {uri} is incomplete or damaged ({e}); build it again with jobs/index.py"
        ) from e
    if ids.num_rows != index.ntotal:
        raise ValueError(
            f"--index {uri}: {IDS_FILE} has {ids.num_rows} rows for {index.ntotal} vectors; build it again"
        )
    if hasattr(index, "make_direct_map"):  # ivf: reconstruct(id) needs it
        index.make_direct_map()
    keys = np.asarray(ids.column("key").to_pylist(), dtype=object)
    urls = np.asarray(ids.column("url").to_pylist(), dtype=object)
    return LoadedIndex(uri, manifest, index, keys, urls)


def neighbours(index: LoadedIndex, queries: np.ndarray, k: int) -> list[list[tuple[str, str, float]]]:
    """Per query, its ``k`` nearest rows as (key, url, score), nearest first."""
    scores, ids = index.search(queries, k)
    return [
        [(index.keys[i], index.urls[i], float(s)) for s, i in zip(row_s, row_i, strict=True) if i >= 0]
        for row_s, row_i in zip(scores, ids, strict=True)
    ]


def format_neighbours(title: str, rows: list[tuple[str, str, float]], metric: str) -> str:
    """One query's neighbours as a table: rank, key, url, score."""
    score = "cosine" if metric == "ip" else "distance"
    cells = [("rank", "key", "url", score)] + [
        (str(r + 1), key, url, f"{s:.4f}") for r, (key, url, s) in enumerate(rows)
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [title] + [
        "  " + "  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells
    ]
    lines.insert(2, "  " + "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def shortfall(index: LoadedIndex, found: int, k: int) -> str | None:
    """A note for a query answered with fewer than ``k`` rows (None when it got ``k``): the index holds
    fewer, or the approximate search found no more."""
    if found >= k:
        return None
    if index.index.ntotal < k:
        why = f"the index holds {index.index.ntotal:,} rows"
    else:
        knob = {"ivfpq": "--nprobe", "hnsw": "--ef-search"}.get(
            index.manifest.get("kind"), "--nprobe or --ef-search"
        )
        why = f"the approximate search found no more (raise {knob})"
    return f"  note: {found:,} neighbours, fewer than --k {k}: {why}"


def near_duplicates(index: LoadedIndex, threshold: float, k: int) -> pa.Table:
    """Every pair of rows within ``threshold`` (cosine at least, or distance at most) among each row's
    ``k`` nearest: columns key_a, url_a, key_b, url_b, score; each pair once (a < b by id), most similar first."""
    found_a, found_b, found_s = [], [], []
    n = index.index.ntotal
    for lo in range(0, n, PAIR_BATCH):
        count = min(PAIR_BATCH, n - lo)
        scores, ids = index.search(index.index.reconstruct_n(lo, count), k + 1)  # + 1: the row itself
        own = np.arange(lo, lo + count)[:, None]
        close = scores >= threshold if index.metric == "ip" else scores <= threshold
        keep = close & (ids >= 0) & (ids != own)
        rows, cols = np.nonzero(keep)
        a, b = own[rows, 0], ids[rows, cols]
        found_a.append(np.minimum(a, b))
        found_b.append(np.maximum(a, b))
        found_s.append(scores[rows, cols])
    a, b, s = (np.concatenate(x) if x else np.zeros(0) for x in (found_a, found_b, found_s))
    _, first = np.unique(a.astype(np.int64) * n + b.astype(np.int64), return_index=True)
    a, b, s = a[first].astype(np.int64), b[first].astype(np.int64), s[first]
    order = np.argsort(-s if index.metric == "ip" else s, kind="stable")
    a, b, s = a[order], b[order], s[order]
    return pa.table(
        {
            "key_a": pa.array(index.keys[a].tolist(), pa.string()),
            "url_a": pa.array(index.urls[a].tolist(), pa.string()),
            "key_b": pa.array(index.keys[b].tolist(), pa.string()),
            "url_b": pa.array(index.urls[b].tolist(), pa.string()),
            "score": pa.array(s.astype(np.float32)),
        }
    )


PAIR_COLUMNS = ["key_a", "url_a", "key_b", "url_b", "score"]


def check_pairs_target(out: storage.Location | str) -> None:
    """A one-line ValueError for an ``--out`` that is a directory, or an existing file that is no pairs
    file (an embedding file, an index's ids.parquet): only the pairs of an earlier run are replaced."""
    if storage.is_root(out) or storage.list_entries(out):
        raise ValueError(f"--out {out} is a directory; name a .parquet file for the pairs")
    if not storage.exists(out):
        return
    fs, path = storage.filesystem(out)
    try:
        with fs.open(path, "rb") as f:
            ours = pq.read_schema(f).names == PAIR_COLUMNS
    except (pa.ArrowException, OSError):
        ours = False
    if not ours:
        raise ValueError(
            f"--out {out} exists and is no near-duplicates file ({', '.join(PAIR_COLUMNS)}); pick another "
            "--out, or remove that file first"
        )


def write_pairs(table: pa.Table, out: storage.Location | str) -> None:
    """The pairs as one Parquet file at ``out``, written whole (`pipeline.storage.staged_file`)."""
    with storage.staged_file(out) as local:
        pq.write_table(table, local, compression="zstd")
