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

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.index.config import SearchConfig, search_parser


def build_parser() -> argparse.ArgumentParser:
    return search_parser(__doc__)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from pipeline.index import query, search

        config = SearchConfig(**cli.overrides(args, SearchConfig), keys=tuple(args.keys or ()))
        if args.print_config:
            cli.print_config(config)
            return 0
        config.validate()
        if config.near_duplicates is not None:
            search.check_pairs_target(config.location(config.out))
        index = search.load_index(config.location(config.index))
        search.tune(index, nprobe=config.nprobe, ef_search=config.ef_search)
        print(index.describe(), flush=True)
        if config.near_duplicates is not None:
            cli.start_work()
            pairs = search.near_duplicates(index, config.near_duplicates, config.k)
            search.write_pairs(pairs, config.location(config.out))
            print(f"{pairs.num_rows:,} pairs within {config.near_duplicates:g}: {config.out}")
            return 0
        if config.keys:
            ids = index.ids_of(config.keys)
            titles = [f"\nneighbours of {index.keys[i]} ({index.urls[i]})" for i in ids]
            queries = index.vectors(ids)
        else:
            image, weights = config.location(config.image), config.location(config.weights)
            queries = query.embed_image(image, weights, index.source, index.dim)
            titles = [f"\nneighbours of {config.image}"]
        cli.start_work()
        for title, rows in zip(titles, search.neighbours(index, queries, config.k), strict=True):
            print(search.format_neighbours(title, rows, index.metric))
            if note := search.shortfall(index, len(rows), config.k):
                print(note)
        return 0

    return cli.run_job(body)


if __name__ == "__main__":
    sys.exit(main())
