"""Fine-tune a pretrained ViT on labeled shards, with Ray Train + FSDP2, and evaluate it on held-out ones.

    python jobs/finetune.py --weights /tmp/run --data /tmp/shards --eval-data /tmp/shards-val \\
        --out /tmp/ft --image-size 48 --num-classes 10 --cpu --num-workers 2 --batch-size 64 \\
        --micro-batch-size 32 --max-steps 60 --warmup-steps 6 --lr 0.03             # local, CPU
    ray job submit --working-dir . -- python jobs/finetune.py --weights s3://bucket/runs/b16 \\
        --data 's3://bucket/task/train-{000..063}.tar' --eval-data 's3://bucket/task/val-{000..007}.tar' \\
        --num-classes 100 --out s3://bucket/runs/b16-ft                              # a GPU cluster

--weights takes a pretraining export (final/), a run directory or a checkpoint_* directory (supervised
or MAE), or timm / torchvision / transformers weights: the model, its patch size and input
normalization are the weights' own. The pretraining head is dropped and a linear head of --num-classes
takes its place, fit as a linear probe of the training images' features before the first step
(--head-init probe; zero: the paper's zero head); at another --image-size the position embeddings are
resampled in 2D (the [CLS] one kept). The default recipe is the paper's (preset `finetune`): SGD with
momentum 0.9, no weight decay, cosine decay, global-norm clipping at 1; --preset finetune_small suits a
task of thousands of small images. --eval-data is evaluated (resize + center crop)
every --eval-every steps and at the end; the final accuracy is printed. Rerun with the same --out to
resume. Leaves under --out: checkpoint_<step>/, metrics.jsonl (with eval_accuracy),
final/weights.safetensors + config.json (head: finetune, the new image size), which jobs/embed.py and
jobs/analyze.py take.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.evaluate import checkpoint_probe
from pipeline.train import driver, presets


def main(argv: list[str] | None = None) -> int:
    # The checkpoint probe (--probe-data) embeds and scores with the embed and evaluate jobs' code, which
    # the training room never imports: this job hands it in.
    return cli.main(
        presets.finetune_parser(__doc__),
        partial(driver.finetune_command, scorer=checkpoint_probe.score),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
