"""The per-step host cost of the data position, one source against sources mixed by weight, and of the
ledger of what each epoch consumed.

    python jobs/benchmark.py position --steps 300 --shards 20000

What each step of a run adds on the host to keep its position by sample (`pipeline.train.input.position`,
`pipeline.train.input.source_position`), measured without decode, Ray or a model: each rank step takes
``accum`` micro-batches of ``size`` rows from a stream built beforehand (rows carry ``url``, ``index``
and ``shard_size`` as the read stage gives them) and adds their position columns to the rank's position,
as the loop does (`EpochCursor.took`). Each figure is the median over ``--repeats`` runs, per step:

    single     one source: the stream and `EpochPosition.took`
    mixed      two sources at 0.7 / 0.3 through `mixed_micro_batches` and `SourcesPosition.took`
    tagging    what the mixed stream's (source, pass) columns cost: the tagged stream against the same
               stream without them (rows without ``index`` are not tagged)
    grouping   `SourcesPosition.took` (samples grouped per source and pass) against `EpochPosition.took`
    tally      the ledger's work on the data thread (`pipeline.train.input.ledger.tally_batches`: every
               key of the step hashed, summed per shard), one source
    ledger     the ledger's work on the training thread (`Ledger.trained`: the step's tally added)

and the size of the ledger's record (what a checkpoint's ``train_state.json`` holds) for one epoch that
read every shard of ``--shards``: it grows by that much an epoch.

``--shards`` sets each source's shard list (the position's size; rows fill the first shards only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from jobs.benchmarks.report import machine, print_table, write_json
from pipeline.data.bad_samples import BadSamples
from pipeline.data.mixture import SourceReader, mixed_micro_batches
from pipeline.train.input.ledger import PLAIN, Ledger, key_hash, tally_batches
from pipeline.train.input.position import EpochPosition
from pipeline.train.input.source_position import SourcesPosition

POSITION = ("url", "index", "shard_size", "source", "pass")
PER_SHARD = 1000
# (micro-batch size, micro-batches a step); (32, 1): a GPU's step in the ViT-H/14 plan (docs/scaling.md)
SHAPES = ((16, 4), (32, 1), (64, 4), (256, 1), (256, 4))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python jobs/benchmark.py position", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps a run")
    p.add_argument("--shards", type=int, default=0, help="shards a source (default: what the rows fill)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each figure; the median is shown")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def source(name: str, samples: int, size: int, shards: int, tagged: bool = True) -> tuple[list[str], list]:
    """A source's shard list and its rows as micro-batch-sized batches."""
    urls = [f"s3://{name}/shard-{i:06d}.tar" for i in range(max(-(-samples // PER_SHARD), shards))]
    index = np.arange(samples) % PER_SHARD
    rows = {
        "key": np.array([f"{name}/{i}" for i in range(samples)]),
        "url": np.array([urls[i // PER_SHARD] for i in range(samples)]),
        "patches": np.zeros((samples, 64), dtype=np.uint8),
        "label": np.arange(samples, dtype=np.int64),
        "index": index,
        "shard_size": np.where(index == PER_SHARD - 1, PER_SHARD, -1),
    }
    if not tagged:
        del rows["index"]
    return urls, [{c: v[i : i + size] for c, v in rows.items()} for i in range(0, samples, size)]


def timed(steps: int, stream, accum: int, position) -> tuple[float, float]:
    """(seconds a step, of which in the position), over ``steps`` steps of ``stream``."""
    in_position, start = 0.0, time.perf_counter()
    for _ in range(steps):
        micro = [next(stream) for _ in range(accum)]
        if position is not None:
            consumed = [tuple(b[c] for c in POSITION if c in b) for b in micro]
            t = time.perf_counter()
            position.took(consumed, [])
            in_position += time.perf_counter() - t
    return (time.perf_counter() - start) / steps, in_position / steps


def single(steps: int, accum: int, size: int, shards: int) -> tuple[float, float]:
    urls, batches = source("one", steps * accum * size, size, shards)
    return timed(steps, iter(batches), accum, EpochPosition(urls))


def ledger(steps: int, accum: int, size: int, shards: int) -> tuple[float, float]:
    """(seconds a step in `tally_batches`, in `Ledger.trained`), one source."""
    urls, batches = source("one", steps * accum * size, size, shards)
    kept, stream, tallying, adding = Ledger(urls), iter(batches), 0.0, 0.0
    for _ in range(steps):
        micro = [next(stream) for _ in range(accum)]
        t = time.perf_counter()
        tallied = tally_batches(micro)
        t2 = time.perf_counter()
        kept.trained(tallied)
        tallying, adding = tallying + t2 - t, adding + time.perf_counter() - t2
    return tallying / steps, adding / steps


def epoch_record(shards: int) -> int:
    """Bytes of the ledger's record (JSON) after one epoch that read every one of ``shards`` shards."""
    urls = [f"s3://one/shard-{i:06d}.tar" for i in range(shards)]
    kept = Ledger(urls)
    kept.trained([(url, PLAIN, PER_SHARD, key_hash(url)) for url in urls])
    kept.base, kept.added = kept.added, {}  # as a checkpoint's gather leaves it
    return len(json.dumps(kept.to_dict()))


def mixed(steps: int, accum: int, size: int, shards: int, tagged: bool = True) -> tuple[float, float]:
    names, weights = ["big", "small"], [0.7, 0.3]
    total = steps * accum * size
    made = [
        source(n, int(total * w * 1.2) + 10 * size, size, shards, tagged)
        for n, w in zip(names, weights, strict=True)
    ]
    counts = BadSamples()
    readers = [
        SourceReader(n, lambda p, b=b: iter(b), counts, index=s)
        for s, (n, (_, b)) in enumerate(zip(names, made, strict=True))
    ]
    stream = mixed_micro_batches(
        readers, weights, seed=0, rank=0, epoch=0, accum=accum, size=size, exhausted="cycle"
    )
    position = SourcesPosition(names, [urls for urls, _ in made]) if tagged else None
    return timed(steps, stream, accum, position)


def median(run: Callable[..., tuple[float, float]], repeats: int, *args) -> tuple[float, float]:
    runs = [run(*args) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    rows = []
    for size, accum in SHAPES:
        shape = (args.steps, accum, size, args.shards)
        (one, one_position), (mix, mix_position) = (
            median(single, args.repeats, *shape),
            median(mixed, args.repeats, *shape),
        )
        untagged, _ = median(mixed, args.repeats, *shape, False)
        tagging, grouping = (mix - mix_position) - untagged, mix_position - one_position
        tallying, adding = median(ledger, args.repeats, *shape)
        rows.append(
            {
                "micro_batch": size,
                "accum": accum,
                "single_us": round(one * 1e6),
                "mixed_us": round(mix * 1e6),
                "tagging_us": round(tagging * 1e6),
                "grouping_us": round(grouping * 1e6),
                "ns_per_sample": round((tagging + grouping) / (size * accum) * 1e9),
                "tally_us": round(tallying * 1e6),
                "ledger_us": round(adding * 1e6),
            }
        )
    print_table(
        f"data position, host time a step ({args.steps} steps, {args.shards or 'few'} shards a source)", rows
    )
    record = epoch_record(args.shards or PER_SHARD)
    print(f"the ledger's record: {record:,} bytes an epoch over {args.shards or PER_SHARD:,} shards")
    if args.json:
        write_json(
            args.json,
            {
                "machine": machine(),
                "steps": args.steps,
                "shards": args.shards,
                "rows": rows,
                "ledger_epoch_bytes": record,
            },
        )
