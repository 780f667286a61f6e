"""``--fp8``: which Linear layers become float8, names unchanged, the same function within float8's
precision (torchao's emulation on CPU), FSDP2's float8 all-gather on two gloo ranks, and the config's
one-line refusals. The speed itself needs an H100: BENCHMARKS.md has the command."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchao  # the fp8 extra: `make test` installs it
from torch import nn

import vit
from pipeline.train.config import TrainConfig
from pipeline.train.step import fp8
from tests.configs import tiny_config
from tests.distributed import spawn
from vit.parallelize import apply_activation_checkpointing, apply_compile, apply_fsdp

BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def reference() -> vit.VisionTransformer:
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test")
    nn.init.normal_(model.head.fc.weight, std=0.5)
    return model


def converted(model: nn.Module) -> nn.Module:
    copy = vit.create_model("vit_tiny_test")
    copy.load_state_dict(model.state_dict())
    return fp8.convert_to_float8(copy, emulate=True)


def batch(size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (size, 16, 192), dtype=torch.uint8, generator=g), torch.randint(
        0, 10, (size,), generator=g
    )


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_conversion_swaps_exactly_the_blocks_linears_and_keeps_names():
    plain = reference()
    model = converted(plain)
    swapped = {
        name for name, m in model.named_modules() if type(m) is not nn.Linear and isinstance(m, nn.Linear)
    }
    assert swapped == {f"blocks.{i}.{layer}" for i in range(2) for layer in BLOCK_LINEARS}
    # High precision stays where the input pixels come in and the logits go out.
    assert type(model.patch_embed.proj) is nn.Linear
    assert type(model.head.pre_logits) is nn.Linear and type(model.head.fc) is nn.Linear
    assert list(dict(model.named_parameters())) == list(dict(plain.named_parameters()))
    assert model.state_dict().keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_only_linears_with_both_sides_a_multiple_of_16_are_float8():
    linear = nn.Linear(64, 40)
    assert not fp8.is_fp8_linear(linear, "blocks.0.mlp.fc1")
    assert fp8.is_fp8_linear(nn.Linear(64, 48), "decoder.blocks.3.mlp.fc2")  # an MAE decoder's
    assert not fp8.is_fp8_linear(nn.Linear(64, 48), "head.fc")


def test_the_float8_model_computes_the_same_function_in_bf16():
    # float8 (e4m3) keeps 3 mantissa bits: each matmul input is off by up to 6%, so the comparison is
    # of the whole function (logits and every gradient), not of bits. A transposed weight, a lost
    # bias or a wrong scale would be off by about 100%.
    plain = reference()
    model = converted(plain)
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = plain(x), model(x)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, expected) < 0.15
    F.cross_entropy(expected.float(), y).backward()
    F.cross_entropy(got.float(), y).backward()
    for name, param in model.named_parameters():
        cosine = F.cosine_similarity(param.grad.flatten(), plain.get_parameter(name).grad.flatten(), dim=0)
        assert cosine > 0.9, (name, cosine.item())


def _fsdp_float8_worker(rank: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    plain = reference()
    single = converted(plain)  # float8, one process: what the sharded model must compute
    x, y = batch(4)
    mine = slice(2 * rank, 2 * rank + 2)
    # float8 scales are per tensor and per batch, so each half's gradient is taken on its own.
    halves = []
    for half in (slice(0, 2), slice(2, 4)):
        single.zero_grad()
        F.cross_entropy(single(x[half]), y[half]).backward()
        halves.append({n: p.grad.clone() for n, p in single.named_parameters()})

    model = vit.create_model("vit_tiny_test", device="meta")
    fp8.convert_to_float8(model, emulate=True)  # the production order: float8 -> AC -> compile -> FSDP2
    apply_activation_checkpointing(model)
    apply_compile(model, backend="aot_eager")
    apply_fsdp(model, param_dtype=None)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = plain.get_parameter(name).detach()
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    fp8.precompute_scales_after_step(torch.optim.SGD(model.parameters(), lr=0.0), model)
    logits = model(x[mine])
    torch.testing.assert_close(logits, single(x[mine]), rtol=1e-5, atol=1e-5)
    F.cross_entropy(logits, y[mine]).backward()
    for name, param in model.named_parameters():
        expected = (halves[0][name] + halves[1][name]) / 2
        torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_fsdp2_with_float8_all_gather_computes_the_single_process_float8_model():
    spawn(_fsdp_float8_worker)


def test_fp8_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    config = TrainConfig().replace(shards="d", out="o", fp8=True)
    config.validate()  # GPUs and torchao: fine
    with pytest.raises(ValueError, match=r"^--fp8 needs GPUs .*drop --fp8 or --cpu$"):
        config.replace(use_gpu=False).validate()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"^--fp8 needs the torchao package: pip install 'vitray\[fp8\]'$"):
        config.validate()
    with pytest.raises(ValueError, match=r"compute capability 8\.9"):
        fp8.check_device(torch.device("cpu"))


def test_a_training_step_with_fp8_runs_float8_linears_and_precomputes_scales(monkeypatch):
    from pipeline.train.step.model import build_model, init_distributed
    from pipeline.train.step.train_step import TrainStep

    calls = []
    real = torchao.float8.precompute_float8_dynamic_scale_for_fsdp
    monkeypatch.setattr(
        torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", lambda m: calls.append(1) or real(m)
    )
    _, _, device = init_distributed()  # a world of one
    try:
        # On CPU build_model emulates float8: the config refuses --fp8 with --cpu, tests get here.
        config = tiny_config(batch_size=4, micro_batch_size=4, warmup_steps=1, max_steps=10, fp8=True)
        model = build_model(config, device)
        assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 8
        step = TrainStep(model, config, device)
        x, y = batch(4)
        for i in range(2):
            stats = step(i, [(x, y.remainder(4))], global_count=4)
            assert not stats.skipped and torch.isfinite(stats.loss_sum)
        assert len(calls) == 2  # once after each optimizer step
    finally:
        dist.destroy_process_group()
