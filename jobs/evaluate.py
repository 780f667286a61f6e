"""Score embedding outputs: linear-probe, k-NN and few-shot linear accuracy, as a table and as JSON.

    python jobs/evaluate.py --train /tmp/emb-train --test /tmp/emb-val                 # one process, no Ray
    python jobs/evaluate.py --train s3://b/emb/train --test s3://b/emb/val --json /tmp/scores.json

--train and --test are directories that jobs/embed.py wrote (or single .parquet files with its
columns), from labeled shards and the same weights. Classifiers are fitted on --train and scored on
--test: a logistic-regression probe on standardized features, a k-NN majority vote among the --k most
cosine-similar rows, and the paper's few-shot linear accuracy (regularized least squares onto {-1, 1}
targets from --shots images per class, averaged over --seeds draws).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.evaluate import command, config


def main(argv: list[str] | None = None) -> int:
    return cli.main(config.evaluate_parser(__doc__), command.evaluate_command, argv)


if __name__ == "__main__":
    sys.exit(main())
