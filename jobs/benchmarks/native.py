"""Native-aspect batches against square ones at one token budget, on the CPU: padding, the data stage's
and the training step's patch tokens per second.

    python jobs/benchmark.py native [--json PATH] [--images N] [--model vit_ti16] [--micro-batch-size 16] ...

Both modes spend the same budget: square crops of ``--image-size`` (N = (image_size / patch)^2 patches
an image) against images at their own aspect ratio of at most ``--max-patches`` = N patches, in
micro-batches of ``--micro-batch-size`` x N patch tokens (`pipeline.data.native.pack`).

(a) The data stage: `build_dataset` (train transform) through `iter_batches` (the local shuffle
    buffer) and `by_token_budget`, as a training rank takes it, over photo-like JPEGs of mixed aspect
    ratios (`jobs.benchmarks.photos.make_mixed_aspect_shards`): images/s, the images' own patch tokens
    a second (padding left out) and a CPU-second of the whole process tree (driver, Ray's daemons and
    workers: what background load on a shared machine barely moves), and the share of patch slots that
    are padding; the modes alternate, ``--repeats`` times.
(b) The same images' grids, packed as training packs them and as rows of the budget's full width
    (evaluation and embedding batches): the padding of each, without Ray.
(c) The training step (`pipeline.train.step.TrainStep`, FSDP2 on one process, fp32 on CPU): square
    micro-batches against native ones of those grids (random pixels), the steps alternating: the
    images' own patch tokens a second and a CPU-second of this process, and the seconds a step (medians
    over the steps), and the tokens a CPU-second of each mode's cheapest step (what background load
    can only make worse).
(d) How much of each image the model sees at evaluation: the square center crop keeps
    ``crop_fraction^2 x short / long`` of it, a native row all of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jobs.benchmarks.photos import ASPECTS, make_mixed_aspect_shards
from jobs.benchmarks.report import print_table, write_json

MODES = ("square", "native")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmark.py native", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument(
        "--shards", metavar="DIR", help="write (or reuse) the benchmark shards here (default: a temp dir)"
    )
    p.add_argument(
        "--images", type=int, default=1536, help="images in the benchmark shards (default: %(default)s)"
    )
    p.add_argument("--per-shard", type=int, default=256, help="images per shard (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=224, help="square side in pixels (default: %(default)s)")
    p.add_argument("--patch-size", type=int, default=16, help="patch side in pixels (default: %(default)s)")
    p.add_argument(
        "--shuffle-buffer", type=int, default=512, help="local shuffle buffer (default: %(default)s)"
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="runs of each mode's data stage (default: %(default)s)"
    )
    p.add_argument("--model", default="vit_ti16", help="the model of the step (default: %(default)s)")
    p.add_argument(
        "--micro-batch-size", type=int, default=16,
        help="square images a micro-batch; the token budget is this x the square's patches (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=6, help="timed steps of each mode (default: %(default)s)")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps of each mode first (default: %(default)s)"
    )
    p.add_argument("--threads", type=int, help="torch threads of the step (default: torch's)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: data, step")
    return p.parse_args(argv)


def data_config(args: argparse.Namespace, mode: str) -> Any:
    from pipeline.data.config import DataConfig

    return DataConfig(
        image_size=args.image_size,
        patch_size=args.patch_size,
        patches=mode,
        shuffle_buffer=args.shuffle_buffer,
        require_labels=False,
    )


def data_run(shards: list[str], config: Any, size: int) -> dict[str, float]:
    """One pass of a training rank's stream: images, real patch tokens, patch slots, seconds, CPU-seconds."""
    from jobs.benchmarks.process_cpu import process_tree_cpu
    from pipeline.data.dataset import build_dataset, by_token_budget, iter_batches, rebatch

    cpu = sum(process_tree_cpu().values())
    start = time.perf_counter()
    ds = build_dataset(shards, config, train=True, epoch=0)
    batches = iter_batches(ds, size, config, epoch=0, shuffle=True)
    stream = by_token_budget(batches, config, size) if config.native else rebatch(batches, size)
    images = tokens = slots = 0
    for batch in stream:
        images += len(batch["label"])
        if config.native:
            tokens += int(batch["mask"].sum())
            slots += batch["mask"].size
        else:
            tokens += batch["patches"].shape[0] * batch["patches"].shape[1]
            slots += batch["patches"].shape[0] * batch["patches"].shape[1]
    seconds = time.perf_counter() - start
    cpu_s = sum(process_tree_cpu().values()) - cpu
    return {"images": images, "tokens": tokens, "slots": slots, "seconds": seconds, "cpu_s": cpu_s}


def image_sizes(shards: list[str], config: Any) -> list[tuple[int, int]]:
    """Each benchmark image's (width, height), read from the headers."""
    import io

    from PIL import Image

    from pipeline.data.rows import read_shard

    sizes = []
    for url in shards:
        for table in read_shard(url, config.row_spec, config.block_rows):
            sizes += [Image.open(io.BytesIO(data)).size for data in table.column("image").to_pylist()]
    return sizes


def packing(grids: list[tuple[int, int]], size: int, budget: int, patch_size: int) -> dict[str, Any]:
    """The padding of these images' rows packed as training packs them, and at the full row width."""
    from pipeline.data import native

    def stream():
        for lo in range(0, len(grids), 64):
            images = [
                np.zeros((gh * patch_size, gw * patch_size, 3), np.uint8) for gh, gw in grids[lo : lo + 64]
            ]
            batch = native.native_rows(images, patch_size, budget)
            batch["key"] = np.arange(lo, lo + len(images))
            yield batch

    rows = list(stream())
    cpu = time.process_time()
    packed = list(native.pack(iter(rows), size, budget))
    pack_s = time.process_time() - cpu
    real = sum(int(b["mask"].sum()) for b in packed)
    slots = sum(b["mask"].size for b in packed)
    lengths = [gh * gw for gh, gw in grids]
    shapes = sorted({b["patches"].shape[:2] for b in packed})
    return {
        "packed_padding": 1 - real / slots,
        "full_width_padding": 1 - sum(lengths) / (len(lengths) * budget),
        "lengths": sorted({b["patches"].shape[1] for b in packed}),
        "shapes": [list(s) for s in shapes],
        "tokens_per_budget": float(np.mean([b["mask"].size for b in packed[:-1]]) / (size * budget)),
        "pack_cpu_ms_per_micro_batch": 1000 * pack_s / len(packed),  # the data thread's, of the rank
        "micro_batches": packed,
    }


def step_runs(
    args: argparse.Namespace, packed: list[dict[str, Any]], budget: int
) -> dict[str, dict[str, float]]:
    """The training step on square micro-batches and on the packed native ones, alternating."""
    import torch

    from pipeline.train.config import TrainConfig
    from pipeline.train.step.model import build_model, init_distributed
    from pipeline.train.step.objective import objective_for
    from pipeline.train.step.train_step import TrainStep

    if args.threads:
        torch.set_num_threads(args.threads)
    _, _, device = init_distributed()
    g = torch.Generator().manual_seed(0)
    runs: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        config = TrainConfig().replace(
            model=args.model, image_size=args.image_size, num_classes=1000, micro_batch_size=args.micro_batch_size,
            batch_size=args.micro_batch_size, num_workers=1, warmup_steps=1, max_steps=10**6, use_gpu=False,
            patches=mode,
        )  # fmt: skip
        objective = objective_for(config)
        model = build_model(config, device)
        k = objective.model_config.patch_dim
        if mode == "square":
            n = objective.model_config.num_patches
            batches = [
                (
                    torch.randint(0, 256, (args.micro_batch_size, n, k), dtype=torch.uint8, generator=g),
                    torch.randint(0, 1000, (args.micro_batch_size,), generator=g),
                )
            ]
            tokens = [args.micro_batch_size * n]
        else:
            batches, tokens = [], []
            for b in packed[:-1]:  # full micro-batches only
                rows, width = b["patches"].shape[:2]
                patches = torch.randint(0, 256, (rows, width, k), dtype=torch.uint8, generator=g)
                columns = (torch.from_numpy(b[c]) for c in ("coords", "mask", "grid"))
                batches.append((patches, *columns, torch.randint(0, 1000, (rows,), generator=g)))
                tokens.append(int(b["mask"].sum()))
        runs[mode] = {"step": TrainStep(model, config, device), "batches": batches, "tokens": tokens, "at": 0}
    timed: dict[str, list[tuple[float, int, int]]] = {mode: [] for mode in MODES}
    for i in range(args.warmup + args.steps):
        for mode in MODES:  # alternating: both meet the same background load
            run = runs[mode]
            j = run["at"] % len(run["batches"])
            run["at"] += 1
            batch = run["batches"][j]
            start, cpu = time.perf_counter(), time.process_time()
            run["step"](i, [batch], global_count=len(batch[-1]))
            if i >= args.warmup:
                timed[mode].append(
                    (time.perf_counter() - start, time.process_time() - cpu, run["tokens"][j], len(batch[-1]))
                )
    out = {}
    for mode, these in timed.items():
        # Medians of each step's rates: a step that met a burst of background load moves a mean, not them.
        out[mode] = {
            "tokens_per_s": statistics.median(r[2] / r[0] for r in these),
            "tokens_per_cpu_s": statistics.median(r[2] / r[1] for r in these),
            "images_per_s": statistics.median(r[3] / r[0] for r in these),
            "step_s_median": statistics.median(r[0] for r in these),
            # The least CPU a step of this mode took: what interference from other work can only raise.
            "tokens_per_cpu_s_best": max(r[2] / r[1] for r in these),
            "steps": len(these),
        }
    return out


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    from pipeline.data.shards import expand_shards

    scratch = tempfile.TemporaryDirectory(prefix="vitray-native-") if not args.shards else None
    shard_dir = Path(args.shards or scratch.name)
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards = expand_shards(make_mixed_aspect_shards(shard_dir, args.images, args.per_shard))
    square, native_config = (data_config(args, mode) for mode in MODES)
    budget = native_config.patch_budget
    figures: dict[str, Any] = {
        "budget_patches_per_image": budget,
        "micro_batch_tokens": args.micro_batch_size * budget,
        "aspects": ASPECTS,
        "cores": len(os.sched_getaffinity(0)),
    }
    from pipeline.data.native import native_grid

    sizes = image_sizes(shards, native_config)
    grids = [native_grid(w, h, budget) for w, h in sizes]  # each image whole, as evaluation takes it
    pack = packing(grids, args.micro_batch_size, budget, args.patch_size)
    packed = pack.pop("micro_batches")
    figures["packing"] = pack
    crop = square.crop_fraction
    figures["square_eval_share_seen"] = float(np.mean([crop**2 * min(w, h) / max(w, h) for w, h in sizes]))

    if "data" not in skip:
        import ray

        os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
        ray.init(include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        data_run(shards[:1], square, args.micro_batch_size)  # worker processes started, untimed
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode, config in zip(MODES, (square, native_config), strict=True):
                run = data_run(shards, config, args.micro_batch_size)
                runs[mode].append(run)
                print(
                    f"  run {repeat + 1}/{args.repeats} {mode:<7} {run['images'] / run['seconds']:6.0f} images/s",
                    flush=True,
                )
        ray.shutdown()
        rows = []
        for mode, these in runs.items():
            figures[f"data_{mode}"] = {
                "images_per_s": statistics.median(r["images"] / r["seconds"] for r in these),
                "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in these),
                "images_per_cpu_s": sum(r["images"] for r in these) / sum(r["cpu_s"] for r in these),
                "tokens_per_cpu_s": sum(r["tokens"] for r in these) / sum(r["cpu_s"] for r in these),
                "padding": 1 - sum(r["tokens"] for r in these) / sum(r["slots"] for r in these),
            }
            rows.append({"data stage": mode, **figures[f"data_{mode}"]})
        sq, na = figures["data_square"], figures["data_native"]
        ratios = {
            k: na[k] / sq[k] for k in ("images_per_s", "tokens_per_s", "images_per_cpu_s", "tokens_per_cpu_s")
        }
        figures["data_native_vs_square"] = ratios
        rows.append({"data stage": "native / square", **ratios})
        print_table(
            f"data stage, train transform, {args.image_size} px squares against native at most {budget} patches, "
            f"micro-batches of {args.micro_batch_size} x {budget} tokens (median of {args.repeats})",
            rows,
        )
    print_table(
        f"padding of native rows ({len(grids)} images, aspect ratios {', '.join(ASPECTS)}), budget {budget}",
        [
            {
                "batches": "packed (training)",
                "padding": pack["packed_padding"],
                "lengths": " ".join(map(str, pack["lengths"])),
            },
            {
                "batches": "full width (eval, embed)",
                "padding": pack["full_width_padding"],
                "lengths": str(budget),
            },
        ],
    )
    print(
        f"packing: {pack['pack_cpu_ms_per_micro_batch']:.2f} CPU-ms a micro-batch; "
        f"tokens per micro-batch against the budget: {pack['tokens_per_budget']:.1%}; a square eval crop "
        f"shows the model {figures['square_eval_share_seen']:.1%} of an image on average, a native row all of it"
    )
    if "step" not in skip:
        steps = step_runs(args, packed, budget)
        figures["step"] = steps
        rows = [{"training step": mode, **values} for mode, values in steps.items()]
        ratio = steps["native"]["tokens_per_s"] / steps["square"]["tokens_per_s"]
        per_cpu = steps["native"]["tokens_per_cpu_s"] / steps["square"]["tokens_per_cpu_s"]
        best = steps["native"]["tokens_per_cpu_s_best"] / steps["square"]["tokens_per_cpu_s_best"]
        rows.append(
            {"training step": "native / square", "tokens_per_s": ratio, "tokens_per_cpu_s": per_cpu,
             "tokens_per_cpu_s_best": best}
        )  # fmt: skip
        figures["step_native_vs_square"] = {"tokens_per_s": ratio, "tokens_per_cpu_s": per_cpu, "best": best}
        print_table(
            f"training step, {args.model}, fp32 on CPU, micro-batch of {args.micro_batch_size} x {budget} tokens, "
            f"steps alternating ({args.steps} each)",
            rows,
        )
    if scratch is not None:
        scratch.cleanup()
    if args.json:
        write_json(args.json, figures)
    return figures
