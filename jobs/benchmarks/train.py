"""One FSDP2 training step of a ViT, without Ray: images/s, MFU and peak memory per configuration.

    python jobs/benchmark.py train --model vit_h14 --micro-batch-size 64 --configs eager,compile,ac,compile+ac
    torchrun --nproc-per-node 8 jobs/benchmark.py train --model vit_h14 --micro-batch-size 64   # 8 GPUs

The step is `pipeline.train.step.TrainStep`, what every Ray Train worker runs: FSDP2 (bf16 compute
and fp32 gradient reduction on CUDA, fp32 on CPU), AdamW, global-norm clipping; the input is random
uint8 patches, so this measures the model and the step alone (`benchmark.py data` measures input).
A configuration is `eager` or `compile`, optionally `+ac` (activation checkpointing per block).
MFU counts model FLOPs (3 x `vit.count_flops` per image; recomputation not counted) against two
ceilings: the GPU's datasheet dense bf16 peak, and its bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist

import vit
from jobs.benchmarks.report import print_table, write_json
from jobs.benchmarks.timing import matmul_tflops, time_step
from pipeline.train.config import TrainConfig
from pipeline.train.model import build_model, init_distributed, model_config
from pipeline.train.step import TrainStep, peak_tflops, train_flops_per_image

CONFIGS = ("eager", "compile", "ac", "compile+ac")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python jobs/benchmark.py train", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_b16", help=f"a vit.VARIANTS name: {', '.join(vit.VARIANTS)}")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--micro-batch-size", type=int, default=32, help="images per GPU (or process) per step")
    p.add_argument("--configs", default="eager,compile", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, name: str, device: torch.device, world: int) -> dict:
    config = TrainConfig(
        model=args.model,
        image_size=args.image_size,
        num_classes=args.num_classes,
        micro_batch_size=args.micro_batch_size,
        batch_size=args.micro_batch_size * world,
        num_workers=world,
        warmup_steps=1,
        max_steps=10**6,
        compile="compile" in name,
        activation_checkpointing=name.endswith("ac"),
    )
    mcfg = model_config(config)
    model = build_model(config, device)
    step = TrainStep(model, config, device)
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    shape = (args.micro_batch_size, mcfg.num_patches, mcfg.patch_dim)
    patches = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
    labels = torch.randint(0, config.num_classes, (args.micro_batch_size,), generator=g).to(device)
    counter = iter(range(10**9))

    def one_step() -> None:
        step(next(counter), [(patches, labels)], global_count=args.micro_batch_size * world)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = time_step(one_step, warmup=args.warmup, iters=args.iters, device=device)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    per_device = args.micro_batch_size / seconds
    return {"config": name, "images_per_s": per_device * world, "images_per_s_per_device": per_device,
            "step_ms": seconds * 1e3, "flops_per_image": train_flops_per_image(mcfg), "peak_gib": peak_gib}  # fmt: skip


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    names = [n.strip() for n in args.configs.split(",")]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"error: unknown --configs {unknown}; choose from {', '.join(CONFIGS)}")
    rank, world, device = init_distributed()
    peak, peak_note = peak_tflops(device)
    measured = matmul_tflops(device) if device.type == "cuda" else None
    rows = []
    for name in names:
        rows.append(measure(args, name, device, world))
        gc.collect()  # the last configuration's model and optimizer state go before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        achieved = row["images_per_s_per_device"] * row["flops_per_image"] / 1e12
        row["mfu_datasheet"] = achieved / peak if peak else None
        row["mfu_measured"] = achieved / measured if measured else None
    figures = {
        "benchmark": "train",
        "model": args.model,
        "image_size": args.image_size,
        "micro_batch_size": args.micro_batch_size,
        "world_size": world,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "peak": peak_note,
        "matmul_tflops_measured": measured,
        "results": rows,
    }
    if rank == 0:
        table = [
            {
                "config": r["config"],
                "img/s": r["images_per_s"],
                "img/s/device": r["images_per_s_per_device"],
                "step ms": r["step_ms"],
                "MFU (datasheet)": _pct(r["mfu_datasheet"]),
                "MFU (measured mm)": _pct(r["mfu_measured"]),
                "peak GiB": r["peak_gib"],
            }
            for r in rows
        ]
        title = f"{args.model} @ {args.image_size}px, {args.micro_batch_size} images/device, {world} x {figures['device']}"
        print_table(title, table)
        print(f"ceilings: {peak_note}; measured bf16 matmul: {measured and f'{measured:.0f} TFLOP/s'}")
        if args.json:
            write_json(args.json, figures)
    dist.destroy_process_group()
    return figures


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
