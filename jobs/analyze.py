"""What a trained ViT learned: the three panels of the paper's Fig. 7 as PNGs, and analysis.json.

    python jobs/analyze.py --weights /tmp/run --data /tmp/shards --out /tmp/analysis       # one process, no Ray
    python jobs/analyze.py --weights s3://b/runs/h14/final --data 's3://b/val-000000.tar' --out /tmp/h14 --images 128

--weights takes what jobs/embed.py takes (a run dir, its final/, a checkpoint_* dir, a transformers
model dir, a timm / torchvision / transformers weights file). The attention distances are measured
on the first --images readable images of --data, with the evaluation crop of the model's own
preprocessing. It runs in this process, without Ray (a few forward passes with explicit attention
maps): on the GPU where there is one, unless --cpu.

Leaves under --out: patch_embedding_filters.png (first 28 principal components of the patch-embedding
filters), position_embedding_similarity.png (cosine similarity of each patch's position embedding
with every other), attention_distance.png (mean attention distance per head, by layer) and
analysis.json (mean_attention_distance [layer][head] in pixels, position-embedding similarity of
adjacent and distant patches, the filters' variance shares).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.evaluate import command, config


def main(argv: list[str] | None = None) -> int:
    return cli.main(config.analyze_parser(__doc__), command.analyze_command, argv)


if __name__ == "__main__":
    sys.exit(main())
