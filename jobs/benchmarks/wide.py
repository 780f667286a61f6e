"""What native-aspect batches learn where a square crop cuts the object: Fashion-MNIST's clothes pasted
into wide canvases, square against native at one token budget and the same steps.

    python -m jobs.benchmarks.wide --fashion-mnist /tmp/fmnist.npz --out /tmp/wide [--steps 200] [--json PATH]

The task: each 28 x 28 photo of Fashion-MNIST (`jobs.benchmarks.fashion_mnist`) pasted at a random place
on a canvas 32 px high and 48, 64, 96 or 128 px wide (aspect ratios 1.5 to 4), on a dark grey background
with a little noise; the label is the photo's class. A square crop of such a canvas shows a piece of it:
the evaluation crop (the center 0.875 of the short side) 28 of its 48 to 128 columns, a training crop at
most a 4:3 box of it; an object pasted near an end is cut or missed. A native row takes the whole canvas
at its own aspect ratio.

Both runs are `jobs/pretrain.py --preset small` (`vit_mini4`, 4 px patches, 2 CPU workers) at 32 px, the
same ``--steps``, batch and seed: ``--patches square`` (every image 8 x 8 = 64 patches) against
``--patches native`` at the same budget (``--max-patches 64``, so a canvas of 3:1 is 4 x 13 patches; a
micro-batch holds 64 x 64 patch tokens in both runs, so the native run's steps hold more, shorter
images). Each is scored on the same test canvases by its own classifier (`--eval-data`, at the end) and
by a linear probe of its embeddings (`jobs/embed.py`, each its own mode, then `jobs/evaluate.py`, fitted
on ``--probe-train`` training canvases).
"""

from __future__ import annotations

import argparse
import io
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from jobs.benchmarks import fashion_mnist
from jobs.benchmarks.learning import evaluate, final_eval_accuracy, job
from jobs.benchmarks.report import print_table, write_json

HEIGHT = 32
WIDTHS = (48, 64, 96, 128)
BACKGROUND = 40  # dark grey: Fashion-MNIST's own background is black, so the canvas's edge stays visible


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.benchmarks.wide", description=__doc__.split("\n\n")[0])
    p.add_argument("--fashion-mnist", required=True, help="the unpacked npm package, or its .npz")
    p.add_argument("--out", required=True, help="working directory: shards, runs, embeddings")
    p.add_argument("--train-images", type=int, default=20000, help="training canvases (default: %(default)s)")
    p.add_argument("--test-images", type=int, default=5000, help="test canvases (default: %(default)s)")
    p.add_argument(
        "--probe-train", type=int, default=5000, help="canvases the probes fit on (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=200, help="--max-steps of both runs (default: %(default)s)")
    p.add_argument("--pretrain-args", default="", help="more flags for both runs, as one string")
    p.add_argument("--json", help="write the figures as JSON")
    return p.parse_args(argv)


def canvas(photo: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A 28 x 28 photo pasted at a random place of a wide canvas -> uint8 ``(32, W)``."""
    width = int(rng.choice(WIDTHS))
    noise = rng.integers(-8, 9, size=(HEIGHT, width))
    out = np.clip(BACKGROUND + noise, 0, 255).astype(np.uint8)
    top, left = rng.integers(0, HEIGHT - 28 + 1), rng.integers(0, width - 28 + 1)
    out[top : top + 28, left : left + 28] = np.maximum(out[top : top + 28, left : left + 28], photo)
    return out


def write_canvases(images: np.ndarray, labels: np.ndarray, indices: np.ndarray, out: Path, seed: int) -> None:
    """The canvases of ``images[indices]`` as PNG shards of 1,000 under ``out`` (the same bytes every time)."""
    from pipeline.data.writing import write_shards

    rng = np.random.default_rng(seed)

    def samples():
        for index in indices:
            png = io.BytesIO()
            Image.fromarray(canvas(images[index], rng), mode="L").save(png, format="PNG")
            yield f"{index:05d}", {"png": png.getvalue(), "cls": str(int(labels[index])).encode()}

    write_shards(samples(), out, prefix=out.name, samples_per_shard=1000)


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    images, labels = fashion_mnist.load_images(args.fashion_mnist)
    train, test = fashion_mnist.split(labels)
    train, test = train[: args.train_images], test[: args.test_images]
    shards = {
        "train": out / "shards" / "train",
        "probe": out / "shards" / "probe",
        "test": out / "shards" / "test",
    }
    for (name, indices), seed in zip(
        (("train", train), ("probe", train[: args.probe_train]), ("test", test)), (0, 0, 1), strict=True
    ):
        if not shards[name].is_dir():
            write_canvases(images, labels, indices, shards[name], seed)

    rows: list[dict[str, Any]] = []
    for mode in ("square", "native"):
        run = out / mode
        seconds = job(
            "pretrain.py", "--preset", "small", "--data", str(shards["train"]), "--out", str(run),
            "--max-steps", str(args.steps), "--eval-data", str(shards["test"]), "--patches", mode,
            *shlex.split(args.pretrain_args),
        )  # fmt: skip
        accuracy = final_eval_accuracy(run)
        for split in ("probe", "test"):
            job(
                "embed.py", "--weights", str(run / "final"), "--data", str(shards[split]),
                "--out", str(out / f"{mode}-emb-{split}"),
            )  # fmt: skip
        scores = evaluate(out / f"{mode}-emb-probe", out / f"{mode}-emb-test", out / f"{mode}-eval.json")
        rows.append(
            {
                "patches": mode,
                "classifier %": 100 * accuracy,
                "linear probe %": 100 * scores["linear_probe"]["accuracy"],
                "k-NN %": 100 * scores["knn"]["accuracy"],
                "pretraining s": seconds,
            }
        )
        print(
            f"{mode}: classifier {accuracy:.1%}, linear probe {scores['linear_probe']['accuracy']:.1%}",
            flush=True,
        )
    print_table(
        f"Fashion-MNIST in wide canvases ({HEIGHT} x {'/'.join(map(str, WIDTHS))} px): {len(test):,} test "
        f"canvases, {args.steps} steps of the small preset each",
        rows,
    )
    result = {"rows": rows, "train_images": len(train), "probe_train": args.probe_train, "steps": args.steps}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
