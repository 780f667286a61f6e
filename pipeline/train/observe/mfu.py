"""Model FLOPs utilization (MFU): the model FLOP/s a run achieves over what its devices could do.

    mfu = images/s x model FLOPs per image / (devices x peak FLOP/s per device)

Model FLOPs count what the model needs, not what the run computes: a training image costs its
forward's FLOPs (`vit.count_flops`, `vit.count_mae_flops`) three times over (forward, and a backward
of twice as many, `train_flops`); recomputation under activation checkpointing is not counted, as is
usual for MFU. An inference image costs its forward's. The peak is the vendor's dense bf16 figure for
exactly the GPU torch reports (`peak_tflops`); the benchmarks may put a measured matmul rate in its
place (`jobs.benchmarks.timing.matmul_tflops`).

The one home of the three: the training metrics (`pipeline.train.observe.metrics`), the objectives' FLOPs per
image (`pipeline.train.step.objective`) and the benchmarks (`jobs/benchmarks/`) all take them from here.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s), keyed by the exact name
# torch.cuda.get_device_name() reports. Exact, not by substring: "NVIDIA L4" is inside "NVIDIA L40S",
# and an H100 NVL or PCIe card is not the SXM part; a name missing here gets no MFU rather than
# another part's peak (add it from its datasheet: half the "with sparsity" figure).
PEAK_BF16_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM5
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,  # SXM
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L40": 181.0,
    "NVIDIA L4": 121.0,
    "NVIDIA A10G": 70.0,
}


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    """(dense bf16 peak in TFLOP/s, where it comes from) for MFU; (None, why not) off GPU."""
    if device.type != "cuda":
        return None, "no MFU on CPU"
    name = torch.cuda.get_device_name(device)
    tflops = PEAK_BF16_TFLOPS.get(name.strip())
    if tflops is None:
        return None, f"{name}: unknown GPU, MFU not reported"
    return tflops, f"{name}: {tflops:.0f} TFLOP/s dense bf16 (datasheet)"


def train_flops(forward_flops: float) -> float:
    """Model FLOPs of one training image from its forward's: forward + backward (2x forward)."""
    return 3.0 * forward_flops


def achieved_tflops(images_per_s: float, flops_per_image: float) -> float:
    """Model TFLOP/s done at ``images_per_s``."""
    return images_per_s * flops_per_image / 1e12


def mfu(images_per_s: float, flops_per_image: float, peak: float | None, devices: int = 1) -> float | None:
    """The share of ``devices`` x ``peak`` (TFLOP/s each) that ``images_per_s`` (over all of them)
    uses; None without a peak."""
    if not peak:
        return None
    return achieved_tflops(images_per_s, flops_per_image) / (devices * peak)
