"""Export a model vitray trained for timm or transformers: the files those libraries load, and a model card.

    python jobs/export.py --weights /tmp/run --to timm --out /tmp/run-timm      # timm.create_model("local-dir:...")
    python jobs/export.py --weights s3://b/runs/b16/final --to hf --out s3://b/hf/b16   # transformers' from_pretrained

--weights takes what vitray wrote: a run directory (its final/, else its latest complete checkpoint),
its final/ or a checkpoint_* directory. The export computes what the vitray model computes and carries
its normalization (timm: pretrained_cfg; transformers: preprocessor_config.json). A head the target has
no counterpart of (timm: the pretraining head's Linear -> tanh layer; transformers: a classifier behind
it) is a one-line error; --encoder-only drops the head and keeps the embeddings. One process, no Ray.

Leaves under --out: model.safetensors and config.json (--to timm: timm's folder format; --to hf:
transformers' ViTModel, or ViTForImageClassification for a classifier, plus preprocessor_config.json),
and README.md, a model card from the run's record (data, objective, steps, loss and accuracy).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli, export


def main(argv: list[str] | None = None) -> int:
    return cli.main(export.export_parser(__doc__), export.command, argv)


if __name__ == "__main__":
    sys.exit(main())
