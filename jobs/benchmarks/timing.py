"""Timing on CPU and GPU, shared by the benchmarks that measure compute (model, train, embed)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_step(step: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Seconds per call of ``step``, after ``warmup`` calls, timed as one block."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """This GPU's measured dense bf16 matmul rate, the denominator of MFU."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = time_step(lambda: torch.mm(a, b), warmup=5, iters=iters, device=device)
    return 2 * n**3 / seconds / 1e12
