"""The speed switches on a CUDA device (`make test-gpu`; skipped without one): fused AdamW's CUDA
kernel makes foreach's update on FSDP2's DTensor parameters, and float8 training runs a step."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from pipeline.train.step.model import build_model, init_distributed
from pipeline.train.step.optim import optimizer_kernels
from pipeline.train.step.train_step import TrainStep
from tests.train.test_speed_paths import CONFIG

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_world():
    _, _, device = init_distributed()
    yield device
    dist.destroy_process_group()


def adamw_updates_agree(device: torch.device, impls: tuple[str, str], atol: float) -> None:
    """Two copies of a model, each with its AdamW kernels, step on the same gradients (one copy's, from
    a bf16 backward on CUDA that need not be deterministic) and must move their parameters alike."""
    g = torch.Generator().manual_seed(3)
    patches = torch.randint(0, 256, (8, 16, 192), dtype=torch.uint8, generator=g).to(device)
    labels = torch.randint(0, 4, (8,), generator=g).to(device)
    steps = []
    for impl in impls:
        config = CONFIG.replace(optimizer_impl=impl, use_gpu=device.type == "cuda")
        steps.append(TrainStep(build_model(config, device), config, device))
    assert [optimizer_kernels(s.optimizer) for s in steps] == ["foreach", "fused"]
    first, second = steps
    start = {n: p.full_tensor().clone() for n, p in second.model.named_parameters()}
    for _ in range(3):
        losses, _ = first.objective.losses(first.model, (patches, labels))
        losses.mean().backward()
        for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
            b.grad = None if a.grad is None else a.grad.detach().clone()
        for s in steps:
            s.optimizer.step()
            s.optimizer.zero_grad(set_to_none=True)
    a, b = (dict(s.model.named_parameters()) for s in steps)
    assert any(not torch.equal(start[n], b[n].full_tensor()) for n in start)  # they moved
    for name, p in a.items():
        torch.testing.assert_close(b[name].full_tensor(), p.full_tensor(), rtol=1e-5, atol=atol, msg=name)


def test_fused_adamw_on_cuda_makes_the_foreach_update(cuda_world):
    adamw_updates_agree(cuda_world, ("foreach", "auto"), atol=1e-3 * CONFIG.optim.lr)  # auto: fused on CUDA


def test_a_float8_step_runs_on_hopper(cuda_world):
    if torch.cuda.get_device_capability(cuda_world) < (8, 9):
        pytest.skip("float8 needs compute capability 8.9+")
    if importlib.util.find_spec("torchao") is None:  # the fp8 extra, as --fp8 itself says
        pytest.skip("float8 needs torchao: pip install 'vitray[fp8]'")
    config = CONFIG.replace(use_gpu=True, fp8=True, compile=True, model_overrides={})
    step = TrainStep(build_model(config, cuda_world), config, cuda_world)
    g = torch.Generator().manual_seed(4)
    patches = torch.randint(0, 256, (16, 16, 192), dtype=torch.uint8, generator=g).to(cuda_world)
    labels = torch.randint(0, 4, (16,), generator=g).to(cuda_world)
    losses = [step(i, [(patches, labels)], global_count=16).loss_sum.item() for i in range(5)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
