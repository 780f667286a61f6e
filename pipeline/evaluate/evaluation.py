"""The evaluate job: two embedding outputs in, the three scores of `pipeline.evaluate.probes` out.

    --train DIR, --test DIR -> load both (labels required, same width and weights)
                            -> linear probe, k-NN, few-shot at each --shots, each over --seeds draws
                            -> a table for people (`EvaluationReport.format`) and JSON (`to_dict`)

One process, no Ray: the embeddings of a few hundred thousand images fit in memory (D floats each),
and scikit-learn and numpy use this machine's cores.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import storage
from pipeline.embed.reader import Embeddings, load_embeddings
from pipeline.evaluate import probes
from pipeline.evaluate.config import EvaluateConfig


@dataclass
class EvaluationReport:
    """What an evaluation found; accuracies are shares in [0, 1]."""

    train: dict[str, Any]  # uri, rows, dim, classes, model
    test: dict[str, Any]
    linear_probe: dict[str, Any]  # accuracy, c, converged
    knn: dict[str, Any]  # accuracy, k, vote
    few_shot: dict[str, dict[str, Any]] = field(default_factory=dict)  # str(shots) -> mean, std, per_seed
    config: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "train": self.train,
            "test": self.test,
            "linear_probe": self.linear_probe,
            "knn": self.knn,
            "few_shot": self.few_shot,
            "config": self.config,
            "seconds": round(self.seconds, 3),
        }

    def format(self) -> str:
        lines = [f"{'metric':<34} {'accuracy':>10}", f"{'-' * 34} {'-' * 10}"]
        probe = self.linear_probe
        note = "" if probe["converged"] else "  (did not converge: raise --probe-max-iter)"
        lines.append(
            f"{'linear probe (logistic, C=' + format(probe['c'], 'g') + ')':<34} {_pct(probe['accuracy'])}{note}"
        )
        lines.append(
            f"{'k-NN (k=' + str(self.knn['k']) + ', cosine, majority)':<34} {_pct(self.knn['accuracy'])}"
        )
        for shots, result in self.few_shot.items():
            name = f"{shots}-shot linear (ridge, l2 {self.config.get('l2_reg'):g})"
            if "skipped" in result:
                lines.append(f"{name:<34} {'-':>10}  ({result['skipped']})")
            else:
                spread = f"± {100 * result['std']:.1f} (std over {len(result['per_seed'])} seeds)"
                lines.append(f"{name:<34} {_pct(result['mean'])}  {spread}")
        return "\n".join(lines)


def _pct(value: float) -> str:
    return f"{100 * value:9.2f}%"


def _about(e: Embeddings) -> dict[str, Any]:
    return {
        "uri": e.uri,
        "rows": len(e.labels),
        "dim": e.dim,
        "classes": len(np.unique(e.labels)),
        "model": e.model,
    }


def load(config: EvaluateConfig) -> tuple[Embeddings, Embeddings]:
    """Both outputs, checked against each other and the config; raises a one-line ValueError."""
    config.validate()
    if config.json:
        check_json_target(config.location(config.json), overwrite=config.overwrite)
    train = load_embeddings(config.location(config.train), name="--train")
    test = load_embeddings(config.location(config.test), name="--test")
    if len(np.unique(train.labels)) < 2:
        raise ValueError(f"--train {train.uri} holds one class only; a classifier needs two or more")
    check_pair(train, test)
    if config.k > len(train.labels):
        raise ValueError(
            f"--k {config.k} is more than the {len(train.labels)} --train rows; pass a smaller --k"
        )
    return train, test


def evaluate(config: EvaluateConfig, train: Embeddings, test: Embeddings) -> EvaluationReport:
    """Score ``test`` with classifiers fitted on ``train``."""
    start = time.perf_counter()
    x, y, tx, ty = train.features, train.labels, test.features, test.labels
    accuracy, converged = probes.linear_probe_accuracy(
        x, y, tx, ty, c=config.probe_c, max_iter=config.probe_max_iter
    )
    report = EvaluationReport(
        train=_about(train),
        test=_about(test),
        linear_probe={"accuracy": accuracy, "c": config.probe_c, "converged": converged},
        knn={"accuracy": probes.knn_accuracy(x, y, tx, ty, k=config.k), "k": config.k, "vote": "majority"},
        config=config.to_dict(),
    )
    for shots in config.shots:
        try:
            scores = probes.few_shot_accuracy(
                x, y, tx, ty, shots=shots, seeds=config.seeds, l2_reg=config.l2_reg
            )
        except ValueError as e:  # too few rows of some class for this many shots: the others still run
            report.few_shot[str(shots)] = {"skipped": str(e)}
            continue
        report.few_shot[str(shots)] = {
            "mean": float(np.mean(scores)),
            "std": float(np.std(scores)),
            "per_seed": scores,
            "l2_reg": config.l2_reg,
        }
    report.seconds = time.perf_counter() - start
    return report


def check_json_target(uri: storage.Location | str, *, overwrite: bool = False) -> None:
    """A one-line ValueError for a ``--json`` that is a root or a directory, or an existing file that is
    no evaluation report (unless ``overwrite``): a report of an earlier run is replaced."""
    if storage.is_root(uri) or storage.list_entries(uri):
        raise ValueError(f"--json {uri} is a directory; name a file")
    if overwrite or not storage.exists(uri):
        return
    try:
        ours = "linear_probe" in json.loads(storage.read_text(uri))
    except (ValueError, TypeError, UnicodeDecodeError):
        ours = False
    if not ours:
        raise ValueError(
            f"--json {uri} exists and is no evaluation report; pass --overwrite to replace it, or pick "
            "another --json"
        )


def write_json(report: EvaluationReport, uri: storage.Location | str) -> None:
    storage.write_text(uri, json.dumps(report.to_dict(), indent=2) + "\n")


def check_pair(train: Embeddings, test: Embeddings, names: tuple[str, str] = ("--train", "--test")) -> None:
    """One line when the two outputs cannot be compared: other widths, other weights, one L2-normalized
    and one not, shards in common (the manifests' shard lists), or test classes the training rows never
    show. ``names``: the flags that named the two, for the message."""
    fit, scored = names
    if train.dim != test.dim:
        raise ValueError(
            f"{fit} has D = {train.dim} but {scored} D = {test.dim}; embed both with the same model"
        )
    if train.weights_sha256 and test.weights_sha256 and train.weights_sha256 != test.weights_sha256:
        raise ValueError(
            f"{fit} and {scored} were embedded with other weights (sha256 {train.weights_sha256[:12]} vs "
            f"{test.weights_sha256[:12]}); embed both with the same --weights"
        )
    if train.normalized != test.normalized:  # distances and probes would compare rows of other scales
        plain, unit = (scored, fit) if train.normalized else (fit, scored)
        raise ValueError(
            f"{unit} was embedded with --normalize (unit-length rows) and {plain} without; embed both with "
            "the same --normalize"
        )
    shared = sorted(set(train.about.get("shards") or {}) & set(test.about.get("shards") or {}))
    if shared:
        raise ValueError(
            f"{fit} and {scored} were embedded from {len(shared)} of the same shards (first: {shared[0]}): "
            f"the test would score images the classifier trained on; embed a held-out split for {scored}"
        )
    unseen = sorted(set(np.unique(test.labels)) - set(np.unique(train.labels)))
    if unseen:
        raise ValueError(
            f"{scored} has classes that {fit} never shows ({', '.join(map(str, unseen[:5]))}); "
            f"pass a {fit} split that holds every class"
        )
