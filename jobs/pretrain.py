"""Pretrain a Vision Transformer with Ray Train + FSDP2 on WebDataset shards.

    python jobs/pretrain.py --preset tiny --data /tmp/shards --out /tmp/run            # local, CPU
    ray job submit --working-dir . -- python jobs/pretrain.py --preset vit_h14_224 \\
        --data 's3://bucket/train-{000000..002047}.tar' --out s3://bucket/runs/h14  # a GPU cluster

A preset (jobs/presets.py) supplies the whole configuration; flags override it. Submitted as a Ray
job (RAY_ADDRESS set) or given --address, it joins that cluster; otherwise it starts a local Ray.
Running the same command again with the same --out resumes from the latest checkpoint there.
Leaves under --out: checkpoint_<step>/ (DCP), metrics.jsonl, final/weights.safetensors + config.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from jobs.presets import PRESETS
from pipeline.train_config import TrainConfig, apply_local_ray_env

# (flag, TrainConfig field, type, help). A flag left out keeps the preset's value.
FLAGS: list[tuple[str, str, type, str]] = [
    (
        "--data",
        "data",
        str,
        "shard URL(s): path, directory, glob, brace range, s3://, gs://; comma-separated",
    ),
    ("--out", "out", str, "run directory (local path, s3:// or gs://); rerun with the same --out to resume"),
    ("--model", "model", str, "model variant, e.g. vit_b16, vit_h14 (see vit.VARIANTS)"),
    ("--image-size", "image_size", int, "training resolution in pixels (a multiple of the patch size)"),
    ("--num-classes", "num_classes", int, "number of label classes of the head"),
    ("--num-workers", "num_workers", int, "training workers (one GPU each unless --cpu)"),
    (
        "--cpus-per-worker",
        "cpus_per_worker",
        float,
        "CPUs reserved per training worker; the rest decode data",
    ),
    (
        "--placement-strategy",
        "placement_strategy",
        str,
        "workers over nodes: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD",
    ),
    ("--max-steps", "max_steps", int, "optimizer steps of the schedule"),
    (
        "--stop-at-step",
        "stop_at_step",
        int,
        "end this run at that step (schedule unchanged); rerun to continue",
    ),
    ("--batch-size", "batch_size", int, "global batch: images per optimizer step across all workers"),
    (
        "--micro-batch-size",
        "micro_batch_size",
        int,
        "images per worker per forward/backward (accumulation covers the rest)",
    ),
    ("--lr", "lr", float, "peak learning rate"),
    ("--min-lr", "min_lr", float, "learning rate at the end of the decay"),
    (
        "--weight-decay",
        "weight_decay",
        float,
        "AdamW weight decay (not on biases, norms, pos/CLS embeddings)",
    ),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps"),
    ("--lr-schedule", "lr_schedule", str, "decay after warmup: cosine or linear"),
    ("--grad-clip", "grad_clip", float, "global gradient-norm clipping threshold"),
    ("--seed", "seed", int, "seed of initialization, shard order, crops and shuffling"),
    ("--label-key", "label_key", str, "where labels are: a member extension (cls) or json:<field>"),
    ("--shuffle-buffer", "shuffle_buffer", int, "samples in each worker's local shuffle buffer"),
    ("--max-bad-fraction", "max_bad_fraction", float, "share of corrupt samples that fails the run"),
    ("--log-every", "log_every", int, "steps between log lines / metrics.jsonl rows"),
    ("--checkpoint-every", "checkpoint_every", int, "steps between checkpoints"),
    ("--keep-checkpoints", "keep_checkpoints", int, "checkpoints kept (oldest deleted first)"),
    (
        "--max-failures",
        "max_failures",
        int,
        "worker-group restarts from the latest checkpoint after a failure",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobs/pretrain.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="base configuration (default: tiny)"
    )
    for flag, field, kind, text in FLAGS:
        parser.add_argument(flag, dest=field, type=kind, default=None, help=text)
    parser.add_argument(
        "--cpu", action="store_true", help="train on CPU workers (gloo) even where GPUs exist"
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", default=None, help="recompute blocks in backward"
    )
    parser.add_argument("--compile", action="store_true", default=None, help="torch.compile each block")
    parser.add_argument(
        "--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)"
    )
    parser.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="logical CPUs of a local Ray (default: enough for workers + data)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )
    return parser


def resolve(args: argparse.Namespace) -> TrainConfig:
    config = PRESETS[args.preset]()
    overrides = {field: getattr(args, field) for _, field, _, _ in FLAGS if getattr(args, field) is not None}
    for field in ("activation_checkpointing", "compile"):
        if getattr(args, field):
            overrides[field] = True
    if args.cpu:
        overrides["use_gpu"] = False
    return config.replace(**overrides)


def check(config: TrainConfig) -> list[str]:
    """Every check that needs no cluster; returns the expanded shard list. Raises ValueError."""
    from pipeline.data import check_shards
    from pipeline.shards import expand_shards
    from pipeline.train_config import data_config
    from pipeline.train_step import model_config

    config.validate()
    mcfg = model_config(config)  # unknown model, image size not divisible by the patch size ...
    shards = expand_shards(config.data)
    check_shards(shards, data_config(config, mcfg.patch_size))  # the first shard has images and labels
    if len(shards) < config.num_workers:
        raise ValueError(
            f"{len(shards)} shard(s) for {config.num_workers} workers: every worker needs at least one; "
            "write more, smaller shards (jobs/make_shards.py --samples-per-shard) or use fewer --num-workers"
        )
    return shards


def connect(args: argparse.Namespace, config: TrainConfig) -> None:
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    # A local Ray: declare enough logical CPUs that the training workers leave room for decoding.
    apply_local_ray_env()
    needed = math.ceil(config.num_workers * config.cpus_per_worker) + 2 * config.num_workers
    ray.init(
        address="local", num_cpus=args.num_cpus or max(os.cpu_count() or 1, needed), include_dashboard=False
    )
    if config.use_gpu and ray.cluster_resources().get("GPU", 0) < config.num_workers:
        raise ValueError(
            f"the local Ray has {ray.cluster_resources().get('GPU', 0):.0f} GPUs for {config.num_workers} "
            "GPU workers; pass --cpu, fewer --num-workers, or submit to a GPU cluster"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = resolve(args)
        if args.print_config:
            print(config.to_json())
            return 0
        shards = check(config)
        connect(args, config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from pipeline.trainer import TrainingError, fit

    try:
        summary = fit(config, shards)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    metrics, bad = summary["metrics"], summary["bad_samples"]
    reasons = ", ".join(f"{n} {reason}" for reason, n in bad["by_reason"].items()) or "none"
    print(
        f"\nfinished at step {metrics['step']}: loss {metrics['loss']:.4f}, "
        f"accuracy {100 * metrics['accuracy']:.1f}%\n"
        f"samples read: {bad['total']}, skipped as bad: {bad['bad']} ({reasons})\n"
        f"run directory: {config.out} (checkpoints, metrics.jsonl, final/)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
