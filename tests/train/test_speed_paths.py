"""Every speed switch of a training run computes what its default does (issue 14), on CPU.

Optimizer kernels (fused / foreach / for-loop), activation checkpointing modes, compile scopes (with
``aot_eager``, and a counting backend that shows no block falls back to eager past dynamo's
recompile limit), and the production order AC -> compile -> FSDP2 on two gloo ranks with gradients
compared. Float8 (``--fp8``) has its own file, tests/train/test_fp8.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import vit
from pipeline.train.step.model import build_model
from pipeline.train.step.optim import adamw_impl, optimizer_kernels
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config
from tests.distributed import spawn
from vit.parallelize import AC_MODES, apply_activation_checkpointing, apply_compile, apply_fsdp

CONFIG = tiny_config(
    lr=1e-2,
    warmup_steps=1,
    grad_clip=1e9,
    # Without a key bias: its gradient is zero in exact arithmetic (softmax ignores a constant added
    # to every key), so Adam would turn each kernel's rounding noise into a full step of noise.
    model_overrides={"qkv_bias": False},
)


def reference(depth: int = 4) -> vit.VisionTransformer:
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", depth=depth)
    nn.init.normal_(model.head.fc.weight, std=0.5)  # nonzero, so gradients reach every layer
    return model


def batch(size: int = 4, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size, 16, 192), dtype=torch.uint8, generator=g), torch.randint(
        0, 10, (size,), generator=g
    )


def loss_and_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    full = {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for n, p in model.named_parameters()
    }
    return loss.detach(), {n: g.clone() for n, g in full.items()}


def assert_same(got: tuple, expected: tuple, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=rtol, atol=atol)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=rtol * 10, atol=atol, msg=name)


# --- optimizer kernels ------------------------------------------------------------------------------
def test_auto_takes_fused_adamw_on_cuda_and_foreach_elsewhere(world):
    assert adamw_impl("auto", torch.device("cuda", 0)) == "fused"
    assert adamw_impl("auto", torch.device("cpu")) == "foreach"
    assert adamw_impl("for-loop", torch.device("cuda", 0)) == "for-loop"
    for requested, built in [
        ("auto", "foreach"),
        ("fused", "fused"),
        ("foreach", "foreach"),
        ("for-loop", "for-loop"),
    ]:
        step = TrainStep(build_model(CONFIG, world), CONFIG.replace(optimizer_impl=requested), world)
        assert optimizer_kernels(step.optimizer) == built, requested
    with pytest.raises(ValueError, match="--optimizer-impl must be one of auto, fused, foreach, for-loop"):
        CONFIG.replace(optimizer_impl="apex").validate()


def test_adamw_kernels_make_the_same_updates_on_fsdp2_parameters(world):
    # Fused AdamW also has a CPU kernel, so the three can be compared here on DTensor parameters;
    # the CUDA kernel is checked against foreach by the gpu suite (tests/train/test_gpu_speed.py).
    g = torch.Generator().manual_seed(3)
    patches = torch.randint(0, 256, (8, 16, 192), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 4, (8,), generator=g)
    params = {}
    for impl in ("for-loop", "foreach", "fused"):
        config = CONFIG.replace(optimizer_impl=impl)
        step = TrainStep(build_model(config, world), config, world)
        for i in range(3):
            step(i, [(patches, labels)], global_count=8)
        params[impl] = {n: p.full_tensor().clone() for n, p in step.model.named_parameters()}
    moved = params["for-loop"]
    assert any(
        not torch.equal(moved[n], p.full_tensor()) for n, p in build_model(CONFIG, world).named_parameters()
    )
    # The fused CPU kernel orders its float32 arithmetic differently: where a second moment is near eps,
    # m / (sqrt(v) + eps) amplifies that rounding (seen: 5.7e-6 on 2 of 84,612 weights after 3 steps on
    # an AMD EPYC). The tolerance is 0.1% of one step's size (lr 1e-2); a wrong update is a whole step.
    atol = {"foreach": 1e-6, "fused": 1e-3 * CONFIG.optim.lr}
    for impl in ("foreach", "fused"):
        for name, value in moved.items():
            torch.testing.assert_close(
                params[impl][name], value, rtol=1e-5, atol=atol[impl], msg=f"{impl} {name}"
            )


# --- activation checkpointing -------------------------------------------------------------------------
def backward_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    loss = F.cross_entropy(model(x), y)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_checkpointing_modes_compute_the_same_and_recompute_what_they_say():
    x, y = batch()
    plain = reference()
    expected = loss_and_grads(plain, x, y)
    flops = {"none": backward_flops(plain, x, y)}
    for mode in AC_MODES:
        model = apply_activation_checkpointing(reference(), mode)
        assert model.state_dict().keys() == plain.state_dict().keys()
        assert_same(loss_and_grads(model, x, y), expected)
        flops[mode] = backward_flops(model, x, y)
    # Backward's matmuls: "ops" keeps every matmul output (no recomputed FLOPs), "alternate" recomputes
    # half the blocks' forward matmuls, "full" all of them.
    assert flops["ops"] == flops["none"] < flops["alternate"] < flops["full"]
    forward_blocks = flops["full"] - flops["none"]
    assert flops["alternate"] - flops["none"] == forward_blocks // 2
    with pytest.raises(ValueError, match="activation checkpointing mode must be one of full, alternate, ops"):
        apply_activation_checkpointing(reference(), "some")


# --- compile ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("scope", "mode"), [("blocks", "full"), ("blocks", "ops"), ("model", "alternate")])
def test_compiled_scopes_compute_the_same(scope, mode):
    x, y = batch()
    expected = loss_and_grads(reference(), x, y)
    model = apply_activation_checkpointing(reference(), mode)
    apply_compile(model, backend="aot_eager", scope=scope)
    assert_same(loss_and_grads(model, x, y), expected, rtol=1e-5, atol=1e-5)


class CountingBackend:
    """A torch.compile backend that runs the captured graph eagerly and counts compilations and calls:
    a block that fell back to eager (past the recompile limit) makes no call."""

    def __init__(self):
        self.compiled, self.calls = 0, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> callable:
        self.compiled += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


@pytest.mark.parametrize("mode", [None, "full", "ops"])
def test_per_block_compile_compiles_once_whatever_the_depth(mode):
    # More blocks than dynamo's recompile limit (8): were each block a recompilation of the shared
    # code, the ninth on would run eagerly, and the calls below would fall short.
    depth = torch._dynamo.config.recompile_limit + 2
    model = reference(depth)
    if mode:
        apply_activation_checkpointing(model, mode)
    backend = CountingBackend()
    apply_compile(model, backend=backend)
    x, y = batch()
    for step in range(1, 4):
        loss_and_grads(model, x, y)
        assert (backend.compiled, backend.calls) == (1, step * depth)


def test_whole_model_compile_under_fsdp2_compiles_once(world):
    # Under FSDP2 with per-block units (as on many devices) the whole-model graph breaks at every
    # block's hooks: one graph before the blocks, one block graph shared by all of them, one after;
    # no recompilation in later steps. (On one device the model is one unit: one graph, tested in
    # tests/vit/test_parallelize.py.)
    depth = torch._dynamo.config.recompile_limit + 2
    model = apply_activation_checkpointing(reference(depth), "full")
    backend = CountingBackend()
    apply_compile(model, backend=backend, scope="model")
    apply_fsdp(model, param_dtype=None, per_block=True)
    x, y = batch()
    for step in range(1, 4):
        loss_and_grads(model, x, y)
        assert (backend.compiled, backend.calls) == (3, step * (depth + 2))


# --- the production order on two ranks ------------------------------------------------------------------
VARIANTS = [("full", "blocks"), ("ops", "model")]


def _production_order_worker(rank: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    x, y = batch(4)
    plain = reference()
    expected = loss_and_grads(plain, x, y)  # the whole batch in one process
    mine = slice(2 * rank, 2 * rank + 2)
    for ac_mode, scope in VARIANTS:
        model = vit.create_model("vit_tiny_test", depth=4, device="meta")
        apply_activation_checkpointing(model, ac_mode)
        apply_compile(model, backend="aot_eager", scope=scope)
        apply_fsdp(model, param_dtype=None)
        model.to_empty(device="cpu")
        model.init_weights()  # the buffers; the parameters are the reference's, sharded:
        with torch.no_grad():
            for name, param in model.named_parameters():
                full = plain.get_parameter(name).detach()
                param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
        for _ in range(2):  # the second step runs the graphs compiled in the first
            _, grads = loss_and_grads(model, x[mine], y[mine])
        # FSDP2 averages the two halves' gradients: the gradient of the whole batch's mean loss.
        for name, grad in expected[1].items():
            torch.testing.assert_close(
                grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{ac_mode} {scope} {name}"
            )


@pytest.mark.slow
def test_checkpointing_then_compile_then_fsdp2_gives_the_plain_gradients():
    spawn(_production_order_worker)


def test_speed_switches_are_validated_in_one_line():
    for field, flag in [("compile_scope", "--compile-scope"), ("ac_mode", "--ac-mode")]:
        with pytest.raises(ValueError, match=f"^{flag} must be one of"):
            CONFIG.replace(**{field: "nope"}).validate()
    CONFIG.validate()  # the defaults are valid
