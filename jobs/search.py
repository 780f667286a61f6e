"""Search an index that jobs/index.py built: the nearest rows to keys or to an image, or near-duplicate pairs.

    python jobs/search.py --index /tmp/emb-index --key 000123 --key 000456 --k 5
    python jobs/search.py --index /tmp/emb-index --image cat.jpg --weights /tmp/run
    python jobs/search.py --index /tmp/emb-index --near-duplicates 0.95 --out /tmp/dups.parquet

Scores are cosine similarities on an index of normalized embeddings (jobs/embed.py --normalize), else
Euclidean distances. An --image is embedded with the indexed output's model (--weights must be those
weights: their sha256 is checked) and eval transform. --near-duplicates writes every pair of rows at
least THRESHOLD similar (or at most THRESHOLD apart) among each row's --k nearest: key_a, url_a, key_b,
url_b, score.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.index import command, config


def main(argv: list[str] | None = None) -> int:
    return cli.main(config.search_parser(__doc__), command.search_command, argv)


if __name__ == "__main__":
    sys.exit(main())
