"""`jobs/finetune.py` as a user runs it: the paper's recipe by default, and one-line errors before any Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline.train.config import TrainConfig
from tests.job_scripts import run_without_ray

ROOT = Path(__file__).resolve().parents[2]
FINETUNE = ROOT / "jobs" / "finetune.py"


def run(*args: str) -> subprocess.CompletedProcess:
    """The job as its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(FINETUNE), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def run_here(*args: str) -> subprocess.CompletedProcess:
    """The job in this process, Ray out of reach: for the checks before any cluster work."""
    return run_without_ray("finetune", *args)


def test_the_default_is_the_papers_finetuning_recipe_and_flags_override_it():
    result = run_here(
        "--weights", "w", "--data", "d", "--out", "o", "--image-size", "48", "--randaug-ops", "2",
        "--print-config",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = TrainConfig.from_dict(json.loads(result.stdout))
    assert (config.data.randaug_ops, config.data.randaug_magnitude) == (2, 9.0)
    optim = config.optim
    assert (optim.optimizer, optim.momentum, optim.weight_decay, optim.grad_clip) == (
        "sgd",
        0.9,
        0.0,
        1.0,
    )
    assert (optim.lr_schedule, config.arch.weights, config.data.image_size) == ("cosine", "w", 48)
    assert config.task.objective == "supervised"


def test_weights_that_are_not_there_fail_in_one_line(tmp_path):
    result = run("--weights", str(tmp_path / "nope"), "--data", str(tmp_path), "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_weights_are_required():
    result = run_here("--data", "d", "--out", "o")
    assert result.returncode == 2 and "--weights" in result.stderr
