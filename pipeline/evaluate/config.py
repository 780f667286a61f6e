"""What an evaluate or analyze run is: two frozen dataclasses that the jobs' command lines fill."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from pipeline import cli
from pipeline.data.config import EvalOverrides
from pipeline.model_source import Weights
from pipeline.settings import MAX_COUNT, setting
from pipeline.storage import Output, Storage

FEW_SHOTS = (1, 5, 10, 25)  # images per class, as in the paper's few-shot table


def shot_list(text: str) -> tuple[int, ...]:
    """``"1,5,10,25"`` -> ``(1, 5, 10, 25)``: the form of ``--shots``."""
    try:
        shots = tuple(int(part) for part in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from e
    return shots


@dataclass(frozen=True)
class EvaluateConfig(Storage):
    """One evaluation of embedding outputs; ``jobs/evaluate.py`` maps its flags onto it field by field."""

    train: str = setting(
        help="embedding output to fit on (jobs/embed.py's --out, or a .parquet file)", required=True
    )
    test: str = setting(help="embedding output to score on", required=True)
    json: str | None = setting(None, "also write the figures to this JSON file (local, s3://, gs://)")
    k: int = setting(20, "neighbours in the k-NN vote (cosine similarity, one vote each)", ge=1, le=MAX_COUNT)
    shots: tuple[int, ...] = setting(
        FEW_SHOTS,
        "few-shot sizes, images per class, comma-separated",
        parse=shot_list,
        metavar="N,N,...",
        ge=1,
        le=MAX_COUNT,
        required=True,
    )
    seeds: int = setting(5, "few-shot draws per size, averaged", ge=1, le=1000)
    # A penalty or an inverse one past 1e9 is, for unit-scale features, none at all or an infinite one.
    l2_reg: float = setting(
        1.0, "few-shot ridge penalty (features centered, intercept not penalized)", ge=0, le=1e9
    )
    probe_c: float = setting(
        1.0, "inverse L2 strength of the logistic-regression probe (scikit-learn's C)", gt=0, le=1e9
    )
    probe_max_iter: int = setting(1000, "L-BFGS iterations of the probe", ge=1, le=MAX_COUNT)
    overwrite: bool = setting(False, "replace a --json file that is no evaluation report")

    def __post_init__(self) -> None:
        object.__setattr__(self, "shots", tuple(self.shots))


@dataclass(frozen=True)
class AnalyzeConfig(EvalOverrides, Weights, Output):
    """One analysis of a model (the paper's Fig. 7); ``jobs/analyze.py`` maps its flags onto it. Its
    sections are the embedding job's: storage and output, weights, the evaluation transform."""

    HELP: ClassVar[dict[str, str]] = {
        "out": "directory for the PNGs and analysis.json (local, s3:// or gs://)",
        "overwrite": "write into an --out that holds files the analysis did not write",
    }

    data: str = setting(
        help="shards to take the images from (path, directory, glob, brace range, s3://, ...)", required=True
    )
    images: int = setting(32, "images the attention distances are averaged over", ge=1, le=MAX_COUNT)
    batch_size: int = setting(
        8, "images per forward pass (attention maps are (B, H, T, T) per layer)", ge=1, le=MAX_COUNT
    )
    cpu: bool = setting(False, "stay on CPU where a GPU is")


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
