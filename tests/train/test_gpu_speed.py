"""The speed switches on a CUDA device (`make test-gpu`; skipped without one): fused AdamW's CUDA
kernel makes foreach's update on FSDP2's DTensor parameters, and float8 training runs a step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline.train.model import build_model, init_distributed
from pipeline.train.optim import optimizer_kernels
from pipeline.train.step import TrainStep
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


def test_fused_adamw_on_cuda_makes_the_foreach_update(cuda_world):
    g = torch.Generator().manual_seed(3)
    patches = torch.randint(0, 256, (8, 16, 192), dtype=torch.uint8, generator=g).to(cuda_world)
    labels = torch.randint(0, 4, (8,), generator=g).to(cuda_world)
    params = {}
    for impl in ("foreach", "auto"):
        config = CONFIG.replace(optimizer_impl=impl, use_gpu=True)
        step = TrainStep(build_model(config, cuda_world), config, cuda_world)
        params[optimizer_kernels(step.optimizer)] = step
        for i in range(3):
            step(i, [(patches, labels)], global_count=8)
    assert set(params) == {"foreach", "fused"}  # auto is fused on CUDA
    fused, foreach = (dict(params[k].model.named_parameters()) for k in ("fused", "foreach"))
    for name, p in foreach.items():
        torch.testing.assert_close(fused[name].full_tensor(), p.full_tensor(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_float8_step_runs_on_hopper(cuda_world):
    if torch.cuda.get_device_capability(cuda_world) < (8, 9):
        pytest.skip("float8 needs compute capability 8.9+")
    config = CONFIG.replace(use_gpu=True, fp8=True, compile=True, model_overrides={})
    step = TrainStep(build_model(config, cuda_world), config, cuda_world)
    g = torch.Generator().manual_seed(4)
    patches = torch.randint(0, 256, (16, 16, 192), dtype=torch.uint8, generator=g).to(cuda_world)
    labels = torch.randint(0, 4, (16,), generator=g).to(cuda_world)
    losses = [step(i, [(patches, labels)], global_count=16).loss_sum.item() for i in range(5)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
