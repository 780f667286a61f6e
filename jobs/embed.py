"""Embed images with a trained (or converted) ViT: one Parquet file of embeddings per input shard.

    python jobs/embed.py --data /tmp/shards --weights /tmp/run --out /tmp/emb                 # local, CPU
    ray job submit --working-dir . -- python jobs/embed.py --data 's3://bucket/val-{000000..000063}.tar' \\
        --weights s3://bucket/runs/h14/final --out s3://bucket/emb/h14 --concurrency 8 --gpu   # 8 GPUs

--weights takes a training run's final/ directory or the run directory itself (its final/, else its
latest complete checkpoint), a checkpoint_* directory, a transformers model directory, or a timm /
torchvision / transformers weights file (.safetensors, .pth, .bin; --weights-format names the source
when the keys do not tell it). Submitted as a Ray job (RAY_ADDRESS set) or given --address, it joins
that cluster; otherwise it starts a local Ray. --gpu gives each actor a GPU (an autoscaling cluster
brings GPU nodes for them), --cpu keeps the model on CPU; without either, actors use GPUs where the
machine or cluster has some at the start. Device and precision are part of the output's identity.
Running the same command again skips the shards already committed.

Leaves under --out: <shard>-<8 hex>.parquet per input shard (key, url, embedding
fixed_size_list<float32>[D], label), _identity.json (the output's model, weights and preprocessing,
claimed before the first commit: a run of another configuration into the same --out fails in one line)
and _manifest.json (model, weights sha256, preprocessing, D, per shard its file, rows and skipped samples).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.data.config import INTERPOLATIONS
from pipeline.embed.config import EMBEDDINGS, EmbedConfig
from pipeline.weights import FORMATS

FLAGS = [
    cli.Flag(
        "data",
        "shard URL(s): path, directory, glob, brace range, s3://, gs://; comma-separated",
        required=True,
    ),
    cli.Flag("weights", "run dir, final/ export, checkpoint_* dir, HF dir or weights file", required=True),
    cli.Flag("out", "output directory (local path, s3:// or gs://)", required=True),
    cli.Flag(
        "weights_format",
        "what --weights holds (default: auto, told from the files and their keys)",
        choices=FORMATS,
    ),
    cli.Flag(
        "model",
        "variant name (e.g. vit_b16): checked against the weights; needed where shapes can't tell heads",
    ),
    cli.Flag(
        "embedding",
        "cls: [CLS] token after the final LayerNorm (default); pre_logits: the pretraining head's hidden layer",
        choices=EMBEDDINGS,
    ),
    cli.Flag("image_size", "input resolution (default: the model's; others resample pos_embed)"),
    cli.Flag("batch_size", "images per forward pass (default: 64 on CPU, 256 per GPU)"),
    cli.Flag("concurrency", "model actors, one GPU each on GPU"),
    cli.Flag(
        "cpus_per_actor",
        "CPUs per model actor, its torch threads on CPU (default: 1 with GPUs or a cluster; "
        "this machine's cores / --concurrency on a local CPU run)",
    ),
    cli.Flag("overwrite", "redo every shard, replacing what --out holds"),
    cli.Flag(
        "label_key",
        "label member (cls) or json:<field>; none for unlabeled shards (default: the training run's, else cls)",
        type=cli.optional_str,
    ),
    cli.Flag("crop_fraction", "center-crop share of the short side (default: 0.875 or the run's)"),
    cli.Flag(
        "interpolation", "resize filter (default: bicubic or the training run's)", choices=INTERPOLATIONS
    ),
    cli.Flag("max_bad_fraction", "share of corrupt samples that fails the job"),
    cli.Flag(
        "storage_options",
        'fsspec options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\' '
        "(credentials: prefer the environment)",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobs/embed.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_flags(parser, EmbedConfig, FLAGS, defaults=EmbedConfig(data="", weights="", out=""))
    parser.add_argument(
        "--cpu", action="store_true", help="run the model on CPU even where the cluster has GPUs"
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="one GPU per model actor, bf16, asked of the cluster (an autoscaler brings GPU nodes)",
    )
    cli.add_ray_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from pipeline.embed import job, progress

        config = EmbedConfig(**cli.overrides(args, FLAGS))
        local = cli.ray_address(args) is None
        chosen = job.choose_device(config, gpu=args.gpu, cpu=args.cpu, local=local)
        if args.print_config:
            cli.print_config(chosen or config)
            return 0
        connected = chosen is None
        if connected:  # a joined cluster, neither --gpu nor --cpu: what it has now decides
            cli.connect_ray(args, needed_cpus=0)
            chosen = job.gpus_from_cluster(config)
        plan = job.prepare(chosen)
        print(plan.describe(), flush=True)
        if plan.work.pending:
            if local:
                plan.config = job.local_actor_cpus(
                    plan.config, given=args.cpus_per_actor is not None, num_cpus=args.num_cpus
                )
            if not connected:
                cli.connect_ray(args, needed_cpus=job.local_cpus_needed(plan.config))
            job.describe_actors(plan.config)
        summary = job.run(plan, on_commit=progress.EmbedProgress(len(plan.work.pending)).on_commit)
        print("\n" + summary.format())
        return cli.EXIT_RUN_FAILED if summary.failed else 0

    from pipeline.data.bad_samples import BadSampleBudgetError, LabelsMissingError
    from pipeline.embed.identity import OutputClaimedError

    return cli.run_job(body, failures=(BadSampleBudgetError, LabelsMissingError, OutputClaimedError))


if __name__ == "__main__":
    sys.exit(main())
