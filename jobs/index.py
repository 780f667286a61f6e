"""Build a FAISS index over embedding outputs, for jobs/search.py: exact for small sets, approximate for large.

    python jobs/index.py --embeddings /tmp/emb --out /tmp/emb-index                          # one process, no Ray
    python jobs/index.py --embeddings s3://b/emb/train,s3://b/emb/val --out s3://b/index/h14 --memory-gb 16
    python jobs/index.py --embeddings s3://b/emb/train --out s3://b/index/h14 --kind ivfpq --ray-tasks 16  # on Ray

--embeddings takes jobs/embed.py's --out (or several of one model, comma-separated). The metric is inner
product (cosine) on outputs embedded with --normalize, L2 otherwise. --kind auto takes an exact flat index
up to 50,000 rows, else an HNSW graph where it fits --memory-gb, else IVF-PQ codes with the largest code
that fits. The Parquet files are streamed in record batches, so an output larger than memory indexes.
--ray-tasks N trains once here, then adds the rows in N Ray tasks (each a group of the files) and merges
their shards in file order: the same index, byte for byte (flat or ivfpq; --kind auto then skips hnsw).
It joins --address, else RAY_ADDRESS, else starts a local Ray.

Leaves under --out: index.faiss, ids.parquet (id, key, url) and _index.json (the outputs it was built
from: model, weights sha256, normalize, dtype, D; the index's kind and parameters), written last.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.index import command, config


def main(argv: list[str] | None = None) -> int:
    return cli.main(config.index_parser(__doc__), command.index_command, argv)


if __name__ == "__main__":
    sys.exit(main())
