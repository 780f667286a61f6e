"""What an evaluate or analyze run is: two frozen dataclasses that the jobs' command lines fill."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeline.weights import FORMATS

FEW_SHOTS = (1, 5, 10, 25)  # images per class, as in the paper's few-shot table


def shot_list(text: str) -> tuple[int, ...]:
    """``"1,5,10,25"`` -> ``(1, 5, 10, 25)``: the form of ``--shots``."""
    try:
        shots = tuple(int(part) for part in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from e
    return shots


@dataclass(frozen=True)
class EvaluateConfig:
    """One evaluation of embedding outputs; ``jobs/evaluate.py`` maps its flags onto it field by field."""

    train: str  # embedding output (a directory jobs/embed.py wrote, or one .parquet file) to fit on
    test: str  # embedding output to score on
    json: str | None = None  # also write the figures here as JSON
    k: int = 20  # neighbours of the k-NN vote
    shots: tuple[int, ...] = FEW_SHOTS
    seeds: int = 5  # few-shot draws per shot count, averaged
    l2_reg: float = 1.0  # few-shot ridge penalty (features centered, intercept not penalized)
    probe_c: float = 1.0  # inverse L2 strength of the logistic-regression probe (scikit-learn's C)
    probe_max_iter: int = 1000
    storage_options: dict | None = None
    overwrite: bool = False  # replace a --json file that is no evaluation report

    def __post_init__(self) -> None:
        object.__setattr__(self, "shots", tuple(self.shots))

    def validate(self) -> None:
        """A one-line ValueError for a value that cannot work."""
        for name in ("train", "test"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.k <= 0 or self.seeds <= 0 or self.probe_max_iter <= 0:
            raise ValueError("--k, --seeds and --probe-max-iter must be positive")
        if not self.shots or min(self.shots) <= 0:
            raise ValueError(f"--shots must be positive integers, got {self.shots}")
        if self.l2_reg < 0 or self.probe_c <= 0:
            raise ValueError("--l2-reg must be >= 0 and --probe-c > 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AnalyzeConfig:
    """One analysis of a model (the paper's Fig. 7); ``jobs/analyze.py`` maps its flags onto it."""

    weights: str  # run dir, final/ export, checkpoint_* dir, HF dir or weights file
    data: str  # shards whose images the attention distances are measured on
    out: str  # directory for the PNGs and analysis.json (local, s3://, gs://)
    images: int = 32  # images averaged over for the attention distances
    batch_size: int = 8  # images per forward (attention maps are (B, H, T, T) per layer)
    cpu: bool = False  # stay on CPU where a GPU is
    weights_format: str = "auto"
    model: str | None = None
    crop_fraction: float | None = None  # None: the training run's, else DataConfig's default
    storage_options: dict | None = None
    overwrite: bool = False  # write into an --out that holds files the analysis did not write

    def validate(self) -> None:
        """A one-line ValueError for a value that cannot work."""
        for name in ("weights", "data", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.images <= 0 or self.batch_size <= 0:
            raise ValueError("--images and --batch-size must be positive")
        if self.weights_format not in FORMATS:
            raise ValueError(f"--weights-format must be one of {', '.join(FORMATS)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
