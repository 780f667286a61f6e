"""The embedding job's output: one Parquet file per input shard, committed whole, and a manifest beside them.

    <out>/train-000000-3f2a9c1e.parquet  key string, url string, embedding fixed_size_list<float32>[D],
    <out>/train-000001-b7d04e55.parquet  label int64 (null where the sample has none); schema metadata b"vitray"
    <out>/_identity.json                 the output's identity, claimed before the first commit
    <out>/_manifest.json                 model, weights sha256, preprocessing, D; per shard: rows, skipped, file

With ``--dtype float16`` the embedding column is ``fixed_size_list<float16>[D]``; with ``--normalize``
each row has unit L2 norm. Both are part of the output's identity, its manifest and every footer.

The underscore names stay out of directory reads: pyarrow, pandas, Spark and DuckDB globs skip ``_`` and
``.`` names, so ``pandas.read_parquet(out)`` reads exactly the embeddings.

Shards by name: the output knows a shard by its URL without userinfo, query string or fragment
(`pipeline.data.shards.shard_id`): its rows' ``url``, its file name, its record and the manifest hold that
name, never a signature, and the same shards signed again are the same shards (done ones stay done). An
older version named a shard read through a signed URL by the URL whole; its records and footers are read
by the shard's name, so such an output resumes, its files under the names they have.

File names: ``<stem>-<first 8 hex of sha256(shard name)>.parquet``, where the stem is the shard's file name
without its .tar/.tar.gz/.tgz suffix, every run of characters other than letters, digits, ``_`` and ``-``
made one ``-``, and leading or trailing ``-``/``_`` dropped (``shard`` if nothing is left). A pure function
of the name: a rerun maps each shard to the same file (so committed shards are skipped), and two URLs never
share a name, whatever runs embed them, in any order or at once (``a/x.tar`` and ``b/x.tar`` give two
hashes). No name starts with ``_`` or ``.`` (``_a.tar`` and ``.b.tar`` give ``a-…`` and ``b-…``, which
every reader sees), and none holds a dot before ``.parquet``, so none is taken for the job's temporaries
(``.<name>.tmp-<12 hex>``, `pipeline.storage.is_temporary`). The manifest gives each committed shard's
file. A name an older version gave and the manifest lists stays; where it is one that readers skip, a
run refuses the output in one line (``--overwrite`` rewrites it); ``jobs/evaluate.py`` reads the files
the manifest lists, such names included.

Identity: an output holds the embeddings of one configuration (model, weights sha256, kind,
preprocessing, device and precision). A run claims ``--out`` for it in ``_identity.json`` before it
writes or removes anything, and checks the claim before each commit publishes a file; a run that finds
another identity's claim stops in one line and publishes nothing more (at its start: nothing at all;
`pipeline.embed.identity` says what the claim guarantees on local disk and on object stores). Each
file's footer names its identity too: a shard counts as done only when its footer names this shard and
this identity, and ``jobs/evaluate.py`` refuses an output whose files disagree.

Commit protocol, per shard: the complete file is written under a hidden temporary name (local) or into
a local scratch file (object stores), then renamed onto / uploaded to its final name, then its record,
``_records/<file>.json`` (url, file, rows, bytes, skipped), is written whole (rename locally, one PUT on
object stores). A commit costs the same whatever the number of shards: the manifest is not rewritten
per shard, but once when a run starts and once when it ends, as the merge of the records there.
A crash leaves at worst a hidden temporary (removed by a later run once it is an hour old) or a
committed file without a record (redone and replaced by the next run). So a run's view, "a shard is
done when a record (or the manifest) lists it and its file has the listed size and row count", never
counts a partial file, and every readable key ends up in exactly one row.

Two runs of one identity into one ``--out`` at once are safe: a shard's file name is fixed, so a shard
both embed is replaced whole by the same rows, every record any run writes stays, and the manifest each
run writes at its end merges every record present then (the records, read by every run, are the truth;
the manifest is their summary as of the last run's end).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.data.bad_samples import LOST_SHARD, reason_category
from pipeline.data.shards import SHARD_SUFFIXES, shard_id
from pipeline.embed import identity
from pipeline.embed.identity import difference

MANIFEST = "_manifest.json"
RECORDS = "_records"  # one small JSON per committed (or failed) shard; "_" keeps Parquet readers out
FAILED = ".failed.json"  # record suffix of a shard that could not be read
STALE_TEMPORARY_S = 3600.0  # a temporary this old belongs to no running commit: a crash left it
FORMAT = "vitray-embeddings"
METADATA_KEY = b"vitray"
PARQUET = ".parquet"
DTYPES = {"float32": (np.float32, pa.float32()), "float16": (np.float16, pa.float16())}  # --dtype


def output_name(url: str) -> str:
    """``.../train-000003.tar.gz`` -> ``train-000003-<8 hex of sha256(url)>.parquet``, visible to every
    Parquet reader and never a temporary's name (see the module docstring); ``url`` is the shard's name
    (`shard_id`), as everything here takes it."""
    base = url.rstrip("/").rsplit("/", 1)[-1]
    for suffix in SHARD_SUFFIXES:
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
            break
    stem = re.sub(r"[^\w-]+", "-", base).strip("-_")[:96] or "shard"
    return f"{stem}-{hashlib.sha256(url.encode()).hexdigest()[:8]}{PARQUET}"


def visible(name: str) -> bool:
    """True for a file name that Parquet readers list and the job never takes for its temporary."""
    return not name.startswith(("_", ".")) and not storage.is_temporary(name)


def assign_names(shards: list[str], kept: dict[str, str] | None = None) -> dict[str, str]:
    """The output file name per shard URL: `output_name`, or the name ``kept`` (url -> name, from a
    manifest an older version wrote) gives it; a one-line ValueError when two URLs would share one."""
    kept = kept or {}
    names = {url: kept.get(url) or output_name(url) for url in shards}
    owners: dict[str, str] = {}
    for url, name in [*kept.items(), *names.items()]:
        if owners.setdefault(name, url) != url:
            raise ValueError(
                f"shards {owners[name]} and {url} map to one output file {name}; pass --overwrite, or "
                "embed them into separate --out directories"
            )
    return names


def embedding_table(
    keys: Iterable[str],
    urls: Iterable[str],
    embeddings: np.ndarray,
    labels: np.ndarray,
    metadata: dict,
    *,
    normalize: bool = False,
    dtype: str = "float32",
) -> pa.Table:
    """Rows of one shard: ``embeddings`` float32 ``(n, D)``, ``labels`` int64 ``(n,)`` with -1 for none.
    ``normalize``: each row divided by its L2 norm (a zero row stays zero), in float32; ``dtype``: the
    column's value type, ``float32`` or ``float16`` (half the bytes, about 3 significant digits)."""
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    if normalize:
        norms = np.linalg.norm(embeddings, axis=1, keepdims=True)  # (n, 1)
        embeddings = embeddings / np.where(norms > 0, norms, 1)
    embeddings = embeddings.astype(DTYPES[dtype][0], copy=False)
    dim = embeddings.shape[1]
    labels = np.asarray(labels, dtype=np.int64)
    schema = pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("url", pa.string(), nullable=False),
            pa.field("embedding", pa.list_(DTYPES[dtype][1], dim), nullable=False),
            pa.field("label", pa.int64()),
        ],
        metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()},
    )
    return pa.Table.from_arrays(
        [
            pa.array(list(keys), pa.string()),
            pa.array(list(urls), pa.string()),
            pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), dim),
            pa.array(labels, pa.int64(), mask=labels < 0),
        ],
        schema=schema,
    )


@dataclass
class OutputPlan:
    """What a run will do to ``--out``: which shards are done already, which to embed, what to delete."""

    names: dict[str, str]  # shard url -> output file name, every shard of this run
    done: dict[str, dict]  # shard url -> its manifest record, verified on storage
    pending: list[str]  # shard urls to embed, in input order
    delete: list[str] = field(default_factory=list)  # file names: temporaries, and stale files on overwrite
    strays: list[str] = field(default_factory=list)  # other .parquet files in --out, not this output's
    others: dict[str, dict] = field(default_factory=dict)  # committed earlier for shards not in this run
    overwrite: bool = False  # the run takes the output for its identity, replacing another's claim


class EmbeddingOutput:
    """``--out``: reads and plans against what is there, then commits shards and rewrites the manifest."""

    def __init__(self, out: storage.Location | str, header: dict[str, Any]):
        out = storage.as_location(out)
        self.out = out.at(out.url.rstrip("/") or out.url)  # a Location: str() is the URL alone
        self.header = header
        self.shards: dict[str, dict] = {}  # url -> record: every committed shard this run knows of
        self.failed: dict[str, str] = {}  # url -> reason
        self.names: dict[str, str] = {}  # url -> output file name, for this run's shards
        self._read_cache: dict[tuple[str, int], dict] = {}  # (record name, size) -> its contents
        self.run_id = uuid.uuid4().hex  # in the claim this run writes: which run wrote the one that stands

    def path(self, name: str) -> storage.Location:
        return self.out.join(name)

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest that is there, or None; a one-line ValueError when it is not one."""
        uri = self.path(MANIFEST)
        if not storage.exists(uri):
            return None
        try:
            manifest = json.loads(storage.read_text(uri))
        except ValueError as e:
            raise ValueError(
                f"{uri} is not valid JSON ({e}); pass --overwrite to start this output anew"
            ) from e
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError(f"{uri} is not a vitray embedding manifest; choose another --out")
        identity.check_version(manifest, uri)
        return manifest

    def plan(self, shards: list[str], *, overwrite: bool) -> OutputPlan:
        """Compare ``--out`` with this run (no side effects): a one-line ValueError when it holds another
        model's embeddings and ``overwrite`` is not set."""
        files = storage.list_files(self.out)
        old = self.read_manifest()
        # The claim names the output's identity; an output written before claims has its manifest's.
        held = identity.read(self.out) or old
        temporaries = sorted(n for n in files if storage.is_temporary(n) and self._stale(n))
        commits, _ = self.read_records()
        manifested = {shard_id(u): r for u, r in (old or {}).get("shards", {}).items()}
        listed = {**manifested, **commits}  # records are newer than any manifest
        if held is not None and not overwrite:
            why = difference(held, self.header)
            if why is not None:
                raise ValueError(
                    f"{self.out} holds embeddings of another configuration ({why}); pass --overwrite to "
                    "replace them, or choose another --out"
                )
        if overwrite:
            names = assign_names(shards)
            stale = sorted({r["file"] for r in listed.values()} & set(files))
            mine = set(names.values()) | set(stale)
            strays = sorted(n for n in files if n.endswith(PARQUET) and n not in mine)
            records = [f"{RECORDS}/{n}" for n in storage.list_files(self.path(RECORDS))]
            delete = temporaries + stale + records
            return OutputPlan(names, {}, list(shards), delete, strays, {}, overwrite=True)
        hidden = sorted(r["file"] for r in listed.values() if not visible(r["file"]))
        if hidden:
            raise ValueError(
                f"{self.out} holds {len(hidden)} file(s) that Parquet readers skip (e.g. {hidden[0]}), "
                "named by an older vitray; pass --overwrite to rewrite it under visible names"
            )
        if held is None and any(n.endswith(PARQUET) for n in files):
            raise ValueError(
                f"{self.out} holds Parquet files but no {MANIFEST}: not a vitray embedding output; choose "
                "an empty --out, or pass --overwrite to write beside them"
            )
        names = assign_names(shards, {u: r["file"] for u, r in listed.items()})
        present = {u: r for u, r in listed.items() if files.get(r["file"]) == r.get("bytes")}
        rows = self._row_counts({u: r["file"] for u, r in present.items()})
        verified = {u: r for u, r in present.items() if rows.get(u) == r["rows"]}
        done = {u: r for u, r in verified.items() if u in names}
        others = {u: r for u, r in verified.items() if u not in names}  # from runs over other shards
        mine = {r["file"] for r in listed.values()} | set(names.values())
        strays = sorted(n for n in files if n.endswith(PARQUET) and n not in mine)
        pending = [u for u in shards if u not in done]
        return OutputPlan(names, done, pending, temporaries, strays, others)

    def start(self, plan: OutputPlan) -> None:
        """Claim the output (`OutputClaimedError` when another identity holds it: nothing written), remove
        leftovers, then write the manifest: this run's header and every shard committed so far."""
        identity.claim(self.out, self.header, self.run_id, replace=plan.overwrite)
        for name in plan.delete:
            storage.remove(self.path(name))
        self.names = dict(plan.names)
        self.shards = {**plan.others, **plan.done}
        self.failed = {}
        self.write_manifest()

    def commit(self, url: str, name: str, table: pa.Table, skipped: list[dict[str, str]]) -> dict[str, Any]:
        """Write one shard's file whole, publish it, then its record; returns the record."""
        target = self.path(name)
        with storage.staged_file(target) as local:
            pq.write_table(table, local, compression="zstd")
            size = os.path.getsize(local)
            # Last thing before the file is published: a lost claim publishes nothing.
            identity.check(self.out, self.header)
        record = {"file": name, "rows": table.num_rows, "bytes": size, "skipped": skipped}
        storage.write_text(self._record_path(name), json.dumps({"url": url, **record}) + "\n")
        self.shards[url] = record
        if self.failed.pop(url, None) is not None:
            storage.remove(self._record_path(name, FAILED))
        return record

    def fail(self, url: str, reason: str) -> None:
        """Record a shard that could not be read (nothing committed; the next run tries it again)."""
        self.failed[url] = reason
        record = json.dumps({"url": url, "reason": reason}) + "\n"
        storage.write_text(self._record_path(self.names[url], FAILED), record)

    def finish(self) -> None:
        """The run ended: write the manifest once, merging every record there (other runs' too)."""
        self.write_manifest()

    def write_manifest(self) -> None:
        """Rewrite ``_manifest.json`` from the records there and this run's own view (one PUT)."""
        commits, failures = self.read_records()
        self.shards = {**self.shards, **commits}
        self.failed = {u: r for u, r in {**failures, **self.failed}.items() if u not in self.shards}
        lost = {
            url: skip["reason"]
            for url, record in self.shards.items()
            for skip in record.get("skipped", [])
            if reason_category(skip["reason"]) == LOST_SHARD
        }
        manifest = {**self.header, "shards": self.shards, "failed": self.failed, "lost_shards": lost}
        text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
        storage.write_text(self.path(MANIFEST), text)

    def read_records(self) -> tuple[dict[str, dict], dict[str, str]]:
        """``(commits, failures)`` from ``_records/``: url -> record, url -> reason. One listing, and one
        read per record not read before (in parallel)."""
        listed = storage.list_files(self.path(RECORDS))
        todo = [(n, b) for n, b in sorted(listed.items()) if not storage.is_temporary(n)]

        def read(item: tuple[str, int]) -> tuple[tuple[str, int], dict | None]:
            if item in self._read_cache:
                return item, self._read_cache[item]
            try:
                return item, json.loads(storage.read_text(self.path(f"{RECORDS}/{item[0]}")))
            except (OSError, ValueError):  # gone (an overwrite) or cut: the shard counts as not done
                return item, None

        with ThreadPoolExecutor(max_workers=max(1, min(32, len(todo)))) as pool:
            contents = dict(pool.map(read, todo))
        commits: dict[str, dict] = {}
        failures: dict[str, str] = {}
        for (name, size), record in contents.items():
            if not isinstance(record, dict) or "url" not in record:
                continue
            self._read_cache[(name, size)] = record
            # By the shard's name: an older version's record may name it by a signed URL.
            url = shard_id(str(record["url"]))
            if name.endswith(FAILED):
                failures[url] = str(record.get("reason", ""))
            else:
                commits[url] = {k: v for k, v in record.items() if k != "url"}
        return commits, {u: r for u, r in failures.items() if u not in commits}

    def _record_path(self, name: str, suffix: str = ".json") -> storage.Location:
        return self.path(f"{RECORDS}/{name}{suffix}")

    def _stale(self, name: str) -> bool:
        """Old enough to be a crash's leftover, not a running commit's (temporaries are local-only)."""
        if not self.out.is_local:
            return True
        try:
            return time.time() - os.path.getmtime(self.path(name).local_path) > STALE_TEMPORARY_S
        except OSError:
            return False

    def _row_counts(self, names: dict[str, str]) -> dict[str, int]:
        """Row count per shard from each file's footer (one small read each, in parallel), when the
        footer also names that shard; a file that cannot be read counts as not done."""

        def rows(item: tuple[str, str]) -> tuple[str, int | None]:
            url, name = item
            fs, path = self.path(name).fs()
            try:
                with fs.open(path, "rb") as f:
                    meta = pq.read_metadata(f)
                about = json.loads(meta.metadata[METADATA_KEY])
            except (OSError, KeyError, ValueError, TypeError, pa.ArrowException):
                return url, None
            named = shard_id(str(about.get("shard", {}).get("url")))  # an older version's: maybe signed
            mine = named == url and difference(about, self.header) is None
            return url, meta.num_rows if mine else None

        if not names:
            return {}
        with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
            return dict(pool.map(rows, names.items()))
