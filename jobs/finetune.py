"""Fine-tune a pretrained ViT on labeled shards, with Ray Train + FSDP2, and evaluate it on held-out ones.

    python jobs/finetune.py --weights /tmp/run --data /tmp/shards --eval-data /tmp/shards-val \\
        --out /tmp/ft --image-size 48 --num-classes 10 --cpu --num-workers 2 --batch-size 64 \\
        --micro-batch-size 32 --max-steps 60 --warmup-steps 6 --lr 0.03             # local, CPU
    ray job submit --working-dir . -- python jobs/finetune.py --weights s3://bucket/runs/b16 \\
        --data 's3://bucket/task/train-{000..063}.tar' --eval-data 's3://bucket/task/val-{000..007}.tar' \\
        --num-classes 100 --out s3://bucket/runs/b16-ft                              # a GPU cluster

--weights takes a pretraining export (final/), a run directory or a checkpoint_* directory (supervised
or MAE), or timm / torchvision / transformers weights: the model, its patch size and input
normalization are the weights' own. The pretraining head is dropped and a zero-initialized linear head
of --num-classes takes its place; at another --image-size the position embeddings are resampled in 2D
(the [CLS] one kept). The default recipe is the paper's (preset `finetune`): SGD with momentum 0.9, no
weight decay, cosine decay, global-norm clipping at 1. --eval-data is evaluated (resize + center crop)
every --eval-every steps and at the end; the final accuracy is printed. Rerun with the same --out to
resume. Leaves under --out: checkpoint_<step>/, metrics.jsonl (with eval_accuracy),
final/weights.safetensors + config.json (head: finetune, the new image size), which jobs/embed.py and
jobs/analyze.py take.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from jobs.pretrain import FLAGS as PRETRAIN_FLAGS
from jobs.pretrain import resolve_training, training_parser
from pipeline import cli
from pipeline.train.config import TrainConfig

# Pretraining's flags that mean the same here; the model and the objective come from --weights.
SHARED = {flag.field: flag for flag in PRETRAIN_FLAGS}
FLAGS = [
    cli.Flag(
        "weights", "pretrained weights: export (final/), run dir, checkpoint_* dir or weights file", required=True
    ),
    SHARED["data"],
    cli.Flag("eval_data", "held-out shards evaluated every --eval-every steps and at the end (labeled)"),
    SHARED["out"],
    cli.Flag("image_size", "fine-tuning resolution (position embeddings are resampled to it)"),
    cli.Flag("num_classes", "classes of the new, zero-initialized head"),
    cli.Flag("eval_every", "steps between evaluations of --eval-data (0: only at the end)"),
    cli.Flag("optimizer", "sgd (with momentum; the paper's) or adamw", choices=("sgd", "adamw")),
    cli.Flag("momentum", "SGD momentum"),
    *(
        SHARED[name]
        for name in (
            "num_workers", "cpus_per_worker", "placement_strategy", "data_cpus_per_worker", "shard_group_size",
            "shared_out", "max_steps", "stop_at_step", "batch_size", "micro_batch_size", "lr", "min_lr",
            "weight_decay", "warmup_steps", "lr_schedule", "grad_clip", "max_skipped_steps", "seed", "label_key",
            "shuffle_buffer", "crop_scale", "crop_ratio", "hflip", "max_bad_fraction", "log_every", "tensorboard",
            "wandb", "checkpoint_every", "keep_checkpoints", "max_failures", "activation_checkpointing", "compile",
        )
    ),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    return training_parser("jobs/finetune.py", __doc__, FLAGS, "finetune")


def resolve(args: argparse.Namespace) -> TrainConfig:
    return resolve_training(args, FLAGS, objective="supervised")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        config = resolve(args)
        if args.print_config:
            cli.print_config(config)
            return 0
        from pipeline.train import driver, finetune

        config = finetune.resolve_pretrained(config)  # the weights' model, a new head: one line if wrong
        shards = driver.prepare(config, overwrite=args.overwrite)
        eval_shards = driver.prepare_eval(config)
        local = cli.connect_ray(args, needed_cpus=driver.local_cpus_needed(config))
        driver.check_cluster(config, local_ray=local)
        cli.start_work()
        summary = driver.fit(config, shards, eval_shards)
        print(driver.format_summary(summary, config))
        return 0

    from pipeline.train.driver import TrainingError

    return cli.run_job(body, failures=(TrainingError,))


if __name__ == "__main__":
    sys.exit(main())
