"""Stochastic depth and dropout: off by default and in eval mode, timm's linear rule over depth when on,
no new parameter names, and exports with or without the fields load."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vit
from vit.model import drop_path_keep
from vit.parallelize import apply_activation_checkpointing, apply_compile
from vit.weights import CONFIG_FILE

TINY = "vit_tiny_test"  # depth 2, 16 patches of 8x8x3
HYBRID = "vit_r_tiny_test"
ON = {"drop_path_rate": 0.3, "dropout": 0.2}


def patches(batch: int = 4, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 16, 192), dtype=torch.uint8, generator=g)


def model_pair(name: str, **on) -> tuple[nn.Module, nn.Module]:
    """(the variant as it is, the same weights with ``on``'s fields): a nonzero head, so logits vary."""
    torch.manual_seed(0)
    base = vit.create_model(name)
    nn.init.normal_(base.head.fc.weight, std=0.5)
    other = vit.create_model(name, **on)
    other.load_state_dict(base.state_dict())
    return base, other


@pytest.mark.parametrize("name", [TINY, HYBRID])
def test_off_by_default_adds_no_module_no_draw_and_no_state(name, monkeypatch):
    base, zeros = model_pair(name, drop_path_rate=0.0, dropout=0.0)
    assert base.config.drop_path_rate == 0.0 and base.config.dropout == 0.0
    assert not any(isinstance(m, nn.Dropout) for m in base.modules())
    monkeypatch.setattr("vit.model.drop_path_keep", lambda *a: pytest.fail("drew a drop-path mask"))
    x = patches()
    # Training mode at rate 0 draws nothing: the same outputs twice, and the same as in eval mode.
    assert base.training and torch.equal(base(x), base(x))
    assert torch.equal(zeros(x), base.eval()(x))
    on = vit.create_model(name, **ON)
    assert on.state_dict().keys() == base.state_dict().keys()  # exports and conversions unchanged


@pytest.mark.parametrize("name", [TINY, HYBRID])
def test_eval_mode_ignores_both_rates(name):
    base, on = model_pair(name, drop_path_rate=0.9, dropout=0.9)
    x = patches()
    base.eval(), on.eval()
    assert torch.equal(on(x), base(x))
    assert torch.equal(on.forward_features(x), base.forward_features(x))
    on.train()
    torch.manual_seed(1)
    first = on(x)
    assert not torch.equal(first, base(x)) and not torch.equal(first, on(x))  # random in training


def test_the_rate_rises_linearly_over_depth_as_in_timm():
    rate, depth, batch = 0.4, 5, 40_000
    torch.manual_seed(0)
    keep = drop_path_keep(rate, depth, batch)
    assert keep.shape == (depth, 2, batch)
    timm_rule = [x.item() for x in torch.linspace(0, rate, depth)]  # timm's `dpr`
    for i, r in enumerate(timm_rule):
        assert r == pytest.approx(rate * i / (depth - 1))
        dropped = (keep[i] == 0).float().mean().item()
        sigma = (r * (1 - r) / (2 * batch)) ** 0.5
        assert abs(dropped - r) <= 4 * sigma + 1e-9, (i, dropped, r)
        kept = keep[i][keep[i] != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - r)))  # expectation kept at 1
    assert torch.equal(keep[0], torch.ones(2, batch))  # the first block is never dropped
    assert torch.equal(drop_path_keep(0.3, 1, 3), torch.ones(1, 2, 3))  # one block: rate 0, as timm


def test_each_sample_skips_the_expected_share_of_branches_in_a_forward():
    # Residual branches that return 1 everywhere: a block's output minus its input is, per sample, the
    # sum of its two branch scales, so it shows which branches that sample kept.
    depth, rate, batch = 4, 0.6, 3000
    model = vit.create_model(TINY, depth=depth, drop_path_rate=rate)
    seen: list[torch.Tensor] = []
    for block in model.blocks:
        block.attn = block.mlp = _Ones()
        block.register_forward_hook(lambda m, args, out: seen.append((out - args[0])[:, 0, 0]))
    torch.manual_seed(0)
    with torch.no_grad():
        model.forward_features(patches(batch))
    for i, delta in enumerate(seen):
        r = rate * i / (depth - 1)
        kept = delta * (1 - r)  # 0, 1 or 2 branches kept, per sample
        torch.testing.assert_close(kept, kept.round(), atol=1e-4, rtol=0)
        share = 1 - kept.mean().item() / 2
        assert abs(share - r) <= 4 * (r * (1 - r) / (2 * batch)) ** 0.5 + 1e-9, (i, share, r)


class _Ones(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x)


def test_dropout_sits_after_pos_embed_attention_projection_and_both_mlp_layers():
    model = vit.create_model(TINY, dropout=0.1)
    drops = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Dropout))
    per_block = ["attn.proj_drop", "mlp.drop1", "mlp.drop2"]
    assert drops == sorted(["pos_drop", *(f"blocks.{i}.{d}" for i in range(2) for d in per_block)])
    assert all(m.p == 0.1 for m in model.modules() if isinstance(m, nn.Dropout))


def test_mae_encoder_takes_them_and_its_decoder_does_not():
    mae = vit.create_mae(TINY, mae=vit.MAEConfig(decoder_dim=32, decoder_depth=1, decoder_num_heads=4), **ON)
    assert mae.encoder.config.drop_path_rate == 0.3 and mae.encoder.config.dropout == 0.2
    assert any(isinstance(m, nn.Dropout) for m in mae.encoder.modules())
    assert not any(isinstance(m, nn.Dropout) for m in mae.decoder.modules())
    plain = vit.create_mae(TINY, mae=vit.MAEConfig(decoder_dim=32, decoder_depth=1, decoder_num_heads=4))
    assert mae.state_dict().keys() == plain.state_dict().keys()
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(16, generator=g) for _ in range(4)])
    visible = vit.mae.take_patches(patches(), ids[:, :4])
    masked = vit.mae.take_patches(patches(), ids[:, 4:])
    plain.load_state_dict(mae.state_dict())
    assert torch.equal(mae.eval()(visible, masked, ids), plain.eval()(visible, masked, ids))
    mae.train()(visible, masked, ids).mean().backward()  # the masked-token path runs with them on


def test_checkpointed_blocks_recompute_with_the_same_masks():
    _, on = model_pair(TINY, **ON)
    checkpointed = vit.create_model(TINY, **ON)
    checkpointed.load_state_dict(on.state_dict())
    apply_activation_checkpointing(checkpointed)
    x, y = patches(), torch.arange(4)
    grads = []
    for model in (on, checkpointed):
        torch.manual_seed(3)
        F.cross_entropy(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_blocks_share_one_graph_whatever_their_rate():
    # Ten blocks of ten different rates: had each block held its rate as a constant, each would need its
    # own graph, and the eleventh compilation of one code object fails under fullgraph.
    model = vit.create_model(TINY, depth=10, **ON)
    apply_compile(model, backend="eager")
    torch._dynamo.reset()
    torch.manual_seed(0)
    out = model(patches())
    assert torch.isfinite(out).all()


def test_config_checks_and_old_configs_load(tmp_path):
    for field in ("drop_path_rate", "dropout"):
        for bad in (-0.1, 1.0):
            with pytest.raises(ValueError, match=rf"^{field} must be in \[0, 1\) \(0: off\), got {bad}$"):
                vit.get_config(TINY, **{field: bad})
    config = vit.get_config(TINY, **ON)
    assert vit.ViTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    old = {k: v for k, v in config.to_dict().items() if k not in vit.REGULARIZATION_FIELDS}
    assert vit.ViTConfig.from_dict(old) == vit.get_config(TINY)  # a config saved before the fields


@pytest.mark.parametrize("saved_with_fields", [True, False])
def test_exports_with_and_without_the_fields_load(tmp_path, saved_with_fields):
    base, on = model_pair(TINY, **ON)
    vit.save_pretrained(tmp_path, on.state_dict(), on.config)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert meta["model"]["drop_path_rate"] == 0.3
    if not saved_with_fields:  # an export written before the fields existed
        for field in vit.REGULARIZATION_FIELDS:
            del meta["model"][field]
        (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    model, config = vit.load_pretrained(tmp_path)
    assert config.dropout == (0.2 if saved_with_fields else 0.0)
    x = patches()
    assert torch.equal(model.eval()(x), base.eval()(x))
