"""What an evaluate or analyze run is: two frozen dataclasses that the jobs' command lines fill."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pipeline import cli, settings
from pipeline.model_source import FORMATS
from pipeline.settings import setting
from pipeline.storage import Location

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

    train: str = setting(help="embedding output to fit on (jobs/embed.py's --out, or a .parquet file)")
    test: str = setting(help="embedding output to score on")
    json: str | None = setting(None, "also write the figures to this JSON file (local, s3://, gs://)")
    k: int = setting(20, "neighbours in the k-NN vote (cosine similarity, one vote each)")
    shots: tuple[int, ...] = setting(
        FEW_SHOTS, "few-shot sizes, images per class, comma-separated", parse=shot_list, metavar="N,N,..."
    )
    seeds: int = setting(5, "few-shot draws per size, averaged")
    l2_reg: float = setting(1.0, "few-shot ridge penalty (features centered, intercept not penalized)")
    probe_c: float = setting(1.0, "inverse L2 strength of the logistic-regression probe (scikit-learn's C)")
    probe_max_iter: int = setting(1000, "L-BFGS iterations of the probe")
    storage_options: dict | None = setting(
        None, "fsspec options as JSON (credentials: prefer the environment)", secret=True
    )
    overwrite: bool = setting(False, "replace a --json file that is no evaluation report")

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

    def location(self, url: str) -> Location:
        """``url`` (an input or output of the job) with ``storage_options``."""
        return Location(url, self.storage_options)

    def to_dict(self) -> dict[str, Any]:
        return settings.to_dict(self)


@dataclass(frozen=True)
class AnalyzeConfig:
    """One analysis of a model (the paper's Fig. 7); ``jobs/analyze.py`` maps its flags onto it."""

    weights: str = setting(help="run dir, final/ export, checkpoint_* dir, HF dir or weights file")
    data: str = setting(
        help="shards to take the images from (path, directory, glob, brace range, s3://, ...)"
    )
    out: str = setting(help="directory for the PNGs and analysis.json (local, s3:// or gs://)")
    images: int = setting(32, "images the attention distances are averaged over")
    batch_size: int = setting(8, "images per forward pass (attention maps are (B, H, T, T) per layer)")
    cpu: bool = setting(False, "stay on CPU where a GPU is")
    weights_format: str = setting(
        "auto", "what --weights holds (auto: told from the files and their keys)", choices=FORMATS
    )
    model: str | None = setting(
        None, "variant name, checked against the weights; needed where shapes can't tell heads"
    )
    crop_fraction: float | None = setting(
        None, "center-crop share of the short side (none: the training run's, else 0.875)"
    )
    storage_options: dict | None = setting(
        None, "fsspec options as JSON (credentials: prefer the environment)", secret=True
    )
    overwrite: bool = setting(False, "write into an --out that holds files the analysis did not write")

    def validate(self) -> None:
        """A one-line ValueError for a value that cannot work."""
        for name in ("weights", "data", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.images <= 0 or self.batch_size <= 0:
            raise ValueError("--images and --batch-size must be positive")
        if self.weights_format not in FORMATS:
            raise ValueError(f"--weights-format must be one of {', '.join(FORMATS)}")

    def location(self, url: str) -> Location:
        """``url`` (an input or output of the job) with ``storage_options``."""
        return Location(url, self.storage_options)

    def to_dict(self) -> dict[str, Any]:
        return settings.to_dict(self)


def evaluate_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/evaluate.py`'s command line (one process, no Ray)."""
    return cli.job_parser(
        "jobs/evaluate.py", description, EvaluateConfig, defaults=EvaluateConfig(train="", test=""), ray=False
    )


def analyze_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/analyze.py`'s command line (one process, no Ray)."""
    return cli.job_parser(
        "jobs/analyze.py",
        description,
        AnalyzeConfig,
        defaults=AnalyzeConfig(weights="", data="", out=""),
        ray=False,
    )
