"""On a CUDA machine (`make test-gpu`; skipped elsewhere): the training step under FSDP2 with bf16
compute, the embedding actor in bf16 against the fp32 CPU reference, and NCCL set up by Ray Train."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import vit
from pipeline.embed.actor import Embedder, embed_rows
from pipeline.model_source import inference_model, pack_state_dict
from pipeline.train.observe.mfu import peak_tflops
from pipeline.train.step.model import build_model, init_distributed, model_config
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config

pytestmark = pytest.mark.gpu

CONFIG = tiny_config(batch_size=16, micro_batch_size=8, lr=3e-3, warmup_steps=1, use_gpu=True)


def patch_batch(config: vit.ViTConfig, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    patches = rng.integers(0, 256, (n, config.num_patches, config.patch_dim), dtype=np.uint8)
    return patches, rng.integers(0, 4, n)


@pytest.fixture(scope="module")
def cuda_world():
    rank, size, device = init_distributed()
    assert (rank, size, device.type) == (0, 1, "cuda")
    assert dist.get_backend() == "nccl"
    yield device
    dist.destroy_process_group()


def test_train_step_runs_fsdp2_in_bf16_and_learns(cuda_world):
    device = cuda_world
    model = build_model(CONFIG, device)
    dtypes = []
    block = model.blocks[0].mlp.fc1
    block.register_forward_hook(lambda module, args, out: dtypes.append((module.weight.dtype, out.dtype)))
    step = TrainStep(model, CONFIG, device)
    patches, labels = patch_batch(model_config(CONFIG), 16, seed=0)
    micro = [
        (torch.from_numpy(patches[i : i + 8]).to(device), torch.from_numpy(labels[i : i + 8]).to(device))
        for i in (0, 8)
    ]
    losses = [step(i, micro, global_count=16).loss_sum.item() / 16 for i in range(20)]
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
    # FSDP2's mixed precision: the all-gathered weights and the activations are bf16 in forward ...
    assert dtypes[0] == (torch.bfloat16, torch.bfloat16)
    # ... while the sharded parameters the optimizer updates stay fp32.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    peak, note = peak_tflops(device)
    assert torch.cuda.get_device_name(device) in note and (peak is not None or "MFU not reported" in note)


def test_embedding_actor_on_cuda_matches_the_cpu_reference(cuda_world):
    torch.manual_seed(0)
    reference = vit.create_model("vit_tiny_test", num_classes=4).eval()
    arrays = pack_state_dict(reference.state_dict())
    patches, labels = patch_batch(reference.config, 24, seed=1)
    batch = {
        "key": np.array([f"k{i}" for i in range(24)]),
        "url": np.array(["s.tar"] * 24),
        "patches": patches,
        "label": labels,
        "error": np.array([""] * 24),
    }
    actor = Embedder(
        [arrays], reference.config.to_dict(), pre_logits=False, batch_size=16, use_gpu=True, threads=1
    )
    assert actor.device.type == "cuda"
    on_gpu = actor(batch)["embedding"]
    cpu_model = inference_model(reference.config, reference.state_dict(), torch.device("cpu"))
    on_cpu = embed_rows(cpu_model, batch, batch_size=16)["embedding"]
    cosine = (on_gpu * on_cpu).sum(1) / (np.linalg.norm(on_gpu, axis=1) * np.linalg.norm(on_cpu, axis=1))
    assert on_gpu.dtype == np.float32 and cosine.min() > 0.99  # bf16 autocast, not bit-equal


def test_ray_train_sets_up_nccl_on_the_gpu(ray_session, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if ray_session.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the local Ray sees no GPU")

    def loop(_):
        import ray.train.torch

        device = ray.train.torch.get_device()
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        return {"backend": dist.get_backend(), "device": device.type, "sum": value.item()}

    trainer = TorchTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(name="nccl", storage_path=str(tmp_path)),
    )
    assert trainer.fit().return_value == {"backend": "nccl", "device": "cuda", "sum": 1.0}
