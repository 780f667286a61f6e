"""Embedding outputs read back into arrays: what the evaluate job scores.

An output is a directory that ``jobs/embed.py`` wrote (one Parquet file per shard and ``_manifest.json``)
or a single ``.parquet`` file with its columns (`pipeline.embed.output.embedding_table`). Where the
manifest is there, exactly the files it lists as committed are read, so a stray or half-written file
beside them never enters a score; without one, every ``.parquet`` file of the directory is read.

An output holds one model's embeddings: every file's footer, the manifest and the output's claim must
name one identity (model, weights sha256, preprocessing, device and precision:
`pipeline.embed.identity`); an output whose files disagree is refused, never scored as a mixture.
"""

from __future__ import annotations

import io
import json
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

    def describe(self) -> str:
        classes = len(np.unique(self.labels))
        model = f", {self.model}" if self.model else ""
        return f"{self.uri}: {len(self.labels)} rows, D = {self.dim}, {classes} classes{model}"


def output_files(uri: str, storage_options: dict | None = None) -> tuple[list[str], dict[str, Any]]:
    """The Parquet files of an output (full URIs, sorted) and its manifest ({} without one)."""
    uri = uri.rstrip("/") or uri
    fs, path = storage.filesystem(uri, storage_options)
    if not fs.exists(path):
        raise ValueError(f"{uri} does not exist; pass a directory that jobs/embed.py wrote (its --out)")
    if not fs.isdir(path):
        if not uri.endswith(PARQUET):
            raise ValueError(f"{uri} is a file but not .parquet; pass an embedding output directory")
        return [uri], {}
    names = storage.list_files(uri, storage_options)
    manifest: dict[str, Any] = {}
    if MANIFEST in names:
        try:
            manifest = json.loads(storage.read_text(storage.join(uri, MANIFEST), storage_options))
        except ValueError as e:
            raise ValueError(
                f"{storage.join(uri, MANIFEST)} is not valid JSON ({e}); re-run jobs/embed.py"
            ) from e
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
    return [storage.join(uri, f) for f in files], manifest


def load_embeddings(uri: str, storage_options: dict | None = None, *, name: str = "--train") -> Embeddings:
    """Read every row of an output; a one-line ValueError when it has no labels, mixes widths or is
    not an embedding output (``name`` is the flag that named it, for the message)."""
    files, manifest = output_files(uri, storage_options)
    claim = identity.read(uri, storage_options) if manifest else None  # a vitray output directory
    # What every file must agree with: the claim, else the manifest, else the first file's footer.
    reference, where = (claim, identity.CLAIM) if claim else (manifest or None, MANIFEST)
    if claim and manifest:
        _same(name, uri, claim, identity.CLAIM, manifest, MANIFEST)
    tables = []
    about = manifest
    for file in files:
        fs, path = storage.filesystem(file, storage_options)
        try:
            table = pq.read_table(io.BytesIO(fs.cat_file(path)), columns=["key", "embedding", "label"])
        except (pa.ArrowException, KeyError, OSError) as e:
            raise ValueError(
                f"{name} {file} is not an embedding file (key, embedding, label columns): {e}"
            ) from e
        if table.schema.metadata and METADATA_KEY in table.schema.metadata:
            footer = json.loads(table.schema.metadata[METADATA_KEY])
            about = about or footer
            if reference is None:
                reference, where = footer, file.rsplit("/", 1)[-1]
            else:
                _same(name, uri, reference, where, footer, file.rsplit("/", 1)[-1])
        if not pa.types.is_fixed_size_list(table.schema.field("embedding").type):
            raise ValueError(
                f"{name} {file}: its embedding column is not fixed_size_list<float32 or float16>[D]"
            )
        tables.append(table)
    dims = {t.schema.field("embedding").type.list_size for t in tables}
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
    embedding = table.column("embedding").combine_chunks()
    features = embedding.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)
    keys = np.asarray(table.column("key").to_pylist(), dtype=object)
    finite = np.isfinite(features).all(axis=1)
    if not finite.all():
        raise ValueError(
            f"{name} {uri}: {int((~finite).sum())} of {len(finite)} rows hold NaN or inf (first: key "
            f"{keys[~finite][0]}); embed them again with weights that hold finite values"
        )
    return Embeddings(uri, features, labels.astype(np.int64), keys, about)


def _same(name: str, uri: str, a: dict, a_name: str, b: dict, b_name: str) -> None:
    why = identity.difference(a, b, f"in {a_name}", f"in {b_name}")
    if why is not None:
        raise ValueError(
            f"{name} {uri} mixes embeddings of two configurations ({why}); re-embed it with "
            "jobs/embed.py --overwrite, or pass an output of one model"
        )


def check_pair(train: Embeddings, test: Embeddings) -> None:
    """One line when the two outputs cannot be compared: other widths, or other weights."""
    if train.dim != test.dim:
        raise ValueError(
            f"--train has D = {train.dim} but --test D = {test.dim}; embed both with the same model"
        )
    if train.weights_sha256 and test.weights_sha256 and train.weights_sha256 != test.weights_sha256:
        raise ValueError(
            f"--train and --test were embedded with other weights (sha256 {train.weights_sha256[:12]} vs "
            f"{test.weights_sha256[:12]}); embed both with the same --weights"
        )
    unseen = sorted(set(np.unique(test.labels)) - set(np.unique(train.labels)))
    if unseen:
        raise ValueError(
            f"--test has classes that --train never shows ({', '.join(map(str, unseen[:5]))}); "
            "pass a --train split that holds every class"
        )
