"""One FSDP2 training step of a ViT, without Ray: images/s, MFU and peak memory per configuration.

    python jobs/benchmark.py train --model vit_h14 --micro-batch-size 64 --configs eager,compile,ac,compile+ac
    python jobs/benchmark.py train --model vit_b16 --micro-batch-size 128 --configs compile --compare-timm
    python jobs/benchmark.py train --model vit_h14 --micro-batch-size 64 --configs compile --trace step.json
    torchrun --nproc-per-node 8 jobs/benchmark.py train --model vit_h14 --micro-batch-size 64   # 8 GPUs

The step is `pipeline.train.step.train_step.TrainStep`, what every Ray Train worker runs: FSDP2 (bf16 compute
and fp32 gradient reduction on CUDA, fp32 on CPU), AdamW, global-norm clipping; the input is random
uint8 patches, so this measures the model and the step alone (`benchmark.py data` measures input).
A configuration joins switches with `+` (`compile+ac-ops+fp8`): `eager`, `compile` (per block) or
`compile-model` (whole forward); `ac`, `ac-alternate` or `ac-ops` (activation checkpointing modes);
`fp8` (float8 Linears); `fused`, `foreach` or `for-loop` (AdamW kernels; default: the run's `auto`).
`--compare-timm` runs timm's ViT of the same size beside each configuration (bf16 autocast, fused
AdamW on CUDA, clipping, `torch.compile` of the whole model when the configuration compiles), the
two steps alternating (one process, one GPU; skipped with a note where timm is not installed).
`--ema DECAY` runs, beside each configuration, the same step followed by an update of the EMA of the
weights (`pipeline.train.step.ema`, every step), the two alternating on one model, and prints the ratio.
`--trace PATH` writes a torch.profiler trace of one step of the first configuration (chrome://tracing
or Perfetto), to see where a step's time goes. `--largest-micro-batch LIMIT` first searches, for each
configuration, the largest micro-batch (a multiple of 8, at most LIMIT) whose steps run without running
out of device memory (doubling from `--micro-batch-size`, then bisecting; one process), and measures
the configuration there.
MFU (`pipeline.train.observe.mfu`) counts model FLOPs (3 x `vit.count_flops` per image; recomputation not
counted) against two ceilings: the GPU's datasheet dense bf16 peak, and its bf16 matmul rate measured
in the same run.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import vit
from jobs.benchmarks.model import interleaved_seconds, timm_available
from jobs.benchmarks.report import print_table, write_json
from jobs.benchmarks.timing import matmul_tflops, time_step
from pipeline import compat
from pipeline.train.config import TrainConfig
from pipeline.train.observe import mfu
from pipeline.train.step.ema import WeightEMA
from pipeline.train.step.model import build_model, init_distributed
from pipeline.train.step.objective import Objective, objective_for
from pipeline.train.step.optim import optimizer_kernels
from pipeline.train.step.train_step import TrainStep

CONFIGS = ("eager", "compile", "ac", "compile+ac")  # the usual ones; any `+` join of SWITCHES works
# What each switch of a configuration name sets in the TrainConfig.
SWITCHES = {
    "eager": {},
    "compile": {"compile": True, "compile_scope": "blocks"},
    "compile-model": {"compile": True, "compile_scope": "model"},
    "ac": {"activation_checkpointing": True, "ac_mode": "full"},
    "ac-alternate": {"activation_checkpointing": True, "ac_mode": "alternate"},
    "ac-ops": {"activation_checkpointing": True, "ac_mode": "ops"},
    "fp8": {"fp8": True},
    "fused": {"optimizer_impl": "fused"},
    "foreach": {"optimizer_impl": "foreach"},
    "for-loop": {"optimizer_impl": "for-loop"},
}


def switches(name: str) -> dict:
    """A configuration name (`compile+ac-ops`) -> the TrainConfig fields it sets."""
    fields: dict = {}
    for part in name.split("+"):
        if part not in SWITCHES:
            raise SystemExit(
                f"error: unknown switch {part!r} in --configs {name!r}; choose from {', '.join(SWITCHES)}"
            )
        fields.update(SWITCHES[part])
    return fields


def largest_micro_batch(fits: Callable[[int], bool], start: int, limit: int, multiple: int = 8) -> int | None:
    """The largest micro-batch `fits` accepts, at most `limit` and a multiple of `multiple` (or `start`):
    double from `start` until a size fails, then bisect between the last that fit and the first that did
    not. `fits` must be monotone (a size that fits, every smaller one does). None when `start` fails."""
    if not fits(start):
        return None
    good, bad = start, None
    while bad is None:
        size = min(good * 2, limit)
        if size == good:
            return good
        good, bad = (size, None) if fits(size) else (good, size)
    while True:
        middle = (good + bad) // 2 // multiple * multiple
        if middle <= good:
            return good
        good, bad = (middle, bad) if fits(middle) else (good, middle)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python jobs/benchmark.py train", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_b16", help=f"a vit.VARIANTS name: {', '.join(vit.VARIANTS)}")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--micro-batch-size", type=int, default=32, help="images per GPU (or process) per step")
    p.add_argument(
        "--configs", default="eager,compile", help=f"comma-separated, each a + join of: {', '.join(SWITCHES)}"
    )
    p.add_argument(
        "--accum", type=int, default=1,
        help="micro-batches a step (gradient accumulation): the job's --batch-size over --micro-batch-size x devices",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument(
        "--compare-timm", action="store_true", help="timm's ViT of the same size, steps alternating"
    )
    p.add_argument(
        "--objective", default="supervised", choices=("supervised", "mae"),
        help="supervised (classifier head) or mae (encoder on the visible patches + decoder; MFU with MAE's FLOPs)",
    )  # fmt: skip
    p.add_argument(
        "--mask-ratio", type=float, default=0.75, help="share of patches hidden with --objective mae"
    )
    p.add_argument(
        "--ema", type=float, metavar="DECAY",
        help="also time each step followed by an EMA update of the weights (every step), steps alternating",
    )  # fmt: skip
    p.add_argument("--trace", metavar="PATH", help="write a torch.profiler trace (JSON) of one step")
    p.add_argument(
        "--largest-micro-batch", type=int, metavar="LIMIT",
        help="measure each configuration at the largest micro-batch (a multiple of 8, <= LIMIT) that fits",
    )  # fmt: skip
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def train_config(args: argparse.Namespace, name: str, world: int) -> TrainConfig:
    return TrainConfig().replace(
        model=args.model,
        image_size=args.image_size,
        num_classes=args.num_classes,
        micro_batch_size=args.micro_batch_size,
        batch_size=args.micro_batch_size * getattr(args, "accum", 1) * world,
        num_workers=world,
        warmup_steps=1,
        max_steps=10**6,
        objective=args.objective,
        mask_ratio=args.mask_ratio,
        **switches(name),
    )


def steps_fit(args: argparse.Namespace, name: str, device: torch.device, micro_batch: int) -> bool:
    """Whether two steps of configuration `name` (the second with AdamW's state allocated) run at
    `micro_batch` images without running out of device memory."""
    sized = argparse.Namespace(**{**vars(args), "micro_batch_size": micro_batch})
    config = train_config(sized, name, world=1)
    try:
        model = build_model(config, device)
        step = TrainStep(model, config, device)
        g = torch.Generator(device="cpu").manual_seed(0)
        batch = tuple(t.to(device) for t in random_batch(objective_for(config), micro_batch, g))
        for i in range(2):
            step(i, [batch], global_count=micro_batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        model = step = batch = None  # freed before the next size is tried
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure(
    args: argparse.Namespace, name: str, device: torch.device, world: int, trace: str | None
) -> list[dict]:
    """One configuration's rows: vitray's step, and timm's beside it with --compare-timm."""
    config = train_config(args, name, world)
    objective = objective_for(config)
    model = build_model(config, device)
    step = TrainStep(model, config, device)
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    batch = tuple(t.to(device) for t in random_batch(objective, args.micro_batch_size, g))
    counter = iter(range(10**9))
    images = args.micro_batch_size * args.accum  # a step's, on each device

    def one_step() -> None:
        # The job's step at its accumulation: ``accum`` forward/backward passes, one update.
        step(next(counter), [batch] * args.accum, global_count=images * world, micro_steps=args.accum)

    steps = {name: one_step}
    kernels = {name: optimizer_kernels(step.optimizer)}
    mcfg = objective.model_config
    if args.compare_timm and args.objective != "supervised":
        print("timm has no MAE decoder: --compare-timm skipped for --objective mae")
    elif args.compare_timm and world == 1 and timm_available():
        steps[f"timm ({name})"], kernels[f"timm ({name})"] = timm_step(
            config, mcfg, args.micro_batch_size, device
        )
    if args.ema is not None:
        ema = WeightEMA(model, args.ema)

        def step_and_ema() -> None:
            one_step()
            ema.update(1)

        steps[f"{name}+ema"], kernels[f"{name}+ema"] = step_and_ema, kernels[name]
    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    if trace:
        write_trace(one_step, trace, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if len(steps) == 1:
        seconds = {name: time_step(one_step, warmup=0, iters=args.iters, device=device)}
    else:  # alternating, so both see the same clocks and temperature
        seconds = {k: wall for k, (wall, _) in interleaved_seconds(steps, args.iters, device).items()}
    # With timm beside it the peak holds both models: reported only for vitray alone.
    peak_gib = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" and len(steps) == 1 else None
    )
    rows = []
    for label, sec in seconds.items():
        per_device = (images if label in (name, f"{name}+ema") else args.micro_batch_size) / sec
        rows.append({"config": label, "micro_batch_size": args.micro_batch_size,
                     "images_per_s": per_device * world, "images_per_s_per_device": per_device,
                     "step_ms": sec * 1e3, "flops_per_image": objective.flops_per_image(),
                     "optimizer": kernels[label], "peak_gib": peak_gib if label == name else None})  # fmt: skip
    return rows


def random_batch(objective: Objective, size: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One micro-batch of random input in the objective's columns: supervised (patches, labels); MAE
    (visible, masked, ids_shuffle), the form the data stage's mask gives."""
    c = objective.model_config
    if objective.name == "supervised":
        patches = torch.randint(0, 256, (size, c.num_patches, c.patch_dim), dtype=torch.uint8, generator=g)
        return patches, torch.randint(0, c.num_classes, (size,), generator=g)
    n = objective.num_visible
    ids = torch.stack([torch.randperm(c.num_patches, generator=g) for _ in range(size)])  # visible first
    visible = torch.randint(0, 256, (size, n, c.patch_dim), dtype=torch.uint8, generator=g)
    masked = torch.randint(0, 256, (size, c.num_patches - n, c.patch_dim), dtype=torch.uint8, generator=g)
    return visible, masked, ids


def timm_step(
    config: TrainConfig, mcfg: vit.ViTConfig, batch: int, device: torch.device
) -> tuple[Callable[[], None], str]:
    """timm's ViT of the same shape trained the way timm's own script does: bf16 autocast on CUDA,
    fused AdamW (foreach on CPU), global-norm clipping, the whole model compiled when `config` compiles.
    Its input is float images (B, C, H, W), its usual form. Returns (one step, the AdamW kernels)."""
    import timm

    model = timm.create_model(
        "vit_base_patch16_224",  # a name for the family: every size below overrides its own
        pretrained=False,
        img_size=mcfg.image_size,
        patch_size=mcfg.patch_size,
        embed_dim=mcfg.embed_dim,
        depth=mcfg.depth,
        num_heads=mcfg.num_heads,
        mlp_ratio=mcfg.mlp_dim / mcfg.embed_dim,
        qkv_bias=mcfg.qkv_bias,
        num_classes=mcfg.num_classes,
        global_pool="token",
    ).to(device)
    if config.speed.activation_checkpointing:
        model.set_grad_checkpointing(True)
    forward = torch.compile(model) if config.speed.compile else model
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optim.lr, betas=config.optim.betas, weight_decay=config.optim.weight_decay,
        fused=fused, foreach=not fused,
    )  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(1)
    images = torch.randn(batch, mcfg.num_channels, mcfg.image_size, mcfg.image_size, generator=g).to(device)
    labels = torch.randint(0, mcfg.num_classes, (batch,), generator=g).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = forward(images)
        F.cross_entropy(logits.float(), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, "fused" if fused else "foreach"


def write_trace(step: Callable[[], None], path: str, device: torch.device) -> None:
    """A torch.profiler trace of one step as chrome-trace JSON (rank 0 only)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        print(f"wrote a profiler trace of one step to {path}")


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    names = [n.strip() for n in args.configs.split(",")]
    for name in names:
        switches(name)  # an unknown switch fails here, before any model is built
    rank, world, device = init_distributed()
    if args.compare_timm and world > 1 and rank == 0:
        print("--compare-timm runs in a single process (timm's script has no FSDP): skipped")
    peak, peak_note = mfu.peak_tflops(device)
    measured = matmul_tflops(device) if device.type == "cuda" else None
    if args.largest_micro_batch and world > 1:
        raise SystemExit("error: --largest-micro-batch searches in one process; run it without torchrun")
    rows = []
    for i, name in enumerate(names):
        sized = args
        if args.largest_micro_batch:
            found = largest_micro_batch(
                lambda size, name=name: steps_fit(args, name, device, size),
                args.micro_batch_size,
                args.largest_micro_batch,
            )
            if found is None:
                print(f"{name}: {args.micro_batch_size} images do not fit; lower --micro-batch-size")
                continue
            print(f"{name}: largest micro-batch that fits: {found} (search limit {args.largest_micro_batch})")
            sized = argparse.Namespace(**{**vars(args), "micro_batch_size": found})
        rows.extend(measure(sized, name, device, world, args.trace if i == 0 else None))
        # The last configuration's model and optimizer state go before the next is built, and so do
        # its compiled graphs: each new model would otherwise count as a recompile of the same code,
        # and past dynamo's limit (8) a later configuration would run eager under a compiled name.
        compat.forget_compiled_graphs()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        per_device, flops = row["images_per_s_per_device"], row["flops_per_image"]
        row["mfu_datasheet"] = mfu.mfu(per_device, flops, peak)
        row["mfu_measured"] = mfu.mfu(per_device, flops, measured)
    figures = {
        "benchmark": "train",
        "model": args.model,
        "objective": args.objective,
        "mask_ratio": args.mask_ratio if args.objective == "mae" else None,
        "image_size": args.image_size,
        "micro_batch_size": args.micro_batch_size,
        "accum": args.accum,
        "world_size": world,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "peak": peak_note,
        "matmul_tflops_measured": measured,
        "results": rows,
    }
    by_name = {r["config"]: r["images_per_s"] for r in rows}
    figures["vitray_over_timm"] = {
        name: by_name[name] / by_name[f"timm ({name})"] for name in names if f"timm ({name})" in by_name
    }
    figures["ema_step_time_ratio"] = {
        name: by_name[name] / by_name[f"{name}+ema"] for name in names if f"{name}+ema" in by_name
    }
    if rank == 0:
        table = [
            {
                "config": r["config"],
                "micro-batch": r["micro_batch_size"],
                "img/s": r["images_per_s"],
                "img/s/device": r["images_per_s_per_device"],
                "step ms": r["step_ms"],
                "MFU (datasheet)": _pct(r["mfu_datasheet"]),
                "MFU (measured mm)": _pct(r["mfu_measured"]),
                "peak GiB": r["peak_gib"],
                "AdamW": r["optimizer"],
            }
            for r in rows
        ]
        title = (
            f"{args.model} @ {args.image_size}px, {args.micro_batch_size} images/device"
            f"{f' x {args.accum} micro-batches a step' if args.accum > 1 else ''}, {world} x {figures['device']}"
        )
        print_table(title, table)
        print(f"ceilings: {peak_note}; measured bf16 matmul: {measured and f'{measured:.0f} TFLOP/s'}")
        for name, ratio in figures["vitray_over_timm"].items():
            print(f"vitray / timm images/s, {name}: {ratio:.2f} (median of {args.iters} alternating steps)")
        for name, ratio in figures["ema_step_time_ratio"].items():
            print(
                f"step time with / without the EMA update, {name}: {ratio:.3f} (median of {args.iters} alternating)"
            )
        if args.json:
            write_json(args.json, figures)
    dist.destroy_process_group()
    return figures


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
