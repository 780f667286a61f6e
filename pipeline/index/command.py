"""The commands of `jobs/index.py` and `jobs/search.py`: what each job does once its command line is
parsed (`pipeline.cli.main` ends it). The jobs' modules (FAISS, Ray, torch for an image query) load with
their work, not with ``--help``.
"""

from __future__ import annotations

import argparse

from pipeline import cli
from pipeline.index.config import IndexConfig, SearchConfig


def index_command(args: argparse.Namespace) -> int:
    """`jobs/index.py`: the index planned and described, then built here or in ``--ray-tasks`` tasks."""
    from pipeline.index import build

    if (config := cli.configured(args, IndexConfig)) is None:
        return 0
    plan = build.prepare(config)
    print(plan.spec.describe(), flush=True)
    if not config.ray_tasks:
        cli.start_work()
        print(build.build(plan).format())
        return 0
    cli.connect_ray(args, needed_cpus=1)
    from pipeline.index import distributed

    cli.start_work()
    print(distributed.build(plan).format())
    return 0


def search_command(args: argparse.Namespace) -> int:
    """`jobs/search.py`: the index loaded, then the near-duplicate pairs written, or each query's
    neighbours (of ``--key`` rows, or of an ``--image`` embedded as the index's output was) printed."""
    from pipeline.index import query, search

    if (config := cli.configured(args, SearchConfig, keys=tuple(args.keys or ()))) is None:
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
