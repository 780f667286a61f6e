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
        presets.pretrain_parser(__doc__),
        partial(driver.pretrain_command, scorer=checkpoint_probe.score),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
