"""Pretrain a Vision Transformer with Ray Train + FSDP2 on WebDataset shards.

    python jobs/pretrain.py --preset tiny --data /tmp/shards --out /tmp/run            # local, CPU
    ray job submit --working-dir . -- python jobs/pretrain.py --preset vit_h14_224 \\
        --data 's3://bucket/train-{000000..002047}.tar' --out s3://bucket/runs/h14  # a GPU cluster

A preset (pipeline/train/presets.py) supplies the whole configuration; flags override it. Submitted as
a Ray job (RAY_ADDRESS set) or given --address, it joins that cluster; otherwise it starts a local Ray.
Running the same command again with the same --out resumes from the latest checkpoint there.
Leaves under --out: checkpoint_<step>/ (DCP), metrics.jsonl, final/weights.safetensors + config.json.
With --objective mae (masked autoencoding, shards need no labels) final/ holds the encoder alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.train.config import TrainConfig
from pipeline.train.presets import PRESETS

FLAGS = [
    cli.Flag("data", "shard URL(s): path, directory, glob, brace range, s3://, gs://; comma-separated"),
    cli.Flag("out", "run directory (local path, s3:// or gs://); rerun with the same --out to resume"),
    cli.Flag("model", "model variant, e.g. vit_b16, vit_h14 (see vit.VARIANTS)"),
    cli.Flag("image_size", "training resolution in pixels (a multiple of the patch size)"),
    cli.Flag("num_classes", "number of label classes of the head"),
    cli.Flag("num_workers", "training workers (one GPU each unless --cpu)"),
    cli.Flag("cpus_per_worker", "CPUs reserved per training worker; the rest decode data"),
    cli.Flag("placement_strategy", "workers over nodes: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    cli.Flag(
        "data_cpus_per_worker",
        "decode CPUs of each worker's data pipeline (default: the cluster's spare CPUs, re-read each epoch)",
    ),
    cli.Flag(
        "shard_group_size",
        "workers per FSDP shard group; groups replicate each other (HSDP) (default: the workers of a node)",
    ),
    cli.Flag("shared_out", "a local --out is one filesystem mounted at the same path on every node"),
    cli.Flag("max_steps", "optimizer steps of the schedule"),
    cli.Flag("stop_at_step", "end this run at that step (schedule unchanged); rerun to continue"),
    cli.Flag("batch_size", "global batch: images per optimizer step across all workers"),
    cli.Flag("micro_batch_size", "images per worker per forward/backward (accumulation covers the rest)"),
    cli.Flag("lr", "peak learning rate"),
    cli.Flag("min_lr", "learning rate at the end of the decay"),
    cli.Flag("weight_decay", "AdamW weight decay (not on biases, norms, pos/CLS embeddings)"),
    cli.Flag("warmup_steps", "linear warmup steps"),
    cli.Flag("lr_schedule", "decay after warmup: cosine or linear"),
    cli.Flag("grad_clip", "global gradient-norm clipping threshold"),
    cli.Flag(
        "max_skipped_steps", "steps in a row skipped for a non-finite loss or gradient that fail the run"
    ),
    cli.Flag("seed", "seed of initialization, shard order, crops and shuffling"),
    cli.Flag(
        "label_key",
        "where labels are: a member extension (cls), json:<field>, or none (unlabeled, --objective mae)",
        type=cli.optional_str,
    ),
    cli.Flag(
        "objective",
        "supervised (labels, classifier) or mae (masked autoencoding, no labels)",
        choices=("supervised", "mae"),
    ),
    cli.Flag("mask_ratio", "MAE: share of each image's patches hidden from the encoder"),
    cli.Flag("norm_pix_loss", "MAE: reconstruct raw pixels, not each patch standardized", negate=True),
    cli.Flag("decoder_dim", "MAE: width of the decoder's tokens"),
    cli.Flag("decoder_depth", "MAE: decoder blocks"),
    cli.Flag("decoder_num_heads", "MAE: decoder attention heads (must divide the decoder's width)"),
    cli.Flag("shuffle_buffer", "samples in each worker's local shuffle buffer"),
    cli.Flag("crop_scale", "random-resized-crop area share MIN,MAX, e.g. 0.08,1", metavar="MIN,MAX"),
    cli.Flag("crop_ratio", "random-resized-crop aspect (w/h) MIN,MAX, e.g. 0.75,1.33", metavar="MIN,MAX"),
    cli.Flag("hflip", "no random horizontal flips (on by default)", negate=True),
    cli.Flag("max_bad_fraction", "share of corrupt samples that fails the run"),
    cli.Flag("log_every", "steps between log lines / metrics.jsonl rows"),
    cli.Flag("tensorboard", "also write TensorBoard event files under <out>/tensorboard/"),
    cli.Flag(
        "wandb",
        "also log to this Weights & Biases project (WANDB_MODE=offline: no network)",
        metavar="PROJECT",
    ),
    cli.Flag("checkpoint_every", "steps between checkpoints"),
    cli.Flag("keep_checkpoints", "checkpoints kept (oldest deleted first)"),
    cli.Flag("max_failures", "worker-group restarts from the latest checkpoint after a failure"),
    cli.Flag("activation_checkpointing", "recompute blocks in backward"),
    cli.Flag("ac_mode", "with --activation-checkpointing: full, alternate (every other block) or ops"),
    cli.Flag("compile", "torch.compile the model (see --compile-scope)"),
    cli.Flag("compile_scope", "with --compile: blocks (one graph per block) or model (the whole forward)"),
    cli.Flag("optimizer_impl", "AdamW kernels: auto (fused on CUDA, else foreach), fused, foreach, for-loop"),
    cli.Flag("fp8", "float8 training of the blocks' Linear layers (torchao; H100 or newer; with --compile)"),
]


def training_parser(
    prog: str, description: str, flags: list[cli.Flag], default_preset: str
) -> argparse.ArgumentParser:
    """The command line of a training job (pretraining, fine-tuning): a preset, its flags, --cpu, Ray's."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset",
        default=default_preset,
        choices=sorted(PRESETS),
        help=f"base configuration (default: {default_preset})",
    )
    cli.add_flags(parser, TrainConfig, flags)
    parser.add_argument(
        "--cpu", action="store_true", help="train on CPU workers (gloo) even where GPUs exist"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out that holds files no training run wrote (they may be replaced)",
    )
    cli.add_ray_flags(parser)
    return parser


def resolve_training(args: argparse.Namespace, flags: list[cli.Flag], **fixed: object) -> TrainConfig:
    """The preset, with the fields ``fixed`` sets and then the flags given; --cpu last."""
    config = PRESETS[args.preset]().replace(**fixed, **cli.overrides(args, flags))
    return config.replace(use_gpu=False) if args.cpu else config


def build_parser() -> argparse.ArgumentParser:
    return training_parser("jobs/pretrain.py", __doc__, FLAGS, "tiny")


def resolve(args: argparse.Namespace) -> TrainConfig:
    return resolve_training(args, FLAGS)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        config = resolve(args)
        if args.print_config:
            cli.print_config(config)
            return 0
        from pipeline.train import driver

        shards = driver.prepare(config, overwrite=args.overwrite)
        local = cli.connect_ray(args, needed_cpus=driver.local_cpus_needed(config))
        driver.check_cluster(config, local_ray=local)
        cli.start_work()
        summary = driver.fit(config, shards)
        print(driver.format_summary(summary, config))
        return 0

    from pipeline.train.driver import TrainingError

    return cli.run_job(body, failures=(TrainingError,))


if __name__ == "__main__":
    sys.exit(main())
