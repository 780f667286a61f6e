"""ViT forward+backward micro-benchmark, against transformers' ViT of the same size in the same run.

    python jobs/benchmark.py model --model vit_b16 --batch-size 128 --compile --compare-hf --json out.json
    python jobs/benchmark.py model --model vit_s16 --batch-size 8 --device cpu --iters 5 --compare-hf

One step = zero grads, forward, cross-entropy on random labels, backward (no optimizer step). The
two implementations' steps alternate and each reports its median step time. On CUDA: bf16 autocast over fp32 weights, timed with CUDA events; MFU is measured against this GPU's
own bf16 matmul rate (an 8192^3 matmul timed in the same run), with 3x the forward FLOPs of
`vit.count_flops` per image (activation recomputation not counted; `pipeline.train.observe.mfu`). On CPU:
fp32, wall-clock time.
Inputs are random: uint8 patches for vitray (its training input; `--input float` gives it float
images instead), float images for transformers. Imports no Ray.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import vit
from jobs.benchmarks.report import print_table, write_json
from jobs.benchmarks.timing import matmul_tflops
from pipeline.train.observe import mfu
from vit.parallelize import apply_activation_checkpointing, apply_compile


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python jobs/benchmark.py model", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit_b16", help=f"a vit.VARIANTS name: {', '.join(vit.VARIANTS)}")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="default: bf16 autocast on CUDA, fp32 on CPU")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile (vitray: per block; transformers: whole)"
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--input", choices=["uint8", "float"], default="uint8", help="vitray's input form")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--compare-hf", action="store_true", help="also measure transformers' ViT (sdpa attention)"
    )
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def training_step(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype | None
) -> Callable[[], None]:
    """One forward + backward of ``model`` on a fixed batch (bf16 autocast when ``dtype`` is set)."""
    device_type = inputs.device.type

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            logits = model(inputs)
            logits = logits.logits if hasattr(logits, "logits") else logits
        F.cross_entropy(logits.float(), labels).backward()

    return step


def hf_model(config: vit.ViTConfig, args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    hf_config = transformers.ViTConfig(
        image_size=config.image_size,
        patch_size=config.patch_size,
        num_channels=config.num_channels,
        hidden_size=config.embed_dim,
        num_hidden_layers=config.depth,
        num_attention_heads=config.num_heads,
        intermediate_size=config.mlp_dim,
        qkv_bias=config.qkv_bias,
        layer_norm_eps=config.norm_eps,
        num_labels=config.num_classes,
        attn_implementation="sdpa",
    )
    model = transformers.ViTForImageClassification(hf_config)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def timm_available() -> bool:
    """Whether timm imports here (for ``--compare-timm``); if not, one line saying why, and False."""
    if importlib.util.find_spec("timm") is None:
        print("timm is not installed: --compare-timm skipped (pip install timm)")
        return False
    try:
        import timm  # noqa: F401
    except Exception as e:  # e.g. a torchvision built for another torch: RuntimeError at import
        first_line = (str(e).strip().splitlines() or [""])[0]
        print(f"timm does not import ({type(e).__name__}: {first_line}): --compare-timm skipped")
        return False
    return True


def step_memory(
    step: Callable[[], None], models: list[torch.nn.Module], own: torch.nn.Module, device
) -> float:
    """GiB one step of ``own`` holds at its peak: its parameters, gradients, activations, workspace."""
    for m in models:  # no gradients left from earlier steps, of any model
        m.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)  # every model's parameters, the inputs
    step()
    torch.cuda.synchronize(device)
    own_bytes = sum(p.numel() * p.element_size() for p in own.parameters())
    return (torch.cuda.max_memory_allocated(device) - before + own_bytes) / 2**30


def interleaved_seconds(steps: dict[str, Callable[[], None]], iters: int, device: torch.device) -> dict:
    """Median seconds per step of each implementation, their steps alternating: ``{name: (wall, cpu)}``.

    Alternating, rather than timing one implementation after the other, exposes both to the same
    conditions (clock boost, thermal state, other load on a shared machine), which is what their
    ratio needs. On CPU the process's CPU time per step is reported too: on a machine shared with
    other work it varies far less than wall time.
    """
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize(device)
                wall[name].append(start.elapsed_time(end) / 1000)
            else:
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return {
        name: (statistics.median(wall[name]), statistics.median(cpu[name]) if cpu[name] else None)
        for name in steps
    }


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else None  # None: plain fp32
    torch.manual_seed(0)
    config = vit.get_config(args.model, image_size=args.image_size, num_classes=args.num_classes)
    b, c = args.batch_size, config
    labels = torch.randint(0, c.num_classes, (b,), device=device)
    images = torch.randn(b, c.num_channels, c.image_size, c.image_size, device=device)
    patches = torch.randint(0, 256, (b, c.num_patches, c.patch_dim), dtype=torch.uint8, device=device)

    model = vit.create_model(config, device=device)
    torch.nn.init.normal_(model.head.fc.weight, std=0.02)  # not the zero init: nothing trivial to time
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    if args.compile:
        apply_compile(model)  # per block, as training does
    models = {"vitray": (model, patches if args.input == "uint8" else images)}
    if args.compare_hf:
        hf = hf_model(config, args).to(device)
        models["transformers"] = (torch.compile(hf) if args.compile else hf, images)
    steps = {name: training_step(m.train(), x, labels, dtype) for name, (m, x) in models.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    memory = {}
    if device.type == "cuda":
        every = [m for m, _ in models.values()]
        for name, (m, _) in models.items():
            memory[name] = step_memory(steps[name], every, m, device)
    seconds = interleaved_seconds(steps, args.iters, device)

    flops = vit.count_flops(config)
    peak = matmul_tflops(device) if device.type == "cuda" and dtype is not None else None
    rows = []
    for name, (sec, cpu_sec) in seconds.items():
        row = {"impl": name, "step_ms": sec * 1e3, "images_per_s": b / sec}
        if cpu_sec is not None:
            row["cpu_ms"] = cpu_sec * 1e3  # process CPU time, all threads
        row["tflops"] = mfu.achieved_tflops(row["images_per_s"], mfu.train_flops(flops))
        if peak:
            row["mfu"] = mfu.mfu(row["images_per_s"], mfu.train_flops(flops), peak)
        if name in memory:
            row["peak_mem_gib"] = memory[name]
        rows.append(row)
    figures = {
        "benchmark": "model",
        "model": args.model,
        "image_size": args.image_size,
        "batch_size": b,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "dtype": dtype_name,
        "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing,
        "input": args.input,
        "warmup": args.warmup,
        "iters": args.iters,
        "gflops_per_image_forward": flops / 1e9,
        "matmul_bf16_tflops": peak,
        "rows": rows,
    }
    if args.compare_hf:
        figures["vitray_over_transformers"] = rows[0]["images_per_s"] / rows[1]["images_per_s"]
        if device.type == "cpu":
            figures["vitray_over_transformers_cpu_time"] = rows[1]["cpu_ms"] / rows[0]["cpu_ms"]
    title = f"{args.model} @ {args.image_size}px, batch {b}, {figures['device']}, {dtype_name}"
    title += ", compiled" * args.compile + ", activation checkpointing" * args.activation_checkpointing
    print_table(title + f" (median of {args.iters} interleaved steps)", rows)
    if args.compare_hf:
        print(f"\nvitray / transformers images/s: {figures['vitray_over_transformers']:.2f}")
        if device.type == "cpu":
            ratio = figures["vitray_over_transformers_cpu_time"]
            print(f"vitray / transformers, by CPU time per step: {ratio:.2f}")
    if peak:
        print(f"measured bf16 matmul rate: {peak:.0f} TFLOP/s (8192^3)")
    if args.json:
        write_json(args.json, figures)
    return figures
