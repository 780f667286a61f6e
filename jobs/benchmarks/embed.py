"""The embedding job against a naive single-process loop, on the same shards with the same model, in one run.

    python jobs/benchmark.py embed [--model vit_s16] [--image-size 224] [--images 256] [--json PATH] ...
    python jobs/benchmark.py embed --device cuda --naive-only --model vit_h14 --batch-size 256   # bare GPU box
    python jobs/benchmark.py embed --device cuda --model-only --compare-timm --model vit_h14 --batch-size 256

(a) model only: random uint8 patches straight into ``model.embed`` (no decode), the model built as the
    job's actor builds it (on CUDA: bf16 weights, ``embed`` compiled): the compute ceiling of this
    device for this model and batch size. With ``--compare-timm``, timm's ViT of the same shape
    (bf16 weights on CUDA, ``forward_features`` compiled) on float images, the two forwards alternating;
    ``--model-only`` stops after (a);
(b) naive loop: one process reads each shard (`pipeline.data.rows.read_shard`), decodes it with the job's
    eval transform (`pipeline.data.decode.preprocess_batch`), embeds in batches of ``--batch-size`` and
    writes one Parquet file per shard with pyarrow: what one would write without Ray;
(c) the job: `pipeline.embed.job.prepare` + `run`, the function ``jobs/embed.py`` runs, on a local Ray
    (``--decode gpu``: its images decoded by nvJPEG on the model actor's GPU).
    Its rate is taken between the first and the last shard commit ("steady", after the model actor
    has started) and over the whole run ("end to end", actor start included).

The model is exported with random weights via `vit.save_pretrained` (the job loads it as a user's
export). Shards are photo-like JPEGs of about 500x375 (as ``benchmark.py data`` writes them). Each
configuration runs ``--repeats`` times, interleaved; the table shows the median, and for (b) and (c)
the CPU seconds per image by process kind (a profile of where the time goes).

GPU: ``--device cuda`` runs (a) and (b) with bf16 autocast; the Ray half needs Ray, so on a machine
without it pass ``--naive-only``. The ceiling for ViT-H/14 at 224 px: 334.8 GFLOPs per image forward
(``vit.count_flops``); an H100 SXM's dense bf16 peak is 989 TFLOP/s, so 50% MFU is about 1,480
images/s per GPU, and (a) reports its MFU against that peak. Decoding 500x375 JPEGs runs at a few
hundred images/s per CPU core, so a GPU at that rate needs several cores' worth of decode tasks beside
it, which the job spreads over the cluster's CPUs and a naive loop cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

import vit
from jobs.benchmarks.model import timm_available
from jobs.benchmarks.process_cpu import RAY_KINDS
from jobs.benchmarks.report import print_table, write_json
from pipeline.embed.config import DECODERS, EmbedConfig
from pipeline.model_source import inference_model


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmark.py embed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_s16", help="a vit.VARIANTS name (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=224, help="input side in pixels (default: %(default)s)")
    p.add_argument(
        "--images", type=int, default=256, help="images in the benchmark shards (default: %(default)s)"
    )
    p.add_argument("--per-shard", type=int, default=32, help="images per shard (default: %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=32, help="images per forward, all runs (default: %(default)s)"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="model device (default: cpu)")
    p.add_argument("--naive-only", action="store_true", help="skip the Ray job (a machine without Ray)")
    p.add_argument("--model-only", action="store_true", help="only (a): no shards, no naive loop, no job")
    p.add_argument(
        "--compare-timm", action="store_true", help="(a) beside timm's compiled forward_features (needs timm)"
    )
    p.add_argument(
        "--concurrency", type=int, default=1, help="model actors of the job (default: %(default)s)"
    )
    p.add_argument(
        "--cpus-per-actor",
        type=float,
        help="CPUs (torch threads) per actor (default: all cores / --concurrency)",
    )
    p.add_argument("--ray-cpus", type=int, help="logical CPUs of the local Ray (default: actors' + 1)")
    p.add_argument(
        "--decode",
        default=EmbedConfig.decode,
        choices=DECODERS,
        help="where the job decodes: its --decode (gpu: nvJPEG on the actor's GPU; default: %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration (default: %(default)s)")
    p.add_argument(
        "--iters", type=int, default=10, help="forwards timed for the model-only rate (default: %(default)s)"
    )
    p.add_argument("--shards", metavar="DIR", help="write (or reuse) the shards here (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    return p.parse_args(argv)


def write_shards(directory: Path, images: int, per_shard: int) -> list[str]:
    try:
        from jobs.benchmarks.photos import make_photo_shards

        return make_photo_shards(directory, images, per_shard)
    except ImportError:  # no matplotlib (its sample photo) on a bare GPU machine: synthetic images
        from pipeline.data.synthetic import write_synthetic_shards

        return write_synthetic_shards(directory, images, samples_per_shard=per_shard, image_size=448).urls


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def model_only(model: vit.VisionTransformer, batch_size: int, iters: int, device: torch.device) -> float:
    """images/s of ``model.embed`` on random uint8 patches, after two warmup forwards."""
    c = model.config
    patches = torch.randint(
        0, 256, (batch_size, c.num_patches, c.patch_dim), dtype=torch.uint8, device=device
    )
    with torch.inference_mode(), autocast(device):
        for _ in range(2):
            model.embed(patches)
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            model.embed(patches)
        _sync(device)
    return iters * batch_size / (time.perf_counter() - start)


def actor_precision(device: torch.device) -> dict[str, Any]:
    """What the job's actor uses (`pipeline.embed.actor.Embedder`): bf16 weights and compile on CUDA."""
    cuda = device.type == "cuda"
    return {"dtype": torch.bfloat16 if cuda else torch.float32, "compile": cuda}


def compare_timm(model: vit.VisionTransformer, args: argparse.Namespace, device: torch.device) -> dict:
    """Median seconds per forward of vitray's ``embed`` (uint8 patches) and timm's ``forward_features``
    (float images) of the same shape and weight dtype, compiled alike, their forwards alternating."""
    import timm

    from jobs.benchmarks.model import interleaved_seconds

    c, precision = model.config, actor_precision(device)
    theirs = timm.create_model(
        "vit_base_patch16_224",  # a name for the family: every size below overrides its own
        pretrained=False, img_size=c.image_size, patch_size=c.patch_size, embed_dim=c.embed_dim,
        depth=c.depth, num_heads=c.num_heads, mlp_ratio=c.mlp_dim / c.embed_dim, qkv_bias=c.qkv_bias,
        num_classes=0, global_pool="token",
    ).to(device, precision["dtype"]).eval()  # fmt: skip
    features = torch.compile(theirs.forward_features) if precision["compile"] else theirs.forward_features
    b = args.batch_size
    patches = torch.randint(0, 256, (b, c.num_patches, c.patch_dim), dtype=torch.uint8, device=device)
    images = torch.randn(
        b, c.num_channels, c.image_size, c.image_size, device=device, dtype=precision["dtype"]
    )

    def ours() -> None:
        with torch.inference_mode():
            model.embed(patches)

    def timm_forward() -> None:
        with torch.inference_mode():
            features(images)

    steps = {"vitray embed": ours, "timm forward_features": timm_forward}
    for step in steps.values():
        for _ in range(2):
            step()
    return {name: wall for name, (wall, _) in interleaved_seconds(steps, args.iters, device).items()}


def naive_loop(shards: list[str], data_config: Any, model: vit.VisionTransformer, args, out: Path) -> int:
    """Read -> decode -> embed -> one Parquet file per shard, in this process; returns images read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.decode import preprocess_batch
    from pipeline.data.rows import read_shard
    from pipeline.embed.output import embedding_table, output_name

    device, count = torch.device(args.device), 0
    for url in shards:
        block = pa.concat_tables(read_shard(url, data_config.row_spec, data_config.block_rows))
        batch = {name: block.column(name).to_numpy(zero_copy_only=False) for name in block.column_names}
        rows = preprocess_batch(batch, config=data_config, train=False, epoch=0)
        good = np.array([not e for e in rows["error"]])
        patches = torch.from_numpy(rows["patches"][good])
        embeddings = []
        with torch.inference_mode(), autocast(device):
            for lo in range(0, len(patches), args.batch_size):
                chunk = patches[lo : lo + args.batch_size].to(device)
                embeddings.append(model.embed(chunk).float().cpu().numpy())
        keys = rows["key"][good]
        table = embedding_table(keys, [url] * len(keys), np.concatenate(embeddings), rows["label"][good], {})
        pq.write_table(table, out / output_name(url), compression="zstd")
        count += len(rows["key"])
    return count


def job_run(config: Any) -> tuple[int, float, float]:
    """The job on the connected Ray: (images, end-to-end seconds, steady seconds). Steady time starts
    when the first embeddings reach the driver, i.e. once the model actors have started."""
    from pipeline.embed.job import prepare, run

    summary = run(prepare(config))
    return summary.bad_samples["total"], summary.seconds, summary.seconds - summary.startup_s


def main(argv: list[str]) -> dict[str, Any]:
    from jobs.benchmarks.process_cpu import process_tree_cpu
    from pipeline.data.config import DataConfig

    args = parse_args(argv)
    device = torch.device(args.device)
    cores = len(os.sched_getaffinity(0))
    scratch = tempfile.TemporaryDirectory(prefix="vitray-bench-embed-")
    shards: list[str] = []
    if not args.model_only:
        shard_dir = Path(args.shards or Path(scratch.name) / "shards")
        shard_dir.mkdir(parents=True, exist_ok=True)
        shards = sorted(write_shards(shard_dir, args.images, args.per_shard))
        print(f"{len(shards)} shards of {args.per_shard} images in {shard_dir}")

    torch.manual_seed(0)
    config = vit.get_config(args.model, image_size=args.image_size)
    export = Path(scratch.name) / "export"
    vit.save_pretrained(export, vit.VisionTransformer(config).state_dict(), config)
    model, _ = vit.load_pretrained(export)
    model = model.to(device).eval()
    data_config = DataConfig(image_size=config.image_size, patch_size=config.patch_size, require_labels=False)

    actor_model = inference_model(config, model.state_dict(), device, **actor_precision(device))
    ceiling = model_only(actor_model, args.batch_size, args.iters, device)
    flops = vit.count_flops(config)
    rows: list[dict[str, Any]] = [
        {"run": "model only (no decode)", "images/s": ceiling, "runs": "", "CPU-ms/image by process": ""}
    ]
    figures: dict[str, Any] = {
        "benchmark": "embed",
        "model": args.model,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "device": args.device + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "dtype": "bf16 autocast (model only: bf16 weights, compiled)" if device.type == "cuda" else "fp32",
        "cores": cores,
        "images": args.images,
        "gflops_per_image": flops / 1e9,
        "model_only_images_per_s": ceiling,
    }
    if device.type == "cuda":
        from pipeline.train.observe import mfu

        peak, _ = mfu.peak_tflops(device)
        if peak:  # inference: the forward's FLOPs alone
            figures["model_only_mfu"] = rows[0]["mfu"] = mfu.mfu(ceiling, flops, peak)

    if args.compare_timm and timm_available():
        seconds = compare_timm(actor_model, args, device)
        for name, sec in seconds.items():
            rows.append({"run": f"model only, {name}", "images/s": args.batch_size / sec, "runs": ""})
        figures["vitray_over_timm_model_only"] = seconds["timm forward_features"] / seconds["vitray embed"]
        rows.append({"run": "vitray / timm (model only)", "images/s": figures["vitray_over_timm_model_only"]})
    if args.model_only:
        print_table(
            f"embedding {args.model} @ {args.image_size}px, batch {args.batch_size}, model only", rows
        )
        if args.json:
            write_json(args.json, figures)
        scratch.cleanup()
        return figures

    runs: dict[str, list[float]] = {"naive": []}
    cpu: dict[str, dict[str, float]] = {"naive": {}, "job": {}}
    counts = {"naive": 0, "job": 0}
    job_config = None
    if not args.naive_only:
        import ray

        cpus = args.cpus_per_actor or max(1, cores // args.concurrency)
        os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
        ray.init(
            num_cpus=args.ray_cpus or int(args.concurrency * cpus) + 1,
            include_dashboard=False,
            log_to_driver=False,
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
        job_config = EmbedConfig(
            data=",".join(shards),
            weights=str(export),
            out=str(Path(scratch.name) / "job"),
            batch_size=args.batch_size,
            concurrency=args.concurrency,
            cpus_per_actor=cpus,
            use_gpu=device.type == "cuda",
            label_key=None,
            overwrite=True,
            decode=args.decode,
        )
        job_run(job_config.replace(data=shards[0]))  # Ray's worker processes started, untimed
        runs.update({"job steady": [], "job end to end": []})
    naive_out = Path(scratch.name) / "naive"
    naive_out.mkdir()
    for repeat in range(args.repeats):
        before = process_tree_cpu()
        start = time.perf_counter()
        n = naive_loop(shards, data_config, model, args, naive_out)
        runs["naive"].append(n / (time.perf_counter() - start))
        _add_cpu(cpu["naive"], before, process_tree_cpu(), exclude=RAY_KINDS)
        counts["naive"] += n
        print(f"  run {repeat + 1}/{args.repeats} naive loop {runs['naive'][-1]:8.1f} images/s", flush=True)
        if job_config is not None:
            before = process_tree_cpu()
            n, seconds, steady_seconds = job_run(job_config)
            _add_cpu(cpu["job"], before, process_tree_cpu())
            counts["job"] += n
            # The first batch's images count as startup too; their share of n is one batch.
            runs["job steady"].append(max(n - args.batch_size, 1) / steady_seconds)
            runs["job end to end"].append(n / seconds)
            print(
                f"  run {repeat + 1}/{args.repeats} job        {runs['job steady'][-1]:8.1f} images/s steady",
                flush=True,
            )

    for name, rates in runs.items():
        kind = "naive" if name == "naive" else "job"
        per_image = {
            k: 1e3 * v / max(counts[kind], 1) for k, v in sorted(cpu[kind].items(), key=lambda kv: -kv[1])
        }
        row = {"run": name, "images/s": statistics.median(rates), "runs": " ".join(f"{r:.1f}" for r in rates)}
        row["CPU-ms/image by process"] = ", ".join(f"{k} {v:.0f}" for k, v in per_image.items() if v >= 1)
        rows.append(row)
        figures[f"{name.replace(' ', '_')}_images_per_s"] = row["images/s"]
        figures[f"{kind}_cpu_ms_per_image"] = per_image
    if job_config is not None:
        figures["job_vs_naive"] = figures["job_steady_images_per_s"] / figures["naive_images_per_s"]
        rows.append({"run": "job steady / naive", "images/s": figures["job_vs_naive"], "runs": ""})
        ray.shutdown()
    print_table(
        f"embedding {args.model} @ {args.image_size}px, batch {args.batch_size}, {figures['device']}, "
        f"{figures['dtype']}, {cores} cores (median of {args.repeats})",
        rows,
    )
    if args.json:
        write_json(args.json, figures)
    scratch.cleanup()
    return figures


def _add_cpu(total: dict[str, float], before: dict, after: dict, exclude: tuple[str, ...] = ()) -> None:
    for kind, value in after.items():
        if kind not in exclude:
            total[kind] = total.get(kind, 0.0) + value - before.get(kind, 0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
