"""The training stall per checkpoint: synchronous against asynchronous saves, in real pretraining runs.

    python jobs/benchmark.py checkpoint --model vit_s16 --image-size 64 --num-workers 2 --steps 12 --checkpoint-every 3

Two runs of the same config on a local Ray (synthetic shards, CPU workers unless --gpu), one with
--no-async-checkpoint, one with asynchronous checkpoints (the default), alternating `--repeats` times.
The stall of a checkpoint is what the run itself records: the seconds its training thread spent in the
save (`checkpoint_stall_s` of `metrics.jsonl`; `pipeline.train.checkpointing.saver`). The first asynchronous save
also allocates the host buffers that later saves reuse, so it is shown apart. Each run writes into a
fresh local --out under a scratch directory: the "upload" is a copy to local disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from jobs.benchmarks.report import machine, print_table, write_json


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python jobs/benchmark.py checkpoint", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="vit_s16", help="a vit.VARIANTS name")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=4, help="images per worker per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="sync and async runs, alternating, each this often")
    p.add_argument("--gpu", action="store_true", help="GPU workers (default: CPU workers)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    import ray

    from pipeline import dcp
    from pipeline.cli import apply_local_ray_env
    from pipeline.data.synthetic import write_synthetic_shards
    from pipeline.train.config import TrainConfig
    from pipeline.train.driver import fit, read_metrics

    scratch = tempfile.TemporaryDirectory(prefix="vitray-bench-ckpt-")
    batch = args.micro_batch_size * args.num_workers
    shards = write_synthetic_shards(
        Path(scratch.name) / "shards", batch * args.steps, samples_per_shard=batch * args.steps // 4,
        image_size=args.image_size, num_classes=10,
    )  # fmt: skip
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    apply_local_ray_env()
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 2 * args.num_workers + 2),
        include_dashboard=False,
        log_to_driver=False,
    )
    base = TrainConfig().replace(
        model=args.model, image_size=args.image_size, num_classes=10, batch_size=batch,
        micro_batch_size=args.micro_batch_size, num_workers=args.num_workers, use_gpu=args.gpu,
        max_steps=args.steps, warmup_steps=1, checkpoint_every=args.checkpoint_every,
        log_every=args.checkpoint_every, keep_checkpoints=2, shuffle_buffer=16, max_failures=0,
        shards=",".join(shards.urls),
    )  # fmt: skip
    stalls: dict[str, list[list[float]]] = {"sync": [], "async": []}
    seconds: dict[str, list[float]] = {"sync": [], "async": []}
    for repeat in range(args.repeats):
        for mode in ("sync", "async"):
            out = Path(scratch.name) / f"{mode}-{repeat}"
            start = time.perf_counter()
            fit(base.replace(out=str(out), async_checkpoint=mode == "async"), shards.urls)
            seconds[mode].append(time.perf_counter() - start)
            rows = read_metrics(str(out))
            stalls[mode].append([r["checkpoint_stall_s"] for r in rows if "checkpoint_stall_s" in r])
    ray.shutdown()
    last = dcp.latest_complete(Path(scratch.name) / "sync-0")
    size = sum(f.stat().st_size for f in Path(last.local_path).iterdir())
    rows = []
    for mode in ("sync", "async"):
        first = [run[0] for run in stalls[mode]]
        later = [s for run in stalls[mode] for s in run[1:]]
        rows.append({
            "saves": "--no-async-checkpoint" if mode == "sync" else "asynchronous",
            "checkpoints": sum(len(run) for run in stalls[mode]),
            "first stall s": statistics.median(first),
            "later stall s (median)": statistics.median(later) if later else None,
            "run s": statistics.median(seconds[mode]),
        })  # fmt: skip
    sync_stall, async_stall = (row["later stall s (median)"] for row in rows)
    ratio = sync_stall / async_stall if sync_stall and async_stall else None
    title = (
        f"checkpoint stall, {args.model} @ {args.image_size}px, {args.num_workers} "
        f"{'GPU' if args.gpu else 'CPU'} workers, {size / 2**20:.0f} MiB a checkpoint"
    )
    if ratio:
        title += f"; sync / async (later saves): {ratio:.1f}x"
    print_table(title, rows)
    figures = {"config": vars(args), "checkpoint_mib": size / 2**20, "rows": rows, "stalls": stalls,
               "ratio_sync_over_async": ratio, "machine": machine()}  # fmt: skip
    if args.json:
        write_json(args.json, figures)
    scratch.cleanup()
    return figures
