"""The quickstart demo (`make demo`): the whole pipeline, locally on CPU, on generated data.

Writes a small synthetic shard set, pretrains the `tiny` preset with 2 FSDP2 workers on a local
Ray (each checkpoint probed beside training: a linear probe and k-NN on held-out images), extracts CLS
embeddings to Parquet, fine-tunes the result at a higher resolution (48 px, a new
head) against a held-out set, draws what the model learned (the paper's Fig. 7), plots the training
curve, and prints where everything is.
Each stage runs the command a user would type, so what works here works on a cluster with other
flags (printed at the end).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a plain checkout too

CLUSTER_COMMANDS = """\
The same on a GPU cluster (README, "Run on a cluster"):
  ray get-auth-token --generate && ray up cluster/aws.yaml && ray dashboard cluster/aws.yaml
  export RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265
  ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml -- \\
      python jobs/pretrain.py --preset vit_h14_224 --data 's3://BUCKET/train-{000000..002047}.tar' \\
      --out s3://BUCKET/runs/h14 --num-workers 16
  ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml -- \\
      python jobs/embed.py --data 's3://BUCKET/val-{000000..000063}.tar' --weights s3://BUCKET/runs/h14/final \\
      --out s3://BUCKET/embeddings/h14 --concurrency 16 --gpu
  ray down cluster/aws.yaml"""


def stage(title: str, script: str, *args: str) -> float:
    """Run `python jobs/<script> <args>` as a user would, stopping the demo if it fails; its seconds.
    Without a title, it continues the stage before (its command shown, not a new header)."""
    if title:
        print(f"\n=== {title}")
    print(f"$ python jobs/{script} {' '.join(args)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / script), *args], cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"demo stopped: jobs/{script} exited with {result.returncode}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="demo-output", help="where the demo writes everything (default: %(default)s)"
    )
    parser.add_argument(
        "--samples", type=int, default=512, help="synthetic images to generate (default: %(default)s)"
    )
    args = parser.parse_args()

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time: no resuming an older demo
    shards, run, embeddings = out / "shards", out / "run", out / "embeddings"
    held_out, finetuned, analysis = out / "held-out", out / "finetuned", out / "analysis"
    start = time.perf_counter()
    seconds = [
        stage("1/5 synthetic shards", "make_shards.py", "--synthetic", str(args.samples), "--out", str(shards))
        + stage("", "make_shards.py", "--synthetic", "128", "--seed", "1", "--out", str(held_out)),
        # A log line every 60 of the 240 steps: the demo's whole console fits on about one screen. Each
        # checkpoint (120, 240) probed off the workers: fit on the shards, scored on the held-out images.
        stage("2/5 pretrain the tiny preset (2 FSDP2 workers, local Ray), its checkpoints probed", "pretrain.py",
              "--preset", "tiny", "--data", str(shards), "--out", str(run), "--log-every", "60",
              "--probe-data", str(shards), "--probe-eval-data", str(held_out)),
        stage("3/5 extract CLS embeddings", "embed.py", "--data", str(shards), "--weights", str(run / "final"),
              "--out", str(embeddings)),
        # Images the model never saw (another seed), fine-tuned on at 48 px: 6x6 patches after 4x4.
        stage("4/5 fine-tune at 48 px (new head, SGD), evaluated on held-out images", "finetune.py",
              "--weights", str(run), "--data", str(shards), "--eval-data", str(held_out), "--out", str(finetuned),
              "--image-size", "48", "--num-classes", "10", "--cpu", "--num-workers", "2", "--batch-size", "64",
              "--micro-batch-size", "32", "--max-steps", "30", "--warmup-steps", "3", "--lr", "0.01",
              "--log-every", "30", "--checkpoint-every", "30"),
        stage("5/5 what the model learned (the paper's Fig. 7)", "analyze.py", "--weights", str(run / "final"),
              "--data", str(held_out), "--out", str(analysis), "--images", "16", "--cpu"),
    ]  # fmt: skip

    import pyarrow.parquet as pq

    from pipeline.train.driver import read_metrics
    from pipeline.train.observe.metrics import plot_training_curve

    rows = read_metrics(str(run))
    tuned = [r for r in read_metrics(str(finetuned)) if r.get("eval_accuracy") is not None][-1]
    curve = plot_training_curve(rows, str(run / "training_curve.png"))
    table = pq.read_table(embeddings)
    dim = table.schema.field("embedding").type.list_size
    first, last = rows[0], rows[-1]
    stages = ", ".join(
        f"{name} {s:.0f} s"
        for name, s in zip(
            ("shards", "pretraining", "embeddings", "fine-tuning", "analysis"), seconds, strict=True
        )
    )
    print(f"\n=== vitray demo finished in {time.perf_counter() - start:.0f} s ({stages})")
    print(f"training:   loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}), "
          f"accuracy {100 * first['accuracy']:.0f}% -> {100 * last['accuracy']:.0f}%")  # fmt: skip
    probed = [r for r in rows if r.get("probe_accuracy") is not None]
    print("probe:      " + " -> ".join(
        f"step {r['step']}: linear probe {100 * r['probe_accuracy']:.0f}%, k-NN {100 * r['knn_accuracy']:.0f}%"
        for r in probed
    ) + f" (fit on {shards.name}/, scored on {held_out.name}/)")  # fmt: skip
    print(f"curve:      {curve}  (loss, and the probe beside it)")
    print(f"fine-tuned: {finetuned / 'final'}  (48 px, eval accuracy {100 * tuned['eval_accuracy']:.0f}% "
          f"on {held_out.name}/ at step {tuned['step']})")  # fmt: skip
    print(f"figures:    {', '.join(str(p) for p in sorted(analysis.glob('*.png')))}")
    print(f"weights:    {run / 'final'}")
    print(f"embeddings: {embeddings}  ({table.num_rows} rows of {args.samples} images, D = {dim})")
    print(f"read them:  python -c \"import pandas; print(pandas.read_parquet('{embeddings}').head())\"")
    if table.num_rows != args.samples:
        sys.exit(
            f"demo: {table.num_rows} embedding rows for {args.samples} images; see {embeddings}/_manifest.json"
        )
    print("\n" + CLUSTER_COMMANDS)


if __name__ == "__main__":
    main()
