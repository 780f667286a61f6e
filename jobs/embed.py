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
fixed_size_list<float32>[D], or <float16> with --dtype float16; unit rows with --normalize; label),
_identity.json (the output's model, weights, preprocessing and those two options, claimed before the
first commit: a run of another configuration into the same --out fails in one line) and _manifest.json (model, weights sha256, preprocessing, D, per shard its file, rows and skipped samples).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.embed import command, config


def main(argv: list[str] | None = None) -> int:
    return cli.main(config.parser(__doc__), command.command, argv, failures=command.failures)


if __name__ == "__main__":
    sys.exit(main())
