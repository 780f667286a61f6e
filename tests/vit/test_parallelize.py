"""vit.parallelize: activation checkpointing, compile and FSDP2 compute what the plain model computes.

The FSDP2 test runs two processes on CPU with gloo: the sharded model must hold half of every
parameter on each rank and produce the plain model's gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vit
from tests.distributed import spawn
from vit.parallelize import apply_activation_checkpointing, apply_compile, apply_fsdp

TINY = "vit_tiny_test"
WORLD_SIZE = 2


def reference_model(seed: int = 0) -> vit.VisionTransformer:
    torch.manual_seed(seed)
    model = vit.create_model(TINY)
    nn.init.normal_(model.head.fc.weight, std=0.5)  # nonzero, so gradients reach every layer
    return model


def batch(size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    patches = torch.randint(0, 256, (size, 16, 192), dtype=torch.uint8, generator=g)
    return patches, torch.randint(0, 10, (size,), generator=g)


def loss_and_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_computes_the_same_and_keeps_names():
    plain, checkpointed = reference_model(), reference_model()
    apply_activation_checkpointing(checkpointed)
    assert list(dict(checkpointed.named_parameters())) == list(dict(plain.named_parameters()))
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    x, y = batch()
    loss, grads = loss_and_grads(plain, x, y)
    loss_ac, grads_ac = loss_and_grads(checkpointed, x, y)
    torch.testing.assert_close(loss_ac, loss)
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], msg=name)


def test_activation_checkpointing_recomputes_in_backward():
    calls = []
    model = reference_model()
    # A pre-hook at the block's start: recomputation may stop early, once it has what backward needs.
    model.blocks[0].attn.register_forward_pre_hook(lambda *_: calls.append(1))
    apply_activation_checkpointing(model)
    x, y = batch()
    loss_and_grads(model, x, y)
    assert len(calls) == 2  # once in forward, once more when backward recomputes the block


def test_compiled_blocks_compute_the_same():
    # aot_eager traces each block whole (fullgraph: a graph break fails) without generating C++.
    plain, compiled = reference_model(), reference_model()
    apply_activation_checkpointing(compiled)
    apply_compile(compiled, backend="aot_eager")
    assert compiled.state_dict().keys() == plain.state_dict().keys()
    x, y = batch()
    loss, grads = loss_and_grads(plain, x, y)
    loss_c, grads_c = loss_and_grads(compiled, x, y)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_inductor_compiled_blocks_compute_the_same():
    plain, compiled = reference_model(), reference_model()
    apply_compile(compiled)
    x, y = batch()
    loss, grads = loss_and_grads(plain, x, y)
    loss_c, grads_c = loss_and_grads(compiled, x, y)
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-3, atol=1e-5, msg=name)


def _fsdp_worker(rank: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    reference = reference_model()
    x, y = batch(4)
    _, grads = loss_and_grads(reference, x, y)  # the whole batch, one process
    mine = slice(2 * rank, 2 * rank + 2)  # this rank's half of the batch

    for param_dtype in (None, torch.bfloat16):
        model = vit.create_model(TINY, device="meta")
        apply_activation_checkpointing(model)
        apply_fsdp(model, param_dtype=param_dtype)
        model.to_empty(device="cpu")
        model.init_weights()  # in place, on DTensor shards
        assert model.cls_token.full_tensor().abs().sum() == 0
        assert torch.equal(model.patch_embed.mean, torch.full((3,), 0.5))
        assert 0.01 < model.pos_embed.full_tensor().std() < 0.03
        assert list(dict(model.named_parameters())) == list(dict(reference.named_parameters()))
        for name, param in model.named_parameters():
            local, rows = param.to_local().numel(), param.shape[0]
            assert abs(local - param.numel() / WORLD_SIZE) <= param.numel() / rows, (name, local)

        with torch.no_grad():  # the reference's weights, sharded
            for name, param in model.named_parameters():
                full = reference.get_parameter(name).detach()
                param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
        logits = model(x[mine])
        if param_dtype is None:
            torch.testing.assert_close(logits, reference(x[mine]), rtol=1e-5, atol=1e-5)
            F.cross_entropy(logits, y[mine]).backward()  # FSDP averages the two halves' gradients
            for name, param in model.named_parameters():
                torch.testing.assert_close(
                    param.grad.full_tensor(), grads[name], rtol=1e-4, atol=1e-6, msg=name
                )
        else:
            assert logits.dtype == torch.bfloat16
            torch.testing.assert_close(logits.float(), reference(x[mine]), rtol=0.05, atol=0.05)


def test_fsdp_shards_every_parameter_and_matches_the_plain_gradients():
    spawn(_fsdp_worker, world_size=WORLD_SIZE)


def one_device_fsdp(per_block: bool | None, compile_model: bool = False) -> tuple[nn.Module, list]:
    """The reference model under FSDP2 on a world of one (call inside a process group), and the
    graphs a whole-model compile traced (with `compile_model`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = vit.create_model(TINY, device="meta")
    if compile_model:
        apply_compile(model, backend=backend, scope="model")
    apply_fsdp(model, param_dtype=None, per_block=per_block)
    model.to_empty(device="cpu")
    model.init_weights()
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, reference_model().state_dict(), options=full)
    return model, graphs


def test_one_device_is_one_fsdp_unit_that_computes_what_per_block_units_do():
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x, y = batch()
        loss, grads = loss_and_grads(reference_model(), x, y)
        per_block, _ = one_device_fsdp(per_block=True)
        assert all(isinstance(block, FSDPModule) for block in per_block.blocks)
        one_unit, _ = one_device_fsdp(per_block=None)  # the default on one device
        assert isinstance(one_unit, FSDPModule)
        assert not any(isinstance(block, FSDPModule) for block in one_unit.blocks)
        for model in (per_block, one_unit):
            loss_m, grads_m = loss_and_grads(model, x, y)
            torch.testing.assert_close(loss_m, loss, rtol=1e-5, atol=1e-6)
            for name in grads:
                torch.testing.assert_close(grads_m[name].full_tensor(), grads[name], rtol=1e-4, atol=1e-6)
        # A whole-model compile is one graph when nothing splits the forward into per-block hooks.
        compiled, graphs = one_device_fsdp(per_block=None, compile_model=True)
        loss_c, _ = loss_and_grads(compiled, x, y)
        torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
        assert len(graphs) == 1
        compiled, graphs = one_device_fsdp(per_block=True, compile_model=True)
        loss_and_grads(compiled, x, y)
        assert len(graphs) > 1  # the graph breaks at each block's hooks
    finally:
        dist.destroy_process_group()


def _cuda_worker(rank: int) -> None:
    # The production setup on GPUs: AC, then per-block inductor compile, then FSDP2 in bf16.
    from torch.distributed.tensor import distribute_tensor

    device = torch.device("cuda", rank)
    reference = reference_model().to(device)
    x, y = (t.to(device) for t in batch(4))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = reference(x)
    model = vit.create_model(TINY, device="meta")
    apply_activation_checkpointing(model)
    apply_compile(model)
    apply_fsdp(model)
    model.to_empty(device=device)
    model.init_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference.get_parameter(name).detach()
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    for _ in range(2):  # the second step reuses the compiled graphs
        model.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.float(), y).backward()
    torch.testing.assert_close(logits.float(), expected.float(), rtol=0.05, atol=0.05)
    assert all(torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())


@pytest.mark.gpu
def test_fsdp_with_compile_and_checkpointing_on_cuda():
    world_size = min(torch.cuda.device_count(), 2)
    spawn(_cuda_worker, world_size=world_size, backend="nccl")
