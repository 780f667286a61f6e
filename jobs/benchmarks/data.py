"""The input pipeline against its baselines, on the same shards, in one run.

    python jobs/benchmark.py data [--json PATH] [--shards DIR] [--images N] ...

(a) vitray: `build_dataset` (train transform, 224 px, patch 14) consumed by the driver through
    `iter_batches` (with the local shuffle buffer, as training does);
(b) webdataset + torch DataLoader: the same transform function in ``num_workers = cores`` workers;
(c) the ceiling: one process running the same read + transform in a tight loop, times the cores;
    ``ceiling_parallel`` runs that loop in ``cores`` processes at once, which is what the cores deliver
    together (shared caches, memory bandwidth and the host's scheduling included);
(d) for the record, Ray's built-in ``read_webdataset(decoder=None)`` + ``map_batches`` of the same transform;
(e) what RandAugment costs: ``ceiling_randaug`` (and, when asked for, ``vitray_randaug``) run (c) (and (a))
    with ``--randaug OPS,MAGNITUDE`` added to the train transform (default AugReg's 2,10).

The shards are photo-like JPEGs of about 500x375 (random crops, scales, flips and color shifts of
matplotlib's sample photo, re-encoded at quality 90), written once into a temporary or ``--shards`` dir.
Configurations run round-robin, ``--repeats`` times each, so all meet the same background load; the
table shows the median images/s, and images per CPU-second of the whole process tree (driver, Ray's
daemons and workers, DataLoader workers), which background load on a shared machine barely moves.
"1st batch s" is the latency to the first batch; "after 1st batch" the rate from there on, which a
shuffle buffer that fills with decoded rows before its first batch inflates.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jobs.benchmarks.photos import make_photo_shards
from jobs.benchmarks.process_cpu import RAY_KINDS, process_tree_cpu
from jobs.benchmarks.report import print_table, write_json
from pipeline.cli import pair
from pipeline.data.config import DataConfig
from pipeline.data.dataset import build_dataset, iter_batches
from pipeline.data.decode import preprocess_batch
from pipeline.data.masking import bytes_per_sample
from pipeline.data.rows import read_shard
from pipeline.data.shards import expand_shards


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark.py data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument(
        "--shards", metavar="DIR", help="write (or reuse) the benchmark shards here (default: a temp dir)"
    )
    parser.add_argument(
        "--images", type=int, default=6144, help="images in the benchmark shards (default: %(default)s)"
    )
    parser.add_argument(
        "--per-shard",
        type=int,
        default=512,
        help="images per shard, as real shards hold hundreds (default: %(default)s)",
    )
    parser.add_argument(
        "--image-size", type=int, default=224, help="output side in pixels (default: %(default)s)"
    )
    parser.add_argument(
        "--patch-size", type=int, default=14, help="patch side in pixels (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=256, help="consumer batch size (default: %(default)s)"
    )
    parser.add_argument(
        "--shuffle-buffer",
        type=int,
        default=1024,
        help="local shuffle buffer, both pipelines (default: %(default)s)",
    )
    parser.add_argument(
        "--cores",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="cores to use (default: all: %(default)s)",
    )
    parser.add_argument("--ray-cpus", type=int, help="logical CPUs for ray.init (default: --cores)")
    parser.add_argument(
        "--block-mb",
        type=int,
        default=DataConfig.block_bytes >> 20,
        help="Ray target block size in MiB (default: DataConfig's, %(default)s)",
    )
    parser.add_argument(
        "--randaug", type=pair, default=(2, 10), metavar="OPS,MAGNITUDE",
        help="RandAugment of the *_randaug configurations (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each configuration (default: %(default)s)"
    )
    parser.add_argument(
        "--only",
        default="ceiling,ceiling_randaug,ceiling_parallel,webdataset,vitray,read_webdataset",
        help="comma-separated subset of the configurations, vitray_randaug too (default: the others)",
    )
    args = parser.parse_args(argv)
    if not float(args.randaug[0]).is_integer():
        parser.error(f"--randaug {args.randaug}: OPS is a whole number of ops, e.g. 2,10")
    return args


@dataclass
class Run:
    """What one run of a configuration saw. ``seconds`` and ``cpu_s`` are set by runners that time
    themselves; ``first_batch_s``/``first_batch_images`` by those that deliver batches."""

    images: int
    seconds: float | None = None
    cpu_s: float | None = None
    first_batch_s: float | None = None
    first_batch_images: int = 0


def consume(batches: Any) -> Run:
    """Count the images of a batch stream (``label`` column or (patches, labels) pairs)."""
    start, run = time.perf_counter(), Run(0)
    for batch in batches:
        n = len(batch["label"]) if isinstance(batch, dict) else len(batch[1])
        if run.first_batch_s is None:
            run.first_batch_s, run.first_batch_images = time.perf_counter() - start, n
        run.images += n
    return run


def measure(runner: Callable[[], Run]) -> tuple[Run, dict[str, float]]:
    """One run of ``runner``, timed, with the CPU seconds it cost by process kind."""
    before = process_tree_cpu()
    start = time.perf_counter()
    run = runner()
    seconds = time.perf_counter() - start
    after = process_tree_cpu()
    if run.cpu_s is not None:
        return run, {"subprocesses": run.cpu_s}
    run.seconds = run.seconds or seconds
    return run, {kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in after}


def ceiling_run(shards: list[str], config: DataConfig) -> Run:
    """One process, no framework: read rows and run the fused transform over them."""
    count = 0
    for url in shards:
        for table in read_shard(url, config.row_spec, config.block_rows):
            batch = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
            count += len(preprocess_batch(batch, config=config, train=True, epoch=0)["label"])
    return Run(count)


def _ceiling_worker(shards: list[str], config: DataConfig, ready: Any, go: Any, out: Any) -> None:
    """One process of `parallel_ceiling_run`: signals it is ready, waits for the start, runs the loop."""
    ceiling_run(shards[:1], config)  # warm up (first decodes, allocator), untimed
    ready.put(True)
    go.wait()
    cpu = time.process_time()
    count = ceiling_run(shards, config).images
    out.put((count, time.time(), time.process_time() - cpu))


def parallel_ceiling_run(shards: list[str], config: DataConfig, cores: int) -> Run:
    """The same loop in ``cores`` processes at once (disjoint shards): what the cores deliver together
    when all are busy (shared caches and memory bandwidth included); it times itself."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # Ray's threads may be running: no fork
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_ceiling_worker, args=(shards[i::cores], config, ready, go, out))
        for i in range(cores)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get()
    start = time.time()
    go.set()
    results = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    seconds = max(r[1] for r in results) - start
    return Run(sum(r[0] for r in results), seconds=seconds, cpu_s=sum(r[2] for r in results))


def webdataset_run(shards: list[str], config: DataConfig, batch_size: int, workers: int, shuffle: int) -> Run:
    import torch
    import webdataset as wds

    def transform(sample: dict[str, Any]) -> tuple[np.ndarray, int]:
        batch = {
            "key": np.array([sample["__key__"]], dtype=object),
            "url": np.array([sample["__url__"]], dtype=object),
            "image": np.array([sample["jpg"]], dtype=object),
            "label": np.array([int(sample["cls"])]),
            "error": np.array([""], dtype=object),
        }
        out = preprocess_batch(batch, config=config, train=True, epoch=0)
        return out["patches"][0], int(out["label"][0])

    pipeline = wds.WebDataset(shards, shardshuffle=False, empty_check=False).map(transform)
    if shuffle:
        pipeline = pipeline.shuffle(shuffle // max(workers, 1))  # the same total buffer, split over workers
    pipeline = pipeline.batched(batch_size)
    loader = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=workers, prefetch_factor=4)
    return consume(loader)


def vitray_run(shards: list[str], config: DataConfig, batch_size: int) -> Run:
    ds = build_dataset(shards, config, train=True, epoch=0)
    return consume(iter_batches(ds, batch_size, config, epoch=0, shuffle=config.shuffle_buffer > 0))


def read_webdataset_run(shards: list[str], config: DataConfig, batch_size: int) -> Run:
    import ray.data

    def decode(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch["__key__"])
        rows = {
            "key": batch["__key__"],
            "url": np.array(["bench"] * n, dtype=object),
            "image": batch["jpg"],
            "label": np.array([int(c) for c in batch["cls"]]),
            "error": np.array([""] * n, dtype=object),
        }
        return preprocess_batch(rows, config=config, train=True, epoch=0)

    ds = ray.data.read_webdataset(shards, decoder=None).map_batches(decode, batch_format="numpy")
    return consume(ds.iter_batches(batch_size=batch_size, batch_format="numpy"))


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    only = set(args.only.split(","))
    cores = args.cores
    config = DataConfig(
        image_size=args.image_size,
        patch_size=args.patch_size,
        shuffle_buffer=args.shuffle_buffer,
        block_bytes=args.block_mb << 20,
    )
    augmented = config.replace(randaug_ops=int(args.randaug[0]), randaug_magnitude=args.randaug[1])
    scratch = tempfile.TemporaryDirectory(prefix="vitray-bench-") if not args.shards else None
    shard_dir = Path(args.shards or scratch.name)
    shard_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    shards = expand_shards(make_photo_shards(shard_dir, args.images, args.per_shard))
    print(
        f"{len(shards)} shards of {args.per_shard} photo-like JPEGs in {shard_dir} ({time.perf_counter() - start:.0f}s)"
    )

    part = shards[: max(1, len(shards) // 3)]  # a third of the shards is plenty for a per-core rate
    runners: dict[str, Callable[[], Run]] = {
        "ceiling": lambda: ceiling_run(part, config),
        "ceiling_randaug": lambda: ceiling_run(part, augmented),
        "ceiling_parallel": lambda: parallel_ceiling_run(part, config, cores),
        "webdataset": lambda: webdataset_run(shards, config, args.batch_size, cores, args.shuffle_buffer),
        "vitray": lambda: vitray_run(shards, config, args.batch_size),
        "read_webdataset": lambda: read_webdataset_run(shards, config, args.batch_size),
        "vitray_randaug": lambda: vitray_run(shards, augmented, args.batch_size),
    }
    names = [name for name in runners if name in only]
    uses_ray = bool(only & {"vitray", "read_webdataset", "vitray_randaug"})
    if uses_ray:
        import ray

        os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
        ray.init(num_cpus=args.ray_cpus or cores, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        vitray_run(shards[:cores], config, args.batch_size)  # start the worker processes once, untimed
    # Round-robin, so that every configuration meets the same background load on a shared machine.
    runs: dict[str, list[Run]] = {name: [] for name in names}
    cpu: dict[str, dict[str, float]] = {name: {} for name in names}
    for repeat in range(args.repeats):
        for name in names:
            run, used = measure(runners[name])
            if name.startswith("ceiling") and name != "ceiling_parallel":  # one process, scaled to the cores
                run.images *= cores
                used = {k: v * cores for k, v in used.items()}
            if not name.startswith(("vitray", "read_")):  # an idle Ray is not the baseline's
                used = {k: v for k, v in used.items() if k not in RAY_KINDS}
            runs[name].append(run)
            for kind, value in used.items():
                cpu[name][kind] = cpu[name].get(kind, 0.0) + value
            print(
                f"  run {repeat + 1}/{args.repeats} {name:<16} {run.images / run.seconds:7.0f} images/s",
                flush=True,
            )
    if uses_ray:
        ray.shutdown()
    if scratch is not None:
        scratch.cleanup()
    return report(runs, cpu, args, cores, config)


def report(
    runs: dict[str, list[Run]],
    cpu: dict[str, dict[str, float]],
    args: argparse.Namespace,
    cores: int,
    config: DataConfig,
) -> dict[str, Any]:
    """Print the table (medians, CPU efficiency, ratios) and return (and maybe write) the figures."""
    figures: dict[str, Any] = {
        "cores": cores,
        "images": runs and max(r.images for v in runs.values() for r in v),
    }
    figures["config"] = config.to_dict()
    figures["randaug"] = {"ops": int(args.randaug[0]), "magnitude": args.randaug[1]}
    rows = []
    for name, these in runs.items():
        rates = [r.images / r.seconds for r in these]
        per_cpu = sum(r.images for r in these) / max(sum(cpu[name].values()), 1e-9)
        firsts = [r.first_batch_s for r in these if r.first_batch_s is not None]
        steady = [
            (r.images - r.first_batch_images) / (r.seconds - r.first_batch_s)
            for r in these
            if r.first_batch_s is not None
        ]
        figures[f"{name}_images_per_s"] = statistics.median(rates)
        figures[f"{name}_runs"] = rates
        figures[f"{name}_images_per_cpu_s"] = per_cpu
        figures[f"{name}_cpu_s_by_process"] = cpu[name]
        if firsts:
            figures[f"{name}_first_batch_s"] = statistics.median(firsts)
            figures[f"{name}_steady_images_per_s"] = statistics.median(steady)
        rows.append(
            {
                "pipeline": name,
                "images/s": figures[f"{name}_images_per_s"],
                "after 1st batch": figures.get(f"{name}_steady_images_per_s"),
                "1st batch s": figures.get(f"{name}_first_batch_s"),
                "images/CPU-s": per_cpu,
                "runs (images/s)": " ".join(f"{r:.0f}" for r in rates),
                "CPU-s by process": ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(cpu[name].items(), key=lambda kv: -kv[1])
                ),
            }
        )
    pairs = [
        ("vitray", "webdataset"),
        ("vitray", "ceiling"),
        ("vitray", "ceiling_parallel"),
        ("read_webdataset", "webdataset"),
        ("ceiling_randaug", "ceiling"),
        ("vitray_randaug", "vitray"),
    ]
    for name, base in pairs:
        if name in runs and base in runs:
            figures[f"{name}_vs_{base}"] = figures[f"{name}_images_per_s"] / figures[f"{base}_images_per_s"]
            figures[f"{name}_vs_{base}_per_cpu"] = (
                figures[f"{name}_images_per_cpu_s"] / figures[f"{base}_images_per_cpu_s"]
            )
            rows.append(
                {
                    "pipeline": f"{name} / {base}",
                    "images/s": figures[f"{name}_vs_{base}"],
                    "images/CPU-s": figures[f"{name}_vs_{base}_per_cpu"],
                }
            )
    print_table(
        f"data pipeline, {args.image_size}px patch {args.patch_size}, train transform, {cores} cores, "
        f"Ray num_cpus {args.ray_cpus or cores} (median of {args.repeats})",
        rows,
    )
    sizes = figures["bytes_per_sample"] = bytes_per_sample(config, mask_ratio=0.75)
    print(
        f"bytes per sample: {sizes['unmasked_total']:,} without masking, {sizes['masked_total']:,} with "
        f"MAE's mask at 0.75 (targets travel too); encoder input {sizes['encoder_input_unmasked']:,} -> "
        f"{sizes['encoder_input_masked']:,}"
    )
    if args.json:
        write_json(args.json, figures)
    return figures
