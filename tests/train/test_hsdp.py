"""HSDP: a 2 x 2 mesh (shard within pairs of ranks, replicate across them) trains the same parameters as
plain FSDP over 4 ranks. Four CPU processes with gloo, no Ray: the same `build_model` and `TrainStep`
that every Ray Train worker runs, each rank with its own micro-batches, two per step (accumulation)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import Replicate, Shard

import vit
from pipeline.train.step.model import build_model, model_config
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config
from tests.distributed import spawn

WORLD, STEPS, MICRO = 4, 4, 4
CONFIG = tiny_config(
    batch_size=WORLD * MICRO * 2, micro_batch_size=MICRO, num_workers=WORLD, lr=3e-3, warmup_steps=1
)


def micro_batch(rank: int, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + index)
    mcfg = model_config(CONFIG)
    patches = torch.randint(0, 256, (MICRO, mcfg.num_patches, mcfg.patch_dim), dtype=torch.uint8, generator=g)
    return patches, torch.randint(0, CONFIG.arch.num_classes, (MICRO,), generator=g)


def full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def train(group: int, start: dict[str, torch.Tensor], rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """`STEPS` steps from the weights `start` with shard groups of `group` ranks; the final full
    parameters, and facts about the mesh and the model's own initialization."""
    config = CONFIG.replace(shard_group_size=group)
    model = build_model(config, torch.device("cpu"))
    weight = model.state_dict()["blocks.0.mlp.fc1.weight"]
    # Replicas of one shard must start equal: ranks r and r + group hold the same shard under HSDP.
    local = [None] * WORLD
    dist.all_gather_object(local, weight.to_local().clone())
    facts = {
        "mesh": list(weight.device_mesh.shape),
        "placements": [repr(p) for p in weight.placements],
        "replicas_equal": all(torch.equal(local[r], local[r % group]) for r in range(WORLD)),
    }
    # A copy: set_model_state_dict replaces the dict's entries with this mesh's DTensors.
    set_model_state_dict(model, dict(start), options=StateDictOptions(full_state_dict=True))
    step_fn = TrainStep(model, config, torch.device("cpu"))
    for param_group in step_fn.optimizer.param_groups:
        # The key bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by all
        # keys), so its gradient is rounding noise, which Adam's default eps of 1e-8 scales up to
        # full-size updates that differ with the summation order. 1e-6 keeps the noise small.
        param_group["eps"] = 1e-6
    norms = []
    for step in range(STEPS):
        batches = [micro_batch(rank, step, i) for i in range(2)]
        norms.append(step_fn(step, batches, global_count=WORLD * 2 * MICRO).grad_norm.item())
    facts["grad_norms"] = norms  # scale-sensitive, where Adam's update is not
    return full(model), facts


def worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = vit.VisionTransformer(model_config(CONFIG))
    reference.init_weights()
    start = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    fsdp, fsdp_facts = train(WORLD, start, rank)
    hsdp, hsdp_facts = train(2, start, rank)
    moved = max((fsdp[k] - start[k]).abs().max().item() for k in start)
    differ = max((fsdp[k] - hsdp[k]).abs().max().item() for k in start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"fsdp": fsdp_facts, "hsdp": hsdp_facts, "moved": moved, "differ": differ}, f)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp") / "result.json"
    spawn(worker, str(out), world_size=WORLD)
    with open(out) as f:
        return json.load(f)


def test_a_2x2_mesh_trains_the_same_parameters_as_a_1d_mesh_of_4(result):
    # The gradient norm is scale-sensitive (Adam's update is not): HSDP's reduce-scatter then
    # all-reduce must average over all 4 ranks exactly as FSDP's reduce-scatter does.
    assert result["hsdp"]["grad_norms"] == pytest.approx(result["fsdp"]["grad_norms"], rel=1e-5)
    assert result["moved"] > 1e-3  # the steps changed the weights: the comparison below means something
    assert result["differ"] < 1e-5, result  # measured 2e-6: only the summation order differs


def test_the_2x2_mesh_shards_within_pairs_and_replicates_across(result):
    assert result["hsdp"]["mesh"] == [2, 2]
    assert result["hsdp"]["placements"] == [repr(Replicate()), repr(Shard(0))]
    assert result["fsdp"]["mesh"] == [WORLD] and result["fsdp"]["placements"] == [repr(Shard(0))]


def test_replicas_of_a_shard_are_initialized_alike(result):
    # On CPU each shard seeds by its place in the shard dimension, which replicas share.
    assert result["hsdp"]["replicas_equal"]
