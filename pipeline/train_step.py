"""The model setup and the optimizer step, without Ray.

Everything here runs under Ray Train workers, under `torchrun`, or in one plain process, which is
how `jobs/benchmark.py train` measures a variant on a bare GPU machine. Order of setup, fixed:
model on meta -> activation checkpointing -> per-block compile -> FSDP2 -> materialize -> init.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import vit
from pipeline.optim import build_optimizer, lr_factor
from pipeline.train_config import TrainConfig
from vit.parallelize import parallelize

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s), for MFU. Matched against
# torch.cuda.get_device_name(); the first matching key wins, so longer names come first.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM5
    "H200": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
}


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or start) the process group; returns (rank, world_size, device).

    Ray Train and torchrun set it up through the environment; a lone process gets a world of one,
    so FSDP2 and the step below run unchanged.
    """
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def model_config(config: TrainConfig) -> vit.ViTConfig:
    """The ViTConfig a training config resolves to (validates name and sizes)."""
    overrides = {"image_size": config.image_size, "num_classes": config.num_classes, **config.model_overrides}
    return vit.get_config(config.model, **overrides)


def build_model(config: TrainConfig, device: torch.device, mesh: DeviceMesh | None = None) -> nn.Module:
    """Model on meta -> AC -> compile -> FSDP2 -> materialized on `device` -> initialized."""
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    with torch.device("meta"):
        model = vit.VisionTransformer(model_config(config))
    # bf16 compute with fp32 gradient reduction on GPU; plain fp32 on CPU, where bf16 is slow.
    parallelize(
        model,
        mesh,
        activation_checkpointing=config.activation_checkpointing,
        compile=config.compile,
        param_dtype=torch.bfloat16 if device.type == "cuda" else None,
        reduce_dtype=torch.float32,
    )
    model.to_empty(device=device)
    # On CUDA, DTensor tracks RNG offsets, so a seeded draw gives each rank its slice of one full
    # tensor. On CPU it does not: every rank would draw the same numbers for its own shard, i.e.
    # identical halves of every weight (symmetric neurons), so there each rank seeds differently.
    torch.manual_seed(config.seed if device.type == "cuda" else config.seed + dist.get_rank())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.init_weights()
    return model


@dataclass
class StepStats:
    """Local sums for one optimizer step; reduce across ranks before reporting."""

    loss_sum: torch.Tensor  # sum of per-sample cross-entropy on this rank
    correct: torch.Tensor  # top-1 hits on this rank
    count: int  # samples on this rank
    grad_norm: torch.Tensor  # global (all ranks) gradient norm before clipping
    lr: float
    seconds: float  # compute time of the step on this rank


class TrainStep:
    """One optimizer step: forward/backward over micro-batches, sync on the last, clip, update."""

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device):
        self.model = model
        self.config = config
        self.device = device
        self.optimizer = build_optimizer(model, config)

    def __call__(
        self, step: int, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_count: int
    ) -> StepStats:
        """Run optimizer step `step` (0-based) over this rank's micro-batches of
        `(patches uint8 (B, N, K), labels (B,))`. The learning rate is a pure function of `step`
        (set here: no scheduler state to checkpoint).

        `global_count` is the number of samples in this step across all ranks: each rank scales
        its summed loss by world_size / global_count, so after FSDP2 averages gradients over ranks
        they are the gradient of the mean loss over every sample of the step, whatever the
        per-rank counts (corrupt samples make them uneven).
        """
        start = time.perf_counter()
        model, world = self.model, dist.get_world_size()
        scale = world / max(global_count, 1)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        count = 0
        for i, (patches, labels) in enumerate(micro_batches):
            # Reduce-scatter gradients only once, after the last micro-batch.
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            logits = model(patches).float()
            losses = F.cross_entropy(logits, labels, reduction="none")
            (losses.sum() * scale).backward()
            loss_sum += losses.detach().sum()
            correct += (logits.detach().argmax(-1) == labels).sum()
            count += labels.numel()
        if not micro_batches:
            # A rank without samples this step still joins the gradient reduce-scatter.
            model.set_requires_gradient_sync(True)
            _zero_grad_participation(model)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), self.config.grad_clip, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.config.lr * lr_factor(step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss_sum, correct, count, grad_norm.detach(), lr, time.perf_counter() - start)


def _zero_grad_participation(model: nn.Module) -> None:
    # A forward/backward whose loss is zero: FSDP2's collectives run, the gradients are zeros.
    param = next(model.parameters())
    dummy = torch.zeros(
        1, model.config.num_patches, model.config.patch_dim, dtype=torch.uint8, device=param.device
    )
    (model(dummy).float().sum() * 0.0).backward()


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    """(dense bf16 peak in TFLOP/s, where it comes from) for MFU; (None, why not) off GPU."""
    if device.type != "cuda":
        return None, "no MFU on CPU"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops, f"{name}: {tflops:.0f} TFLOP/s dense bf16 (datasheet)"
    return None, f"{name}: peak unknown, no MFU"


def train_flops_per_image(config: vit.ViTConfig) -> float:
    """Model FLOPs of one training image: forward + backward (2x forward). Recomputation from
    activation checkpointing is not counted, as is usual for MFU."""
    return 3.0 * vit.count_flops(config)
