"""Embed images with a trained (or converted) ViT: one Parquet file of embeddings per input shard.

    python jobs/embed.py --data /tmp/shards --weights /tmp/run --out /tmp/emb                 # local, CPU
    ray job submit --working-dir . -- python jobs/embed.py --data 's3://bucket/val-{000000..000063}.tar' \\
        --weights s3://bucket/runs/h14/final --out s3://bucket/emb/h14 --concurrency 8         # 8 GPUs

--weights takes a training run's final/ directory or the run directory itself (its final/, else its
latest complete checkpoint), a checkpoint_* directory, a transformers model directory, or a timm /
torchvision / transformers weights file (.safetensors, .pth, .bin; --weights-format names the source
when the keys do not tell it). Submitted as a Ray job (RAY_ADDRESS set) or given --address, it joins
that cluster; otherwise it starts a local Ray. Actors use one GPU each where the cluster has GPUs
(--cpu to stay on CPU). Running the same command again skips the shards already committed.

Leaves under --out: <shard>.parquet per input shard (key, url, embedding fixed_size_list<float32>[D],
label) and _manifest.json (model, weights sha256, preprocessing, D, per shard rows and skipped samples).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline.embed import EMBEDDINGS, EmbedConfig
from pipeline.model_source import FORMATS
from pipeline.preprocess import RESAMPLE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jobs/embed.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--data",
        required=True,
        help="shard URL(s): path, directory, glob, brace range, s3://, gs://; comma-separated",
    )
    p.add_argument(
        "--weights", required=True, help="run dir, final/ export, checkpoint_* dir, HF dir or weights file"
    )
    p.add_argument("--out", required=True, help="output directory (local path, s3:// or gs://)")
    p.add_argument(
        "--weights-format",
        choices=FORMATS,
        default="auto",
        help="what --weights holds (default: auto, told from the files and their keys)",
    )
    p.add_argument(
        "--model",
        help="variant name (e.g. vit_b16): checked against the weights; needed where shapes can't tell heads",
    )
    p.add_argument(
        "--embedding",
        choices=EMBEDDINGS,
        default="cls",
        help="cls: [CLS] token after the final LayerNorm (default); pre_logits: the pretraining head's hidden layer",
    )
    p.add_argument(
        "--image-size", type=int, help="input resolution (default: the model's; others resample pos_embed)"
    )
    p.add_argument(
        "--batch-size", type=int, default=64, help="images per forward pass (default: %(default)s)"
    )
    p.add_argument(
        "--concurrency", type=int, default=1, help="model actors, one GPU each on GPU (default: %(default)s)"
    )
    p.add_argument(
        "--cpus-per-actor",
        type=float,
        help="CPUs per model actor, its torch threads on CPU (default: 1 with GPUs or a cluster; "
        "this machine's cores / --concurrency on a local CPU run)",
    )
    p.add_argument("--cpu", action="store_true", help="run the model on CPU even where the cluster has GPUs")
    p.add_argument("--overwrite", action="store_true", help="redo every shard, replacing what --out holds")
    p.add_argument(
        "--label-key",
        default="auto",
        help="label member (cls) or json:<field>; none for unlabeled shards (default: the training run's, else cls)",
    )
    p.add_argument(
        "--crop-fraction",
        type=float,
        help="center-crop share of the short side (default: 0.875 or the run's)",
    )
    p.add_argument(
        "--interpolation",
        choices=sorted(RESAMPLE),
        help="resize filter (default: bicubic or the training run's)",
    )
    p.add_argument(
        "--max-bad-fraction",
        type=float,
        default=0.01,
        help="share of corrupt samples that fails the job (default: %(default)s)",
    )
    p.add_argument(
        "--storage-options",
        type=json.loads,
        help='fsspec options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\' '
        "(credentials: prefer the environment)",
    )
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument(
        "--num-cpus", type=int, help="logical CPUs of a local Ray (default: enough for actors + decoding)"
    )
    return p


def resolve(args: argparse.Namespace) -> EmbedConfig:
    label_key = None if args.label_key.lower() == "none" else args.label_key
    return EmbedConfig(
        data=args.data,
        weights=args.weights,
        out=args.out,
        weights_format=args.weights_format,
        model=args.model,
        embedding=args.embedding,
        image_size=args.image_size,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        cpus_per_actor=args.cpus_per_actor or 1.0,
        overwrite=args.overwrite,
        label_key=label_key,
        crop_fraction=args.crop_fraction,
        interpolation=args.interpolation,
        max_bad_fraction=args.max_bad_fraction,
        storage_options=args.storage_options,
    )


def connect(args: argparse.Namespace, config: EmbedConfig) -> EmbedConfig:
    """Join or start Ray; returns the config with GPU use and CPUs per actor settled."""
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    cpus_per_actor = args.cpus_per_actor
    if address:
        ray.init(address=address)
    else:
        cores = args.num_cpus or os.cpu_count() or 1
        if cpus_per_actor is None and (args.cpu or not _local_gpus()):
            # The model's threads use the machine's cores (decoding fits between them: the model is
            # most of the work); within a given --num-cpus, one logical CPU stays for decoding.
            spare = 1 if args.num_cpus else 0
            cpus_per_actor = max(1, (cores - spare) // config.concurrency)
        # Logical CPUs: every actor's, plus at least one slot for the decode tasks beside them.
        needed = math.ceil(config.concurrency * (cpus_per_actor or 1)) + 1
        if args.num_cpus and args.num_cpus < needed:
            raise ValueError(
                f"--num-cpus {args.num_cpus} leaves no CPU to decode images beside {config.concurrency} actor(s) "
                f"x {cpus_per_actor or 1:g} CPUs; pass --num-cpus {needed} or fewer --cpus-per-actor"
            )
        ray.init(address="local", num_cpus=max(cores, needed), include_dashboard=False)
    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = gpus > 0 and not args.cpu
    if use_gpu and gpus < config.concurrency:
        print(f"note: {gpus:.0f} GPU(s) for --concurrency {config.concurrency}; some actors wait for a GPU")
    return config.replace(use_gpu=use_gpu, cpus_per_actor=float(cpus_per_actor or 1))


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pipeline.embed import prepare, run

    try:
        plan = prepare(resolve(args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    todo = plan.todo
    print(
        f"{plan.source.describe()}; {len(plan.shards)} shards, {len(todo.done)} already done, "
        f"{len(todo.todo)} to embed into {plan.config.out}",
        flush=True,
    )
    if todo.todo:
        try:
            plan.config = connect(args, plan.config)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        device = "1 GPU" if plan.config.use_gpu else f"{plan.config.cpus_per_actor:g} CPUs"
        print(
            f"{plan.config.concurrency} model actor(s), {device} each, batch {plan.config.batch_size}",
            flush=True,
        )

    from pipeline.badsamples import BadSampleBudgetError

    try:
        summary = run(
            plan, on_commit=lambda url, record: print(f"committed {record['file']} ({record['rows']} rows)")
        )
    except BadSampleBudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n" + summary.format())
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
