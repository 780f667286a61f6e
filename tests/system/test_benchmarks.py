"""The benchmarks' options run at a tiny size on CPU, as a user runs them: `train --compare-timm --trace`
and `embed --compare-timm`. timm is installed here, but in a job it does not import beside the CPU torch
(the registry's torchvision is built against CUDA torch; only the tests declare around that, in
conftest.py). So a stand-in package named timm, put first on PYTHONPATH, whose `create_model` builds a
ViT of the asked shape from vitray's own parts, takes its place: what is tested is the benchmark's logic
(the shape it asks for, the alternation, the report), not timm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.job_scripts import load_job

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "vit_tiny_test", "--image-size", "32", "--num-classes", "4"]

# timm's VisionTransformer interface, as the benchmarks use it: float images in, logits out. Every
# model built is recorded (its keyword arguments and whether checkpointing was asked) at exit.
STAND_IN = """
import atexit, json, os
from torch import nn
import vit

__version__ = "stand-in"
BUILT = []


class StandInViT(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        self.model = vit.create_model(
            "vit_tiny_test", image_size=kwargs["img_size"], patch_size=kwargs["patch_size"],
            embed_dim=kwargs["embed_dim"], depth=kwargs["depth"], num_heads=kwargs["num_heads"],
            mlp_dim=round(kwargs["mlp_ratio"] * kwargs["embed_dim"]), num_classes=kwargs["num_classes"],
            head="finetune",
        )
        self.checkpointing = False
        BUILT.append(self)

    def set_grad_checkpointing(self, enable=True):
        self.checkpointing = enable

    def forward(self, images):
        assert images.is_floating_point() and images.dim() == 4
        return self.model(images)

    def forward_features(self, images):
        return self.model.forward_features(images)


def create_model(name, pretrained=False, **kwargs):
    assert not pretrained
    return StandInViT(**kwargs)


@atexit.register
def _record():
    with open(os.environ["TIMM_STAND_IN_LOG"], "w") as f:
        json.dump([{"kwargs": m.kwargs, "checkpointing": m.checkpointing} for m in BUILT], f)
"""


def benchmark(
    *args: str, stand_in: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    if stand_in is not None:
        (stand_in / "timm").mkdir(parents=True, exist_ok=True)
        (stand_in / "timm" / "__init__.py").write_text(STAND_IN)
        env["PYTHONPATH"] = os.pathsep.join([str(stand_in), str(ROOT), env.get("PYTHONPATH", "")])
        env["TIMM_STAND_IN_LOG"] = str(stand_in / "built.json")
    return subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "benchmark.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_train_compares_with_timm_alternating_and_writes_a_trace(tmp_path):
    trace = tmp_path / "step.json"
    result = benchmark(
        "train", *TINY, "--micro-batch-size", "2", "--configs", "eager,ac-ops+fused", "--warmup", "1",
        "--iters", "2", "--compare-timm", "--trace", str(trace), "--json", str(tmp_path / "t.json"),
        stand_in=tmp_path / "site",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    built = json.loads((tmp_path / "site" / "built.json").read_text())
    # timm's model has vitray's shape, and checkpointing as each configuration says.
    assert [m["kwargs"]["depth"] for m in built] == [2, 2]
    assert [m["checkpointing"] for m in built] == [False, True]
    assert built[0]["kwargs"]["embed_dim"] == 64 and built[0]["kwargs"]["mlp_ratio"] == 2.0
    figures = json.loads((tmp_path / "t.json").read_text())
    configs = [r["config"] for r in figures["results"]]
    assert configs == ["eager", "timm (eager)", "ac-ops+fused", "timm (ac-ops+fused)"]
    assert all(r["images_per_s"] > 0 for r in figures["results"])
    assert [r["optimizer"] for r in figures["results"]] == ["foreach", "foreach", "fused", "foreach"]
    assert figures["vitray_over_timm"].keys() == {"eager", "ac-ops+fused"}
    # MFU's numerator: 3 x the forward's FLOPs (forward + a backward of twice as many).
    import vit

    encoder = vit.get_config("vit_tiny_test", image_size=32, num_classes=4)
    assert figures["results"][0]["flops_per_image"] == pytest.approx(3 * vit.count_flops(encoder))
    assert "timm (ac-ops+fused)" in result.stdout and "vitray / timm images/s, eager:" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events), "the trace holds no operator"


def test_train_with_a_timm_that_does_not_import_says_so_in_one_line_and_still_measures_with_ema(tmp_path):
    # A timm whose import fails as it does beside a torchvision built for another torch.
    broken = tmp_path / "broken" / "timm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    env = {"PYTHONPATH": os.pathsep.join([str(broken.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Also the micro-batch search: on a CPU nothing runs out of memory, so it ends at its limit.
    result = benchmark(
        "train", *TINY, "--micro-batch-size", "2", "--configs", "eager", "--warmup", "1", "--iters", "1",
        "--compare-timm", "--largest-micro-batch", "8", "--ema", "0.999", "--json", str(tmp_path / "t.json"),
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "timm does not import (RuntimeError: operator torchvision::nms does not exist): "
        "--compare-timm skipped\n" in result.stdout
    ), result.stdout[-3000:]
    assert "eager: largest micro-batch that fits: 8 (search limit 8)" in result.stdout
    figures = json.loads((tmp_path / "t.json").read_text())
    rows = figures["results"]
    # And, with --ema, the same step followed by an EMA update, the two alternating.
    assert [(r["config"], r["micro_batch_size"]) for r in rows] == [("eager", 8), ("eager+ema", 8)]
    assert figures["ema_step_time_ratio"]["eager"] > 0
    assert "step time with / without the EMA update, eager:" in result.stdout


@pytest.mark.parametrize(
    ("capacity", "start", "limit", "found"),
    [(100, 8, 4096, 96), (100, 2, 64, 64), (12, 8, 4096, 8), (5, 8, 64, None), (4096, 8, 4096, 4096)],
)
def test_the_micro_batch_search_finds_the_largest_multiple_of_8_that_fits(capacity, start, limit, found):
    largest_micro_batch = load_job("benchmarks/train").largest_micro_batch

    tried = []

    def fits(size: int) -> bool:
        tried.append(size)
        return size <= capacity

    assert largest_micro_batch(fits, start, limit) == found
    assert len(tried) <= 2 + 2 * limit.bit_length()  # doubling, then bisecting: logarithmic


def test_train_refuses_an_unknown_switch_before_building_anything():
    result = benchmark("train", *TINY, "--configs", "compiled+ac")
    assert result.returncode != 0
    assert "unknown switch 'compiled' in --configs 'compiled+ac'" in result.stderr


def test_embed_model_only_compares_with_timm_forward_features(tmp_path):
    result = benchmark(
        "embed", *TINY[:4], "--batch-size", "2", "--iters", "2", "--model-only", "--compare-timm",
        "--json", str(tmp_path / "e.json"), stand_in=tmp_path / "site",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    built = json.loads((tmp_path / "site" / "built.json").read_text())
    assert built[0]["kwargs"]["num_classes"] == 0 and built[0]["kwargs"]["depth"] == 2
    figures = json.loads((tmp_path / "e.json").read_text())
    assert figures["model_only_images_per_s"] > 0 and figures["vitray_over_timm_model_only"] > 0
    assert "model only, timm forward_features" in result.stdout
    assert "vitray / timm (model only)" in result.stdout
    assert "shards of" not in result.stdout  # --model-only writes no shards


def test_train_measures_an_mae_step_with_mae_flops(tmp_path):
    result = benchmark(
        "train", *TINY, "--micro-batch-size", "2", "--configs", "eager", "--warmup", "1", "--iters", "1",
        "--objective", "mae", "--compare-timm", "--json", str(tmp_path / "mae.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    mae = json.loads((tmp_path / "mae.json").read_text())
    assert mae["objective"] == "mae" and mae["mask_ratio"] == 0.75
    assert "timm has no MAE decoder" in result.stdout
    # MFU's numerator: 3 x (the encoder on a quarter of the tokens + MAE's default decoder on all).
    import vit
    from pipeline.data.masking import num_visible

    encoder = vit.get_config("vit_tiny_test", image_size=32, num_classes=4)
    decoder = vit.MAEConfig(decoder_dim=512, decoder_depth=8, decoder_num_heads=16)
    expected = 3 * vit.count_mae_flops(encoder, decoder, num_visible(encoder.num_patches, 0.75))
    assert mae["results"][0]["flops_per_image"] == pytest.approx(expected)
    assert mae["results"][0]["images_per_s"] > 0


def load_benchmark_cli():
    """jobs/benchmark.py itself, for the benchmarks that need neither a stand-in package nor Ray of
    their own: run in this process, which has torch (and transformers) imported already."""
    return load_job("benchmark")


def test_model_compares_with_transformers_at_a_tiny_size(tmp_path, capsys):
    out = tmp_path / "m.json"
    args = [*TINY, "--batch-size", "2", "--warmup", "1", "--iters", "1", "--compare-hf", "--json", str(out)]
    assert load_benchmark_cli().main(["model", *args]) == 0
    figures = json.loads(out.read_text())
    assert [r["impl"] for r in figures["rows"]] == ["vitray", "transformers"]
    assert all(r["images_per_s"] > 0 and r["cpu_ms"] > 0 for r in figures["rows"])
    vitray, hf = figures["rows"]
    assert figures["vitray_over_transformers"] == pytest.approx(vitray["images_per_s"] / hf["images_per_s"])
    assert figures["model"] == "vit_tiny_test" and figures["batch_size"] == 2
    assert "vitray / transformers images/s:" in capsys.readouterr().out


def test_embed_naive_loop_at_a_tiny_size(tmp_path, capsys):
    """`embed --naive-only`: the model alone and the single-process loop over photo shards (the job's half
    starts a Ray of its own; the job itself is tested in tests/embed)."""
    out = tmp_path / "e.json"
    args = [
        *TINY[:4],
        "--images",
        "8",
        "--per-shard",
        "4",
        "--batch-size",
        "4",
        "--repeats",
        "1",
        "--iters",
        "1",
    ]
    assert load_benchmark_cli().main(["embed", *args, "--naive-only", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["images"] == 8 and figures["model_only_images_per_s"] > 0
    assert figures["naive_images_per_s"] > 0 and figures["naive_cpu_ms_per_image"]["driver"] > 0
    printed = capsys.readouterr().out
    assert "2 shards of 4 images" in printed and "naive" in printed and "job steady" not in printed


def test_data_baselines_at_a_tiny_size(tmp_path):
    """`data` without its Ray half (which starts a Ray of its own): the photo shards, the per-core
    ceiling in one process and in parallel, with RandAugment too, and webdataset + DataLoader, reported."""
    result = benchmark(
        "data", "--images", "8", "--per-shard", "4", "--image-size", "32", "--patch-size", "8",
        "--batch-size", "4", "--shuffle-buffer", "4", "--cores", "2", "--repeats", "1",
        "--only", "ceiling,ceiling_randaug,ceiling_parallel,webdataset", "--json", str(tmp_path / "d.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "d.json").read_text())
    for name in ("ceiling", "ceiling_randaug", "ceiling_parallel", "webdataset"):
        assert figures[f"{name}_images_per_s"] > 0 and len(figures[f"{name}_runs"]) == 1, name
    assert figures["ceiling_randaug_vs_ceiling"] > 0 and figures["randaug"] == {"ops": 2, "magnitude": 10}
    assert "ceiling_randaug / ceiling" in result.stdout
    assert figures["bytes_per_sample"]["unmasked"]["patches"] == 16 * 8 * 8 * 3  # 4 x 4 patches of 8 x 8 x 3
    assert "2 shards of 4 photo-like JPEGs" in result.stdout and "bytes per sample" in result.stdout


def test_native_measures_padding_and_the_step_against_square_at_one_budget(tmp_path):
    """`native` without its Ray half: mixed-aspect photo shards, the padding of packed and full-width
    rows of their grids, and the training step on square and native micro-batches of one budget."""
    result = benchmark(
        "native", "--images", "24", "--per-shard", "12", "--image-size", "32", "--patch-size", "8",
        "--model", "vit_tiny_test", "--micro-batch-size", "4", "--steps", "1", "--warmup", "1",
        "--skip", "data", "--json", str(tmp_path / "n.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "n.json").read_text())
    assert figures["budget_patches_per_image"] == 16 and figures["micro_batch_tokens"] == 64
    packing = figures["packing"]
    assert 0 <= packing["packed_padding"] <= packing["full_width_padding"] < 1
    assert all(rows * length <= 64 for rows, length in packing["shapes"])  # never past the budget
    assert figures["step"]["native"]["tokens_per_s"] > 0 and figures["step"]["square"]["steps"] == 1
    assert 0 < figures["square_eval_share_seen"] < 0.77  # 0.875^2 of a square image at most
    assert "native / square" in result.stdout


def test_index_measures_recall_against_a_brute_force_scan(tmp_path):
    out = tmp_path / "index.json"
    args = ["--rows", "3000", "--dim", "16", "--clusters", "10", "--rows-per-file", "1000", "--queries", "30"]
    result = benchmark("index", *args, "--kinds", "flat,hnsw", "--json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    figures = {row["kind"]: row for row in json.loads(out.read_text())["results"]}
    assert figures["flat"]["recall@10"] == 1.0  # exact search agrees with the scan: the scan is right
    assert figures["hnsw"]["recall@10"] > 0.9 and figures["hnsw"]["peak_gib"] > 0


def test_position_times_one_source_against_mixed_sources(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["--steps", "3", "--shards", "40", "--repeats", "1", "--json", str(out)]
    assert load_benchmark_cli().main(["position", *args]) == 0
    figures = json.loads(out.read_text())
    assert [(r["micro_batch"], r["accum"]) for r in figures["rows"]] == [
        (16, 4), (32, 1), (64, 4), (256, 1), (256, 4)
    ]  # fmt: skip
    assert all(r["single_us"] > 0 and r["mixed_us"] > 0 and r["tally_us"] > 0 for r in figures["rows"])
    assert figures["shards"] == 40 and "data position, host time a step" in capsys.readouterr().out
    # One epoch over 40 shards: 12 bytes a shard (base64: 16), and the record's names
    assert 16 * 40 < figures["ledger_epoch_bytes"] < 16 * 40 + 300


def test_train_steps_at_the_jobs_accumulation(tmp_path):
    """`--accum 2`: a step is two micro-batches and one update, as the job's `--batch-size 2 x micro`;
    its images/s counts both (gpu.sh's b16-step against job-b16 at the same batch)."""
    result = benchmark(
        "train", *TINY, "--micro-batch-size", "2", "--accum", "2", "--configs", "eager", "--warmup", "1",
        "--iters", "2", "--json", str(tmp_path / "t.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "t.json").read_text())
    (only,) = figures["results"]
    assert figures["accum"] == 2 and "2 images/device x 2 micro-batches a step" in result.stdout
    assert only["images_per_s"] == pytest.approx(4 / (only["step_ms"] / 1000))


def test_host_windows_count_steps_against_the_ideal_and_the_host_time_outside_the_wait():
    window_rows = load_job("benchmarks/host").window_rows

    # (step, host seconds before its 50 ms wait, when the wait ended): steps 1-4 keep up with 5 ms of
    # host each; step 6 waited 1 s (a stall) outside its wait.
    steps, now = [], 100.0
    for step in range(1, 9):
        host = 1.0 if step == 6 else 0.005
        now += host + 0.05
        steps.append((step, host, now))
    first, second = window_rows(steps, log_every=4, step_ms=50)
    assert second["steps"] == "5-8" and first["steps"] == "1-4"
    assert first["steps/s"] == pytest.approx(4 / 0.22) and first["of ideal"] == pytest.approx(4 / 0.22 / 20)
    assert second["steps/s"] == pytest.approx(4 / (3 * 0.055 + 1.05))
    assert second["host ms max"] == pytest.approx(1000) and second["host ms median"] == pytest.approx(5)
