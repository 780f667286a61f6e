"""`jobs/pretrain.py` as a user runs it: its flags, its errors, and the tiny preset end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.train.config import TrainConfig
from tests.job_scripts import load_job, run_without_ray

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "jobs" / "pretrain.py"

# The command line is an interface: adding or removing a flag is a decision, made here on purpose.
FLAGS = {
    "--preset", "--print-config", "--verbose", "--help", "--address", "--num-cpus",
    # arch, task
    "--model", "--num-classes", "--drop-path-rate", "--dropout", "--objective", "--label-smoothing",
    "--mixup-alpha", "--cutmix-alpha", "--mix-prob", "--switch-prob", "--mask-ratio", "--norm-pix-loss", "--no-norm-pix-loss",
    "--decoder-dim", "--decoder-depth", "--decoder-num-heads",
    # data
    "--image-size", "--patches", "--max-patches", "--crop-scale", "--crop-ratio", "--hflip", "--no-hflip", "--crop-fraction",
    "--randaug-ops", "--randaug-magnitude",
    "--train-interpolation", "--eval-interpolation", "--jpeg-draft", "--no-jpeg-draft", "--reducing-gap",
    "--image-keys", "--label-key", "--shuffle-buffer", "--max-bad-fraction", "--max-lost-shards", "--bad-grace-samples",
    "--max-image-pixels", "--storage-options", "--block-rows", "--block-bytes", "--read-concurrency",
    "--read-attempts", "--read-backoff-s", "--decode-nodes",
    # optim
    "--optimizer", "--momentum", "--batch-size", "--micro-batch-size", "--lr", "--min-lr", "--weight-decay",
    "--betas", "--warmup-steps", "--max-steps", "--lr-schedule", "--grad-clip", "--max-skipped-steps",
    "--layer-decay", "--ema-decay", "--ema-every",
    # speed
    "--activation-checkpointing", "--no-activation-checkpointing", "--ac-mode", "--compile", "--no-compile",
    "--compile-scope", "--optimizer-impl", "--fp8", "--no-fp8", "--prefetch-steps", "--data-process",
    # cluster
    "--num-workers", "--use-gpu", "--no-use-gpu", "--cpu", "--cpus-per-worker", "--placement-strategy",
    "--data-cpus-per-worker", "--shard-group-size", "--shared-out", "--no-shared-out",
    # run
    "--data", "--source-exhausted", "--eval-data", "--out", "--overwrite", "--no-overwrite", "--seed", "--eval-every", "--log-every", "--checkpoint-every",
    "--keep-checkpoints", "--max-failures", "--stop-at-step", "--hang-timeout", "--price-per-device-hour",
    "--tensorboard", "--no-tensorboard", "--wandb",
    "--async-checkpoint", "--no-async-checkpoint",
    # what the checkpoints are worth
    "--probe-data", "--probe-eval-data", "--probe-label-key", "--probe-cpus", "--probe-gpu", "--no-probe-gpu",
    "--probe-timeout", "--keep-best", "--val-data",
}  # fmt: skip


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The job as its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(PRETRAIN), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def run_here(*args: str) -> subprocess.CompletedProcess:
    """The job in this process, Ray out of reach: for the checks before any cluster work."""
    return run_without_ray("pretrain", *args)


def test_help_lists_exactly_the_frozen_flags():
    result = run("--help")
    assert result.returncode == 0
    options = result.stdout.split("\noptions:", 1)[1]  # past the description's example commands
    assert set(re.findall(r"(--[a-z][a-z0-9-]+)", options)) == FLAGS  # digits: --fp8


def test_flags_override_the_preset():
    result = run_here(
        "--preset", "vit_h14_224", "--data", "x", "--out", "y", "--lr", "0.5", "--cpu",
        "--objective", "mae", "--label-key", "none", "--print-config",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = TrainConfig.from_dict(json.loads(result.stdout))
    assert (config.arch.model, config.optim.lr, config.cluster.use_gpu, config.optim.batch_size) == (
        "vit_h14",
        0.5,
        False,
        4096,
    )
    assert config.data.label_key is None  # `none` sets None, where a flag left out keeps the preset's


def test_augmentation_flags_reach_the_data_stage():
    result = run_here(
        "--data", "x", "--out", "y", "--crop-scale", "0.25,0.9", "--crop-ratio", "0.5,2", "--no-hflip",
        "--randaug-ops", "2", "--randaug-magnitude", "10", "--print-config",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = TrainConfig.from_dict(json.loads(result.stdout))
    data = config.data_for(8)
    assert (data.scale, data.ratio, data.hflip) == ((0.25, 0.9), (0.5, 2.0), False)
    assert (data.randaug_ops, data.randaug_magnitude) == (2, 10.0)  # AugReg's randaug(2, 10)
    # Left out, they keep the preset's values: the paper's crop and flips, no RandAugment.
    default = TrainConfig.from_dict(
        json.loads(run_here("--data", "x", "--out", "y", "--print-config").stdout)
    ).data
    assert (default.scale, default.ratio, default.hflip) == ((0.08, 1.0), (0.75, 4 / 3), True)
    assert default.randaug_ops == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "vit_nope"], "unknown model 'vit_nope'; choose one of: vit_ti16"),
        (["--image-size", "30"], "image_size 30 is not divisible by patch_size 8"),
        (["--batch-size", "48"], "is not a multiple of --micro-batch-size"),
        (["--randaug-magnitude", "12"], "--randaug-magnitude must be in [0, 10], got 12.0"),
        (["--randaug-ops", "-1"], "--randaug-ops must be from 0 to 100, got -1"),
        (["--data", "a=/x/{0..3}.tar:0.5,b=/y:0"], "source b: weight 0.0 must be a positive number"),
    ],
)
def test_bad_configuration_fails_at_once_with_one_line(synthetic_shards, tmp_path, args, message):
    result = run_here(
        "--preset", "tiny", "--data", str(synthetic_shards.dir), "--out", str(tmp_path / "run"), *args
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Ray" not in result.stdout + result.stderr  # failed before any cluster work
    assert not (tmp_path / "run").exists()


def test_fewer_shards_than_workers_fail_at_once_with_one_line(
    synthetic_shards, tmp_path, monkeypatch, capsys
):
    # The job script itself, in this process (a subprocess would spend its time importing torch),
    # with Ray out of reach: reaching for it is the cluster work that must not start.
    from pipeline import cli

    def no_ray(*args, **kwargs):
        raise AssertionError("the job reached for Ray")

    monkeypatch.setattr(cli, "connect_ray", no_ray)
    pretrain = load_job("pretrain")
    args = ["--data", synthetic_shards.dir, "--out", str(tmp_path / "run"), "--num-workers", "5"]
    assert pretrain.main([*args, "--batch-size", "160"]) == cli.EXIT_BAD_INPUT  # 5 x 32: a valid batch
    err = capsys.readouterr().err
    assert err.startswith("error: 4 shard(s) for 5 workers: every worker needs at least one")
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_empty_data_fails_at_once_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("--preset", "tiny", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert str(tmp_path / "empty") in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Ray" not in result.stdout + result.stderr


def test_unlabeled_shards_fail_at_once_with_one_line(tmp_path):
    from pipeline.data.synthetic import encode, render
    from pipeline.data.writing import tar_bytes

    members = [(f"s{i:03d}.jpg", encode(render(i, image_size=32)[0])) for i in range(4)]  # no .cls
    (tmp_path / "shards").mkdir()
    for n in range(2):
        (tmp_path / "shards" / f"train-{n:06d}.tar").write_bytes(tar_bytes(members))
    result = run_here("--preset", "tiny", "--data", str(tmp_path / "shards"), "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "carries no label member .cls" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Ray" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "note"),
    [
        (
            ["--eval-every", "4"],
            "note: no --eval-data, so --eval-every 4 evaluates nothing (--eval-data: held-out",
        ),
        (
            ["--objective", "mae", "--label-key", "none", "--eval-every", "4"],
            "note: no --eval-data, so --eval-every 4 evaluates nothing (--eval-data: supervised runs only;",
        ),
        (["--eval-every", "4", "--eval-data", "EVAL"], None),
        ([], None),  # the preset's 0: only at the end, and no --eval-data: nothing to say
    ],
    ids=["supervised", "mae", "with-eval-data", "preset-default"],
)
def test_eval_every_without_eval_data_says_before_ray_that_nothing_is_evaluated(
    synthetic_shards, tmp_path, monkeypatch, capsys, args, note
):
    from pipeline import cli

    def no_ray(*args, **kwargs):
        raise ValueError("the job reached for Ray")  # where this test stops it

    monkeypatch.setattr(cli, "connect_ray", no_ray)
    args = [synthetic_shards.dir if a == "EVAL" else a for a in args]
    argv = ["--preset", "tiny", "--data", synthetic_shards.dir, "--out", str(tmp_path / "run"), *args]
    assert load_job("pretrain").main(argv) == cli.EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.err == "error: the job reached for Ray\n"  # so every check before Ray passed
    notes = [line for line in captured.out.splitlines() if line.startswith("note: ")]
    if note is None:
        assert notes == [], captured.out
    else:
        assert len(notes) == 1 and notes[0].startswith(note), captured.out
