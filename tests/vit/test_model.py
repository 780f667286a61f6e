"""The model: forward/backward matrix, input forms, patch embedding, init, resampling, staged outputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vit
from vit.model import VisionTransformer

TINY = "vit_tiny_test"  # 32 px, 8 px patches (N = 16), D = 64, depth 2, 4 heads, 10 classes
HYBRID = "vit_r_tiny_test"  # the same encoder on a two-stage ResNet of stride 8: the same patches


def pixels(batch: int, size: int = 32, channels: int = 3, seed: int = 0) -> torch.Tensor:
    """Random uint8 images, channels-last ``(B, H, W, C)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, size, size, channels), generator=g, dtype=torch.uint8)


def normalized(images: torch.Tensor, config: vit.ViTConfig) -> torch.Tensor:
    """uint8 ``(B, H, W, C)`` -> float ``(B, C, H, W)`` normalized the torchvision way."""
    x = images.float() / 255
    x = (x - torch.tensor(config.mean)) / torch.tensor(config.std)
    return x.permute(0, 3, 1, 2)


def randomize_head(model: VisionTransformer) -> None:
    # The classifier starts at zero, which would zero every upstream gradient.
    if model.head.fc is not None:
        nn.init.normal_(model.head.fc.weight, std=0.5)


@pytest.mark.parametrize("pool", ["cls", "gap"])
@pytest.mark.parametrize("head", ["pretrain", "finetune"])
@pytest.mark.parametrize("input_form", ["uint8", "float"])
@pytest.mark.parametrize("name", [TINY, HYBRID])
def test_forward_backward(name, pool, head, input_form):
    torch.manual_seed(0)
    model = vit.create_model(name, pool=pool, head=head, num_classes=7)
    randomize_head(model)
    images = pixels(3)
    x = vit.patchify(images, 8) if input_form == "uint8" else normalized(images, model.config)
    logits = model(x)
    assert logits.shape == (3, 7)
    F.cross_entropy(logits, torch.tensor([0, 3, 6])).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"no gradient reaches {name}"
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("pool", ["cls", "gap"])
@pytest.mark.parametrize("name", [TINY, HYBRID])
def test_uint8_patches_and_normalized_images_give_the_same_output(name, pool):
    # Non-default normalization, so a model that ignored mean/std would fail.
    model = vit.create_model(name, pool=pool, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    nn.init.normal_(model.head.fc.weight)
    images = pixels(2)
    from_patches = model(vit.patchify(images, 8))
    from_images = model(normalized(images, model.config))
    torch.testing.assert_close(from_patches, from_images, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        model.forward_features(vit.patchify(images, 8)),
        model.forward_features(normalized(images, model.config)),
    )


def test_patch_linear_equals_the_conv2d_formulation():
    config = vit.get_config(TINY)
    model = VisionTransformer(config)
    conv = nn.Conv2d(3, config.embed_dim, kernel_size=8, stride=8)
    with torch.no_grad():
        model.patch_embed.proj.weight.copy_(conv.weight.permute(0, 2, 3, 1).reshape(config.embed_dim, -1))
        model.patch_embed.proj.bias.copy_(conv.bias)
    x = torch.randn(2, 3, 32, 32)
    expected = conv(x).flatten(2).transpose(1, 2)  # (B, D, 4, 4) -> (B, 16, D), row-major grid
    torch.testing.assert_close(model.patch_embed(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [TINY, HYBRID])
def test_meta_build_then_init_equals_a_direct_build(name):
    config = vit.get_config(name, embed_dim=128, mlp_dim=256)
    direct = VisionTransformer(config)
    meta = VisionTransformer(config, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(1)
    meta.init_weights()
    torch.manual_seed(1)
    direct.init_weights()
    direct_sd, meta_sd = direct.state_dict(), meta.state_dict()
    assert list(direct_sd) == list(meta_sd)
    for name in direct_sd:
        torch.testing.assert_close(meta_sd[name], direct_sd[name], rtol=0, atol=0, msg=name)


def test_init_follows_the_reference():
    torch.manual_seed(0)
    config = vit.get_config(TINY, embed_dim=256, mlp_dim=1024, num_heads=4, image_size=64)
    model = VisionTransformer(config, device="meta")
    model.to_empty(device="cpu")  # garbage everywhere, buffers included
    model.init_weights()
    d = config.embed_dim
    assert torch.equal(model.cls_token, torch.zeros(d))
    assert model.pos_embed.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.head.fc.weight, torch.zeros_like(model.head.fc.weight))
    assert torch.equal(model.patch_embed.mean, torch.tensor(config.mean))
    assert torch.equal(model.patch_embed.std, torch.tensor(config.std))
    block = model.blocks[0]
    # Xavier-uniform: std sqrt(2 / (fan_in + fan_out)); QKV as three D x D matrices.
    assert block.attn.qkv.weight.std().item() == pytest.approx(math.sqrt(1 / d), rel=0.05)
    assert block.mlp.fc1.weight.std().item() == pytest.approx(math.sqrt(2 / (d + 4 * d)), rel=0.05)
    assert block.attn.qkv.weight.abs().max() <= math.sqrt(3 / d)
    # LeCun-normal patch embedding, truncated at 2 std (which lowers the std by ~12%).
    std = math.sqrt(1 / config.patch_dim)
    assert model.patch_embed.proj.weight.std().item() == pytest.approx(0.88 * std, rel=0.05)
    assert model.patch_embed.proj.weight.abs().max() <= 2 * std
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
    assert torch.equal(block.norm1.weight, torch.ones(d)) and torch.equal(model.norm.weight, torch.ones(d))


@pytest.mark.parametrize("name", list(vit.VARIANTS))
def test_every_variant_runs_on_meta(name):
    model = vit.create_model(name, device="meta")
    c = model.config
    out = model(torch.empty(2, c.num_patches, c.patch_dim, dtype=torch.uint8, device="meta"))
    assert out.shape == (2, c.num_classes)
    assert model.forward_features(torch.empty(1, 3, c.image_size, c.image_size, device="meta")).shape == (
        1,
        1 + c.num_patches,
        c.embed_dim,
    )


def test_staged_outputs():
    torch.manual_seed(0)
    model = vit.create_model(TINY, representation_size=48)
    nn.init.normal_(model.head.fc.weight)
    x = vit.patchify(pixels(2), 8)
    tokens = model.forward_features(x)
    assert tokens.shape == (2, 17, 64)
    torch.testing.assert_close(model.embed(x), tokens[:, 0])
    hidden = torch.tanh(model.head.pre_logits(tokens[:, 0]))
    torch.testing.assert_close(model.embed(x, pre_logits=True), hidden)
    torch.testing.assert_close(model(x), model.head.fc(hidden))
    # The final LN comes before pooling: the CLS embedding is normalized.
    assert model.embed(x).mean(-1).abs().max() < 1e-5
    gap = vit.create_model(TINY, pool="gap", representation_size=48)
    gap.load_state_dict(model.state_dict())
    torch.testing.assert_close(gap.embed(x), gap.forward_features(x)[:, 1:].mean(1))


def test_without_classes_forward_returns_the_embedding():
    model = vit.create_model(TINY, num_classes=0, head="finetune")
    x = vit.patchify(pixels(2), 8)
    assert model.head.fc is None
    torch.testing.assert_close(model(x), model.embed(x))


def test_attention_maps_match_the_fast_path():
    torch.manual_seed(0)
    model = vit.create_model(TINY)
    x = vit.patchify(pixels(2), 8)
    maps = model.attention_maps(x)
    assert len(maps) == 2 and maps[0].shape == (2, 4, 17, 17)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 4, 17))
    # The weights applied to V reproduce what SDPA computed in the first block.
    attn = model.blocks[0].attn
    h = model.blocks[0].norm1(model.prepare_tokens(x))
    v = attn.qkv(h).view(2, 17, 3, 4, 16)[:, :, 2].transpose(1, 2)  # (B, H, T, hd)
    by_hand = attn.proj((maps[0] @ v).transpose(1, 2).reshape(2, 17, 64))
    torch.testing.assert_close(by_hand, attn(h), rtol=1e-4, atol=1e-5)


def test_any_image_size_and_number_of_classes():
    model = vit.create_model(TINY, image_size=48, num_classes=3)
    assert model.pos_embed.shape == (1 + 36, 64)
    assert model(vit.patchify(pixels(2, size=48), 8)).shape == (2, 3)
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 3)


@pytest.mark.parametrize("name", [TINY, HYBRID])
def test_low_precision_parameters_take_uint8_patches(name):
    # As under FSDP mixed precision: bf16 weights, uint8 input normalized in fp32 then cast.
    model = vit.create_model(name).to(torch.bfloat16)
    out = model.embed(vit.patchify(pixels(2), 8))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_bad_inputs_fail_with_clear_errors():
    model = vit.create_model(TINY)
    with pytest.raises(ValueError, match="got 36 patches, but the model was built for 16"):
        model(vit.patchify(pixels(1, size=48), 8))
    with pytest.raises(ValueError, match="expected uint8 patches"):
        model(vit.patchify(pixels(1), 8).long())
    with pytest.raises(ValueError, match="expected uint8 patches"):
        model(pixels(1))  # uint8 images, not patches
    with pytest.raises(ValueError, match="patches hold 48 values each, but this model takes 8x8x3 = 192"):
        model(vit.patchify(pixels(1), 4))
    with pytest.raises(ValueError, match="not divisible by patch size"):
        model(torch.randn(1, 3, 30, 30))


def test_resampling_to_the_same_grid_is_the_identity():
    pos = torch.randn(1 + 16, 64)
    assert torch.equal(vit.resample_pos_embed(pos, 4), pos)
    assert torch.equal(vit.resample_pos_embed(pos[None], (4, 4)), pos[None])
    model = vit.create_model(TINY)
    again = vit.create_model(TINY)
    again.load_state_dict(model.state_dict())
    assert torch.equal(again.pos_embed, model.pos_embed)


@pytest.mark.parametrize("old, new", [((4, 4), (8, 8)), ((4, 4), (3, 3)), ((2, 4), (4, 6))])
def test_resampling_keeps_cls_and_grid_orientation(old, new):
    gh, gw = old
    rows = torch.arange(gh).float().repeat_interleave(gw)  # row index of each patch, row-major
    cols = torch.arange(gw).float().repeat(gh)
    pos = torch.stack([rows, cols], dim=1)  # (gh*gw, 2)
    pos = torch.cat([torch.tensor([[7.0, -7.0]]), pos])  # a CLS row
    out = vit.resample_pos_embed(pos, new, old_grid=old)
    assert out.shape == (1 + new[0] * new[1], 2)
    assert torch.equal(out[0], pos[0])
    grid = out[1:].reshape(*new, 2)
    # Rows vary down the grid only, columns across it only: a transposed grid fails here.
    row, col = grid[..., 0], grid[..., 1]
    assert (row.diff(dim=0) >= -1e-6).all() and row.diff(dim=1).abs().max() < 1e-5
    assert (col.diff(dim=1) >= -1e-6).all() and col.diff(dim=0).abs().max() < 1e-5
    assert grid[..., 0].mean() == pytest.approx((gh - 1) / 2, abs=1e-4)


def test_loading_weights_of_another_resolution_resamples_them():
    torch.manual_seed(0)
    small = vit.create_model(TINY)
    large = vit.create_model(TINY, image_size=64)
    large.load_state_dict(small.state_dict())
    assert torch.equal(large.pos_embed[0], small.pos_embed[0])
    expected = vit.resample_pos_embed(small.pos_embed.detach(), 8)
    torch.testing.assert_close(large.pos_embed.detach(), expected)
    assert large(vit.patchify(pixels(2, size=64), 8)).shape == (2, 10)
    # timm / transformers layout (1, T, D) loads too.
    sd = small.state_dict()
    sd["pos_embed"] = sd["pos_embed"][None]
    large.load_state_dict(sd)
    torch.testing.assert_close(large.pos_embed.detach(), expected)


def test_resampling_a_non_square_grid_needs_the_old_grid():
    with pytest.raises(ValueError, match="pass old_grid"):
        vit.resample_pos_embed(torch.randn(1 + 8, 4), 4)


# How far bf16 autocast may move the embedding from float32's, as ||bf16 - fp32|| / ||fp32||. A ViT's
# rounding stays near bf16's own (2^-9 per operation); the hybrid's ResNet adds 16 more residual
# units of bf16 convolutions: at random weights, vit_r50_b16 measured 0.041 on CPU, vit_b16 0.0067.
BF16_DRIFT = {TINY: 0.02, HYBRID: 0.06, "vit_b16": 0.02, "vit_r50_b16": 0.06}


def bf16_drift(name: str, device: str) -> tuple[float, float]:
    """(relative drift of bf16 autocast against float32, of the float-input path against the patch path)."""
    torch.manual_seed(0)
    model = vit.create_model(name, num_classes=0, head="finetune").to(device)
    c = model.config
    images = pixels(4, size=c.image_size).to(device)
    with torch.no_grad():
        exact = model.embed(vit.patchify(images, c.patch_size))
        with torch.autocast(device, dtype=torch.bfloat16):
            fast = model.embed(vit.patchify(images, c.patch_size)).float()
            from_floats = model.embed(normalized(images.cpu(), c).to(device)).float()
    assert torch.isfinite(fast).all() and torch.isfinite(from_floats).all()
    return ((fast - exact).norm() / exact.norm()).item(), ((from_floats - fast).norm() / fast.norm()).item()


@pytest.mark.parametrize("name", [TINY, HYBRID])
def test_bf16_autocast_stays_within_its_rounding_of_float32(name):
    drift, paths = bf16_drift(name, "cpu")
    assert 0 < drift < BF16_DRIFT[name] and paths < BF16_DRIFT[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", [TINY, HYBRID, "vit_b16", "vit_r50_b16"])
def test_cuda_bf16_kernels_agree_with_fp32(name, monkeypatch):
    # On GPU, SDPA picks flash / memory-efficient kernels under bf16; they must compute the same
    # function. The float32 reference keeps its convolutions float32 (cuDNN would take TF32).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    drift, paths = bf16_drift(name, "cuda")
    assert drift < BF16_DRIFT[name] and paths < BF16_DRIFT[name]
