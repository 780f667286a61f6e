"""The best checkpoint kept (``--keep-best``) and its export ``best/``.

    --keep-best probe | knn | eval | loss: the score, probe_accuracy | knn_accuracy | val_accuracy (highest
    best) | loss (lowest best), of each checkpoint's row in metrics.jsonl
      driver: Ray Train's retention ranks the checkpoints by it (`retention`): --keep-checkpoints K keeps
              the K best and the latest, so the best is never deleted; a checkpoint's report holds the
              score from the start (`report_fields`: NaN until its probe lands, ranked last), and a resume
              reads them back from Ray Train's snapshot
      rank 0, at the run's end: the best of the complete checkpoints by their rows' scores, and of a
              fine-tuning's starting point (best/'s own record) -> `export_checkpoint` writes it as best/
    --keep-best eval: the supervised head's top-1 on --val-data, or on a split of --data held out from
      training (`pipeline.train.scoring.sets.validation_split`), never on --eval-data, which may be the
      test set
    a fine-tuning's starting point (step 0: the pretrained weights under the head it starts with) is scored
      and exported as best/ before its first step (`pipeline.train.loop`), so with --keep-best a fine-tuning
      never ends under where it started; loss has no score there (no step has run)

Ties go to the later checkpoint, as Ray Train's retention breaks them. ``best/`` is an export like
``final/`` (every job takes it as ``--weights``); its config.json's ``training`` record holds its step,
scores and ``best: {by, score}``, which is how a later part of the run knows what it holds.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline import dcp, storage
from pipeline.train.observe.metrics import log_line

BEST = "best"  # the export's directory under --out
# --keep-best -> (the row's score, whether higher is better)
SCORES = {
    "probe": ("probe_accuracy", True),
    "knn": ("knn_accuracy", True),
    "eval": ("val_accuracy", True),
    "loss": ("loss", False),
}
LABELS = {
    "probe_accuracy": "linear probe",
    "knn_accuracy": "k-NN",
    "val_accuracy": "val accuracy",
    "loss": "loss",
}


@dataclass(frozen=True)
class Best:
    """A candidate for best/: its step, its score, and where its weights are (a checkpoint's name, or
    `BEST` for the export already there)."""

    step: int
    score: float
    name: str

    def describe(self, kind: str) -> str:
        key, _ = SCORES[kind]
        value = f"{self.score:.4f}" if key == "loss" else f"{100 * self.score:.2f}%"
        return f"step {self.step}, {LABELS[key]} {value}"


def retention(keep_best: str | None) -> dict[str, Any]:
    """Ray Train's `CheckpointConfig` arguments that rank checkpoints by ``--keep-best`` ({} without it:
    the latest are kept)."""
    if keep_best is None:
        return {}
    key, higher = SCORES[keep_best]
    return {"checkpoint_score_attribute": key, "checkpoint_score_order": "max" if higher else "min"}


def report_fields(keep_best: str | None) -> dict[str, float]:
    """What a checkpoint's report to Ray Train holds beneath its row: the score it is ranked by, NaN until
    known (its probe lands later; a preemption's checkpoint has no evaluation), so that Ray ranks it last
    rather than log that the score is missing."""
    return {} if keep_best is None else {SCORES[keep_best][0]: float("nan")}


def choose(
    kind: str, rows: list[dict[str, Any]], complete: dict[int, str], exported: Best | None
) -> Best | None:
    """The best of the complete checkpoints (step -> name) by their ``rows``' scores, and of ``exported``
    (what best/ holds already); None where none has a score. Ties go to the later step."""
    key, higher = SCORES[kind]
    candidates = [exported] if exported is not None else []
    for row in rows:
        value = row.get(key)
        if row["step"] in complete and isinstance(value, int | float) and math.isfinite(value):
            candidates.append(Best(row["step"], float(value), complete[row["step"]]))
    if not candidates:
        return None
    return max(candidates, key=lambda b: (b.score if higher else -b.score, b.step, b.name == BEST))


def complete_checkpoints(run_dir: storage.Location) -> dict[int, str]:
    """Step -> name of every complete checkpoint under the run directory."""
    fs, root = run_dir.fs()
    if not fs.isdir(root):
        return {}
    found = {}
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("checkpoint_") and dcp.is_complete(run_dir.join(name)):
            found[int(name.rsplit("_", 1)[-1])] = name
    return found


def exported_best(run_dir: storage.Location, kind: str) -> Best | None:
    """What best/ holds, as its config.json records it (None: no best/, or one ranked by another score)."""
    where = run_dir.join(BEST, dcp.CONFIG)
    if not storage.exists(where):
        return None
    record = (json.loads(storage.read_text(where)).get("training") or {}).get("best") or {}
    score = record.get("score")
    if record.get("by") != kind or not isinstance(score, int | float) or not math.isfinite(score):
        return None
    return Best(int(record["step"]), float(score), BEST)


def training_record(extra: dict[str, Any], kind: str, step: int, score: float | None) -> dict[str, Any]:
    """``extra`` (an export's config.json record) with its training record naming it the best by ``kind``."""
    training = {**extra.get("training", {}), "step": step, "best": {"by": kind, "step": step, "score": score}}
    return {**extra, "training": training}


def export_checkpoint(run_dir: storage.Location, best: Best, extra: dict[str, Any]) -> storage.Location:
    """Rank 0, in one process: the model of checkpoint ``best.name`` written as best/ (config.json last),
    with ``extra`` (the run's export record for that step); the encoder alone for an MAE run, as final/."""
    import vit
    from pipeline.model_source import load_model_source

    source = load_model_source(run_dir.join(best.name))
    where = run_dir.join(BEST)
    with tempfile.TemporaryDirectory(prefix="vitray-best-") as tmp:
        vit.save_pretrained(tmp, source.state_dict, source.config, extra=extra)
        storage.upload_dir(tmp, where, commit_last=dcp.CONFIG)
    return where


def record_scores(run_dir: storage.Location, kind: str, scores: dict[str, Any]) -> float | None:
    """Rank 0: a probe of best/ landed (a fine-tuning's starting point): its ``scores`` into best/'s
    training record, its score by ``kind`` the one best/ is ranked by. Returns that score (None: best/ holds
    another run's or none)."""
    where = run_dir.join(BEST, dcp.CONFIG)
    if not storage.exists(where):
        return None
    meta = json.loads(storage.read_text(where))
    training = meta.get("training") or {}
    key, _ = SCORES[kind]
    training.update({k: v for k, v in scores.items() if isinstance(v, int | float)})
    if isinstance(training.get("best"), dict):
        training["best"]["score"] = scores.get(key)
    meta["training"] = training
    storage.write_text(where, json.dumps(meta, indent=2, sort_keys=True))
    return scores.get(key)


def keep(
    kind: str, run_dir: storage.Location, log: Any, extra: Callable[[dict[str, Any], int], dict[str, Any]]
) -> Best | None:
    """Rank 0, at the run's end: the best of the complete checkpoints by the rows of ``log`` (its
    `MetricsLog`), and of what best/ holds already, exported as best/ with ``extra(row, step)`` (the run's
    export record) and a log line; None (and a log line) where no checkpoint has a score."""
    chosen = choose(kind, log.rows, complete_checkpoints(run_dir), exported_best(run_dir, kind))
    where = run_dir.join(BEST)
    if chosen is None:
        log_line(
            f"no checkpoint has a score by --keep-best {kind} (see metrics.jsonl): {where} is not written"
        )
        return None
    if chosen.name == BEST:
        log_line(f"best checkpoint by --keep-best {kind}: {chosen.describe(kind)}; kept in {where}")
        return chosen
    export_checkpoint(
        run_dir,
        chosen,
        training_record(extra(log.row(chosen.step), chosen.step), kind, chosen.step, chosen.score),
    )
    log_line(
        f"best checkpoint by --keep-best {kind}: {chosen.name}, {chosen.describe(kind)}; exported to {where}"
    )
    return chosen
