"""What an embedding output is of, and the claim that keeps it to one identity.

An output holds the embeddings of one configuration, its identity: model config, weights sha256, kind
(``cls`` / ``pre_logits``), the preprocessing fields that change pixels or rows (among them square or
native-aspect patches and the patch budget: no output mixes the two), device and precision,
and how rows are stored: L2-normalized or not, float32 or float16 (`identity`). A run claims ``--out``
for its identity in ``_identity.json`` before it writes or removes anything there (`claim`), and reads the claim again before each commit publishes a file (`check`); a
run that finds another identity's claim raises `OutputClaimedError`, one line, and publishes nothing more
(at its start: nothing at all). Runs of one identity share the claim. ``--overwrite`` replaces it.

What the claim guarantees, by store:

- Local disk: created exclusively (`pipeline.storage.create_text`: a complete temporary file hard-linked
  onto the name, a link that fails where a file exists). Of two runs of different identities into one
  ``--out``, however close their starts, exactly one holds the claim; the other fails at its start. A run
  whose claim an ``--overwrite`` run replaced stops at its next commit; only the one file whose check
  came just before the replacement can still be published.
- Object stores: a conditional create (If-None-Match) where the fsspec backend sends one (fsspec 2024.12
  and later: s3fs, gcsfs) and the store honours it (AWS S3, GCS): as strong as local disk. Elsewhere
  (older fsspec, stores that ignore the condition) the claim is written where none is found, then read
  back: two runs that both found none both write, the later write stands, and the other run sees another
  identity at its read-back or, at the latest, before its next commit, and stops. Only its one commit
  whose check came before the later write can be published.

Such a file is never silent: every file's footer names its identity, a run counts a shard as done only
when the footer names its own, and ``jobs/evaluate.py`` refuses an output whose files disagree.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pipeline import storage
from pipeline.data.config import EvalTransform
from vit.config import REGULARIZATION_FIELDS

CLAIM = "_identity.json"  # "_" keeps Parquet readers out
VERSION = 1  # of an output's header (claim, manifest, footers): a newer one is refused, not misread
# DataConfig fields that decide which rows a shard yields and what pixels they see (every knob of the
# evaluation transform among them); the others say how reading runs (block sizes, concurrency,
# credentials, the bad-sample budget) and change no output.
PREPROCESSING_IDENTITY = (
    "image_size",
    "patch_size",
    "patches",
    "max_patches",
    *(f.name for f in dataclasses.fields(EvalTransform)),
    "jpeg_draft",
    "reducing_gap",
    "image_keys",
    "label_key",
    "require_labels",
    "max_image_pixels",
)


# What outputs written before a preprocessing field was recorded did: square crops (no patch budget).
PREPROCESSING_DEFAULTS = {"patches": "square", "max_patches": None}

# How the embeddings are stored (`EmbedConfig.output_options`); outputs written before it was recorded
# hold plain float32 rows.
DEFAULT_OUTPUT_OPTIONS = {"normalize": False, "dtype": "float32"}


class OutputClaimedError(RuntimeError):
    """``--out`` is claimed for embeddings of another configuration: this run publishes nothing more."""


def identity(header: dict[str, Any]) -> dict[str, Any]:
    """What must match for embeddings to belong to one output: model, weights, kind, preprocessing."""
    preprocessing = header.get("preprocessing") or {}
    model = (header.get("model") or {}).get("config")
    if isinstance(model, dict):
        # Fields of training mode only change nothing the job computes (in eval mode); outputs written
        # before the model config had them stay this output's.
        model = {k: v for k, v in model.items() if k not in REGULARIZATION_FIELDS}
    return {
        "model": model,
        "weights sha256": (header.get("weights") or {}).get("sha256"),
        "embedding": header.get("embedding"),
        "preprocessing": {
            k: preprocessing.get(k, PREPROCESSING_DEFAULTS.get(k)) for k in PREPROCESSING_IDENTITY
        },
        "compute": header.get("compute"),  # device and precision: GPU bf16 rows differ from CPU fp32
        "output": header.get("output") or DEFAULT_OUTPUT_OPTIONS,  # L2-normalized, stored dtype
    }


def difference(
    old: dict[str, Any], new: dict[str, Any], there: str = "there", now: str = "now"
) -> str | None:
    """The first difference between two headers' identities, in words (``there`` and ``now`` name
    where each was found), or None."""
    a, b = identity(old), identity(new)
    for key in a:
        if a[key] == b[key]:
            continue
        if isinstance(a[key], dict) and isinstance(b[key], dict):
            names = [*a[key], *(k for k in b[key] if k not in a[key])]  # in the identity's order
            changed = [k for k in names if a[key].get(k) != b[key].get(k)]
            k = changed[0]
            return f"{key} {k} {a[key].get(k)!r} {there}, {b[key].get(k)!r} {now}"
        return f"{key} {_short(a[key])} {there}, {_short(b[key])} {now}"
    return None


def read(out: storage.Location | str) -> dict[str, Any] | None:
    """The claim in output directory ``out`` (a header), or None; a one-line ValueError when it is not one."""
    uri = storage.as_location(out).join(CLAIM)
    try:
        text = storage.read_text(uri)
    except FileNotFoundError:
        return None
    try:
        claim = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{uri} is not valid JSON ({e}); pass --overwrite to start this output anew") from e
    if not isinstance(claim, dict):
        raise ValueError(f"{uri} is not a vitray embedding claim; choose another --out")
    check_version(claim, uri)
    return claim


def check_version(header: dict[str, Any], where: object) -> None:
    """A one-line ValueError naming ``where`` when a header saved there is of a newer version than this
    vitray reads: its fields may mean what this one would not check."""
    version = header.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION:
        raise ValueError(
            f"{where} is version {version!r} of the embedding output, newer than this vitray reads "
            f"({VERSION}); update vitray"
        )


def claim(out: storage.Location | str, header: dict[str, Any], run_id: str, *, replace: bool) -> None:
    """Claim ``out`` for ``header``'s identity (``replace``: whatever claim is there), then `check` it."""
    text = json.dumps({**header, "run": run_id}, indent=1) + "\n"
    where = storage.as_location(out).join(CLAIM)
    if replace:
        storage.write_text(where, text)
    else:
        storage.create_text(where, text)
    check(out, header)


def check(out: storage.Location | str, header: dict[str, Any]) -> None:
    """`OutputClaimedError` unless the claim in ``out`` names ``header``'s identity."""
    held = read(out)
    why = f"{CLAIM} is gone" if held is None else difference(held, header)
    if why is not None:
        raise OutputClaimedError(
            f"{out} is claimed by another run for embeddings of another configuration ({why}); this run "
            "stopped and published nothing more: choose another --out, or pass --overwrite once that "
            "run has ended"
        )


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text[:16] + "..." if len(text) > 19 else text
