"""Embedding outputs read back, beside their writer (`pipeline.embed.output`): streamed in record batches
(`OutputReader`: the index jobs) or whole into arrays (`load_embeddings`: the evaluate job).

An output is a directory that ``jobs/embed.py`` wrote (one Parquet file per shard and ``_manifest.json``)
or a single ``.parquet`` file with its columns (`pipeline.embed.output.embedding_table`). Where the
manifest is there, exactly the files it lists as committed are read, so a stray or half-written file
beside them never enters a score; without one, every ``.parquet`` file of the directory is read.

An output holds one model's embeddings: every file's footer, the manifest and the output's claim must
name one identity (model, weights sha256, preprocessing, device and precision:
`pipeline.embed.identity`); an output whose files disagree is refused, never scored as a mixture.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.embed import identity
from pipeline.embed.output import MANIFEST, METADATA_KEY, PARQUET


@dataclass
class Embeddings:
    """One output in memory: ``features`` float32 ``(n, D)``, ``labels`` int64 ``(n,)``, ``keys`` ``(n,)``."""

    uri: str
    features: np.ndarray
    labels: np.ndarray
    keys: np.ndarray
    about: dict[str, Any]  # the manifest, else the first file's schema metadata ({} when neither)

    @property
    def dim(self) -> int:
        return self.features.shape[1]

    @property
    def model(self) -> str | None:
        return (self.about.get("model") or {}).get("name")

    @property
    def weights_sha256(self) -> str | None:
        return (self.about.get("weights") or {}).get("sha256")

    @property
    def normalized(self) -> bool:
        """Whether its rows were L2-normalized (``jobs/embed.py --normalize``)."""
        return bool((self.about.get("output") or identity.DEFAULT_OUTPUT_OPTIONS).get("normalize"))

    def describe(self) -> str:
        classes = len(np.unique(self.labels))
        model = f", {self.model}" if self.model else ""
        return f"{self.uri}: {len(self.labels)} rows, D = {self.dim}, {classes} classes{model}"


def output_files(
    where: storage.Location | str,
) -> tuple[list[storage.Location], dict[str, Any]]:
    """The Parquet files of an output (sorted) and its manifest ({} without one)."""
    where = storage.as_location(where)
    uri = where.url.rstrip("/") or where.url
    where = where.at(uri)
    fs, path = where.fs()
    if not fs.exists(path):
        raise ValueError(f"{uri} does not exist; pass a directory that jobs/embed.py wrote (its --out)")
    if not fs.isdir(path):
        if not uri.endswith(PARQUET):
            raise ValueError(f"{uri} is a file but not .parquet; pass an embedding output directory")
        return [where], {}
    names = storage.list_files(where)
    manifest: dict[str, Any] = {}
    if MANIFEST in names:
        try:
            manifest = json.loads(storage.read_text(where.join(MANIFEST)))
        except ValueError as e:
            raise ValueError(
                f"{storage.join(uri, MANIFEST)} is not valid JSON ({e}); re-run jobs/embed.py"
            ) from e
        if isinstance(manifest, dict):
            identity.check_version(manifest, storage.join(uri, MANIFEST))
        files = sorted(record["file"] for record in (manifest.get("shards") or {}).values())
        missing = [f for f in files if f not in names]
        if missing:
            raise ValueError(
                f"{uri}: {MANIFEST} lists {len(missing)} file(s) that are not there (e.g. {missing[0]}); "
                "re-run jobs/embed.py with the same --out to complete it"
            )
    else:
        files = sorted(n for n in names if n.endswith(PARQUET) and not n.startswith(("_", ".")))
    if not files:
        raise ValueError(f"{uri} holds no embedding files (.parquet); pass the --out of jobs/embed.py")
    return [where.join(f) for f in files], manifest


@dataclass
class OutputReader:
    """An output's files and the identity every one of them must name: `check` each file's schema as it
    is opened (`load_embeddings` reads them whole, `iter_batches` streams them in record batches)."""

    uri: str
    files: list[storage.Location]
    about: dict[str, Any]  # the manifest, else the first file's footer ({} when neither)
    reference: dict[str, Any] | None  # what every footer must agree with: the claim, manifest or first footer
    where: str  # where the reference came from, for messages
    name: str  # the flag that named the output

    @classmethod
    def open(cls, where: storage.Location | str, *, name: str = "--train") -> OutputReader:
        files, manifest = output_files(where)
        uri = str(where)
        claim = identity.read(where) if manifest else None  # a vitray output directory
        reference, source = (claim, identity.CLAIM) if claim else (manifest or None, MANIFEST)
        if claim and manifest:
            _same(name, uri, claim, identity.CLAIM, manifest, MANIFEST)
        return cls(uri, files, manifest, reference, source, name)

    def check(self, file: str, schema: pa.Schema) -> int:
        """One file's schema against the output: its footer names the output's identity, its embedding
        column is a fixed-size list of floats. Returns D."""
        if schema.metadata and METADATA_KEY in schema.metadata:
            footer = json.loads(schema.metadata[METADATA_KEY])
            self.about = self.about or footer
            if self.reference is None:
                self.reference, self.where = footer, file.rsplit("/", 1)[-1]
            else:
                _same(self.name, self.uri, self.reference, self.where, footer, file.rsplit("/", 1)[-1])
        index = schema.get_field_index("embedding")
        kind = schema.field(index).type if index >= 0 else None
        if kind is None or not pa.types.is_fixed_size_list(kind) or not pa.types.is_floating(kind.value_type):
            raise ValueError(
                f"{self.name} {file}: its embedding column is not fixed_size_list<float32 or float16>[D]"
            )
        return kind.list_size

    def iter_batches(self, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        """Every row, file after file, in record batches of at most ``batch_rows``: an output larger than
        memory streams through (one batch in memory at a time)."""
        for location in self.files:
            fs, path = location.fs()
            try:
                with fs.open(path, "rb") as f:
                    parquet = pq.ParquetFile(f)
                    self.check(location.url, parquet.schema_arrow)
                    yield from parquet.iter_batches(batch_size=batch_rows, columns=columns)
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{self.name} {location.url} is not an embedding file: {e}") from e


def features(column: pa.Array | pa.ChunkedArray, dim: int) -> np.ndarray:
    """An embedding column (float32 or float16) -> float32 ``(n, D)``."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)


def read_table(data: bytes, columns: list[str]) -> pa.Table:
    """``columns`` of a whole Parquet file's bytes, copied into memory of pyarrow's own first: its
    reader threads drop their last reference to the file after `pq.read_table` returns, and a
    reference to Python's bytes takes the GIL to let go, which a process that is exiting by then
    answers with an abort (exit code 134, "terminate called without an active exception") after
    the job's work was done and printed."""
    owned = pa.allocate_buffer(len(data))
    pa.FixedSizeBufferWriter(owned).write(data)
    return pq.read_table(pa.BufferReader(owned), columns=columns)


def load_embeddings(where: storage.Location | str, *, name: str = "--train") -> Embeddings:
    """Read every row of an output; a one-line ValueError when it has no labels, mixes widths or is
    not an embedding output (``name`` is the flag that named it, for the message)."""
    reader = OutputReader.open(where, name=name)
    uri = reader.uri
    tables, dims = [], set()
    for location in reader.files:
        file = location.url
        fs, path = location.fs()
        try:
            table = read_table(fs.cat_file(path), ["key", "embedding", "label"])
        except (pa.ArrowException, KeyError, OSError) as e:
            raise ValueError(
                f"{name} {file} is not an embedding file (key, embedding, label columns): {e}"
            ) from e
        dims.add(reader.check(file, table.schema))
        tables.append(table)
    if len(dims) > 1:
        raise ValueError(f"{name} {uri} mixes embedding widths {sorted(dims)}; one output holds one model's")
    table = pa.concat_tables(tables)
    dim = dims.pop()
    labels = table.column("label").to_numpy(zero_copy_only=False)
    unlabeled = table.column("label").null_count
    if unlabeled:
        raise ValueError(
            f"{name} {uri}: {unlabeled} of {table.num_rows} rows have no label; evaluation needs labeled "
            "embeddings (embed labeled shards, with --label-key naming the label member)"
        )
    if table.num_rows == 0:
        raise ValueError(f"{name} {uri} holds no rows")
    rows = features(table.column("embedding"), dim)
    keys = np.asarray(table.column("key").to_pylist(), dtype=object)
    finite = np.isfinite(rows).all(axis=1)
    if not finite.all():
        raise ValueError(
            f"{name} {uri}: {int((~finite).sum())} of {len(finite)} rows hold NaN or inf (first: key "
            f"{keys[~finite][0]}); embed them again with weights that hold finite values"
        )
    return Embeddings(uri, rows, labels.astype(np.int64), keys, reader.about)


def _same(name: str, uri: str, a: dict, a_name: str, b: dict, b_name: str) -> None:
    why = identity.difference(a, b, f"in {a_name}", f"in {b_name}")
    if why is not None:
        raise ValueError(
            f"{name} {uri} mixes embeddings of two configurations ({why}); re-embed it with "
            "jobs/embed.py --overwrite, or pass an output of one model"
        )
