"""The hybrid ViT (paper Sec. 3.1): ResNet stem, its variants, sizes, FLOPs, timm import, FSDP.

The forward/backward matrix over variants (the tiny hybrid included) is in test_model.py. Here the
ResNet is checked against a reference written out with torch.nn.functional, and timm's hybrids by
their key layout (timm is not installed here; the test against the real library runs where it is).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import vit
from tests.distributed import spawn
from tests.vit.test_convert import CLASSES, D, random_state_dict, timm_shapes
from vit.config import ViTConfig
from vit.hybrid import same_padding
from vit.model import VisionTransformer

HYBRID = "vit_r_tiny_test"  # 32 px, ResNet (1, 1) of width 32 -> stride 8, C' = 256; the ViT of vit_tiny_test


def pixels(batch: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, size, size, 3), generator=g, dtype=torch.uint8)


# --- config and variants ---------------------------------------------------------------------------


def test_hybrid_variants_follow_the_paper():
    # R50+ViT-B/16: ResNet-50 without stage 4, its 3 units moved into stage 3 (stride 16, 1024 channels).
    b16 = vit.get_config("vit_r50_b16")
    assert (b16.backbone_layers, b16.backbone_width, b16.backbone_stride, b16.backbone_channels) == (
        (3, 4, 9),
        64,
        16,
        1024,
    )
    l32 = vit.get_config("vit_r50_l32")
    assert (l32.backbone_layers, l32.backbone_stride, l32.backbone_channels) == ((3, 4, 6, 3), 32, 2048)
    for hybrid, plain in (("vit_r50_b16", "vit_b16"), ("vit_r50_l32", "vit_l32"), (HYBRID, "vit_tiny_test")):
        h, p = vit.get_config(hybrid), vit.get_config(plain)
        assert (h.embed_dim, h.depth, h.num_heads, h.mlp_dim, h.patch_size, h.num_patches) == (
            p.embed_dim,
            p.depth,
            p.num_heads,
            p.mlp_dim,
            p.patch_size,
            p.num_patches,
        )
    assert vit.get_config("vit_b16").backbone_layers is None


def test_hybrid_config_round_trips_through_json():
    config = vit.get_config("vit_r50_b16", image_size=384, num_classes=10)
    again = ViTConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.backbone_layers == (3, 4, 9)
    assert again.architecture()["backbone_layers"] == (3, 4, 9)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"patch_size": 32}, "a hybrid's patch_size is its ResNet's stride: 3 stage\\(s\\) give 16"),
        ({"backbone_width": 48}, "backbone_width must be a positive multiple of 32"),
        ({"backbone_layers": ()}, "backbone_layers must be a non-empty list"),
        ({"backbone_layers": (3, 0, 9)}, "backbone_layers must be a non-empty list"),
        ({"backbone_layers": None}, "backbone_width applies to hybrids only"),
    ],
)
def test_bad_hybrid_configs_fail_with_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        vit.get_config("vit_r50_b16", **overrides)
    assert "\n" not in str(info.value)


# --- sizes -----------------------------------------------------------------------------------------


# timm's hybrids: the published figure (results/benchmark-infer-*.csv, param_count in M) and the exact
# count of the model timm 1.0.31 builds (num_classes 0 for vit_base_r50_s16_224, its default).
@pytest.mark.parametrize(
    "name, num_classes, published, exact",
    [("vit_r50_b16", 0, 97.89e6, 97_890_112), ("vit_r50_l32", 1000, 328.99e6, 328_994_856)],
)
def test_param_counts_match_timm(name, num_classes, published, exact):
    model = vit.create_model(name, device="meta", head="finetune", num_classes=num_classes)
    count = sum(p.numel() for p in model.parameters())
    assert count == exact
    assert count == pytest.approx(published, abs=0.005e6)


@pytest.mark.parametrize("name, image_size", [(HYBRID, 32), ("vit_r50_b16", 240)])
def test_flops_of_the_stem_match_torch_counter(name, image_size):
    # 240 px: 15 x 15 tokens, so the ceil of every strided layer's SAME output size is exercised.
    config = vit.get_config(name, image_size=image_size)
    model = vit.create_model(config, device="meta")
    x = torch.empty(1, config.num_patches, config.patch_dim, dtype=torch.uint8, device="meta")
    with FlopCounterMode(display=False) as counter:
        model.patch_embed(x)
    parts = vit.flops_breakdown(config)
    assert counter.get_total_flops() == parts["backbone"] + parts["patch_embed"]
    assert parts["patch_embed"] == 2 * config.num_patches * config.backbone_channels * config.embed_dim


def test_flops_match_timm():
    # timm's benchmark tables: vit_base_r50_s16_224 21.66 GMACs (its counter adds the norms too).
    flops = vit.count_flops(vit.get_config("vit_r50_b16", num_classes=0, head="finetune"))
    assert flops / 2e9 == pytest.approx(21.66, rel=0.02)
    assert vit.flops_breakdown(vit.get_config("vit_b16"))["backbone"] == 0


# --- the ResNet ------------------------------------------------------------------------------------


def test_same_padding_is_tensorflows():
    # Even input, stride 2: the extra pixel goes at the bottom/right; output size ceil(size / stride).
    assert same_padding(224, 7, 2) == (2, 3)
    assert same_padding(112, 3, 2) == (0, 1)
    assert same_padding(56, 1, 2) == (0, 0)
    assert same_padding(15, 3, 2) == (1, 1)
    assert same_padding(56, 3, 1) == (1, 1)


def reference_resnet(sd: dict[str, torch.Tensor], x: torch.Tensor, prefix: str, layers) -> torch.Tensor:
    """The hybrid's ResNet on a 32 px image, written out with fixed paddings: x (B, 3, 32, 32) -> (B, C', 4, 4)."""

    def conv(x, key, stride=1, pad=(0, 0, 0, 0)):
        w = sd[prefix + key]
        w = (w - w.mean((1, 2, 3), keepdim=True)) / torch.sqrt(
            w.var((1, 2, 3), unbiased=False, keepdim=True) + 1e-8
        )
        return F.conv2d(F.pad(x, pad), w, stride=stride)

    def gn(x, key):
        return F.group_norm(x, 32, sd[prefix + key + ".weight"], sd[prefix + key + ".bias"], eps=1e-5)

    x = F.relu(gn(conv(x, "stem.conv.weight", 2, (2, 3, 2, 3)), "stem.norm"))  # 32 -> 16
    x = F.max_pool2d(F.pad(x, (0, 1, 0, 1), value=-math.inf), 3, 2)  # 16 -> 8
    for i, units in enumerate(layers):
        for j in range(units):
            u = f"stages.{i}.blocks.{j}."
            stride = 2 if i > 0 and j == 0 else 1
            shortcut = (
                gn(conv(x, u + "downsample.conv.weight", stride), u + "downsample.norm") if j == 0 else x
            )
            h = F.relu(gn(conv(x, u + "conv1.weight"), u + "norm1"))
            pad = (0, 1, 0, 1) if stride == 2 else (1, 1, 1, 1)
            h = F.relu(gn(conv(h, u + "conv2.weight", stride, pad), u + "norm2"))
            x = F.relu(gn(conv(h, u + "conv3.weight"), u + "norm3") + shortcut)
    return x


def timm_hybrid_shapes(layers, width: int, embed_dim: int) -> dict[str, tuple[int, ...]]:
    """Key layout of timm's hybrid patch embedding (HybridEmbed over a non-preactivation ResNetV2)."""
    b = "patch_embed.backbone."
    shapes = {
        b + "stem.conv.weight": (width, 3, 7, 7),
        b + "stem.norm.weight": (width,),
        b + "stem.norm.bias": (width,),
    }
    channels = width
    for i, units in enumerate(layers):
        mid, out = width * 2**i, 4 * width * 2**i
        for j in range(units):
            u = f"{b}stages.{i}.blocks.{j}."
            if j == 0:
                shapes[u + "downsample.conv.weight"] = (out, channels, 1, 1)
                shapes |= {u + "downsample.norm.weight": (out,), u + "downsample.norm.bias": (out,)}
            shapes[u + "conv1.weight"] = (mid, channels, 1, 1)
            shapes[u + "conv2.weight"] = (mid, mid, 3, 3)
            shapes[u + "conv3.weight"] = (out, mid, 1, 1)
            for n, c in (("norm1", mid), ("norm2", mid), ("norm3", out)):
                shapes |= {u + n + ".weight": (c,), u + n + ".bias": (c,)}
            channels = out
    return shapes | {
        "patch_embed.proj.weight": (embed_dim, channels, 1, 1),
        "patch_embed.proj.bias": (embed_dim,),
    }


def test_timm_style_hybrid_converts_and_matches_the_reference():
    shapes = timm_shapes() | timm_hybrid_shapes((1, 1), 32, D)  # the tiny encoder, hybrid patch embedding
    sd = random_state_dict(shapes)
    converted = vit.convert_state_dict(sd, "timm")
    config = vit.config_from_state_dict(converted, "timm")
    assert config == vit.get_config(HYBRID, num_classes=CLASSES, head="finetune")
    model = VisionTransformer(config)
    model.load_state_dict(converted)  # strict: every key mapped, every shape right
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    features = reference_resnet(sd, x, "patch_embed.backbone.", (1, 1))  # (2, 256, 4, 4)
    tokens = F.conv2d(features, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"])
    with torch.no_grad():
        torch.testing.assert_close(
            model.patch_embed(x), tokens.flatten(2).transpose(1, 2), rtol=1e-4, atol=1e-4
        )
    assert model.config.mean == (0.5, 0.5, 0.5)


def test_timm_r50_b16_layout_converts_to_vit_r50_b16():
    # The real key names and shapes of vit_base_r50_s16_224, on the meta device.
    shapes = timm_hybrid_shapes((3, 4, 9), 64, 768)
    shapes |= {
        "cls_token": (1, 1, 768),
        "pos_embed": (1, 197, 768),
        "norm.weight": (768,),
        "norm.bias": (768,),
    }
    for i in range(12):
        for key, shape in timm_shapes().items():
            if key.startswith("blocks.0."):
                shapes[key.replace("blocks.0.", f"blocks.{i}.")] = tuple(
                    {D: 768, 2 * D: 3072, 3 * D: 2304}.get(s, s) for s in shape
                )
    sd = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    converted = vit.convert_state_dict(sd, "timm")
    config = vit.config_from_state_dict(converted, "timm")
    assert config == vit.get_config("vit_r50_b16", num_classes=0, head="finetune")
    expected = VisionTransformer(config, device="meta").state_dict()
    assert {k: tuple(v.shape) for k, v in converted.items()} == {
        k: tuple(v.shape) for k, v in expected.items()
    }


@pytest.mark.parametrize("timm_name, name", [("vit_base_r50_s16_224", "vit_r50_b16")])
def test_real_timm_hybrid_computes_the_same(timm_name, name):
    import timm

    torch.manual_seed(0)
    reference = timm.create_model(timm_name, pretrained=False, num_classes=5).eval()
    with torch.no_grad():  # move every tensor off its init value (GroupNorm affine, zero biases, head)
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    converted = vit.convert_state_dict(reference.state_dict(), "timm")
    config = vit.config_from_state_dict(converted, "timm")
    assert (config.name, config.backbone_layers) == (name, vit.get_config(name).backbone_layers)
    model = VisionTransformer(config).eval()
    model.load_state_dict(converted)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), rtol=1e-4, atol=1e-4)
        assert torch.allclose(model.forward_features(x), reference.forward_features(x), rtol=1e-4, atol=1e-4)


def test_the_stem_sees_the_same_image_from_patches_and_from_floats():
    # The uint8 patches are put back together into the image the float path gets directly.
    model = vit.create_model(HYBRID, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    images = pixels(2)
    x = (images.float() / 255 - torch.tensor(model.config.mean)) / torch.tensor(model.config.std)
    with torch.no_grad():
        from_patches = model.patch_embed(vit.patchify(images, 8))
        from_floats = model.patch_embed(x.permute(0, 3, 1, 2))
    torch.testing.assert_close(from_patches, from_floats, rtol=1e-4, atol=1e-5)
    assert from_patches.shape == (2, 16, 64)


def test_weight_standardization_makes_the_stem_blind_to_kernel_scale():
    model = vit.create_model(HYBRID)
    x = vit.patchify(pixels(2), 8)
    with torch.no_grad():
        before = model.patch_embed(x)
        for module in model.patch_embed.backbone.modules():
            if isinstance(module, nn.Conv2d):
                module.weight.mul_(3.0).add_(0.5)  # scale and shift every kernel
        torch.testing.assert_close(model.patch_embed(x), before, rtol=1e-4, atol=1e-4)


def test_a_hybrid_needs_every_patch():
    model = vit.create_model(HYBRID)
    x = vit.patchify(pixels(1), 8)
    with pytest.raises(ValueError, match="got 8 patches, but this hybrid was built for 16") as info:
        model(x[:, :8])
    assert "\n" not in str(info.value)


def test_export_round_trip_and_another_resolution(tmp_path):
    torch.manual_seed(0)
    model = vit.create_model(HYBRID)
    vit.save_pretrained(tmp_path, model.state_dict(), model.config)
    again, config = vit.load_pretrained(tmp_path)
    assert config == model.config
    x = vit.patchify(pixels(2), 8)
    torch.testing.assert_close(again(x), model(x))
    larger, _ = vit.load_pretrained(tmp_path, image_size=48)  # the ResNet takes any size; pos_embed resampled
    assert larger.forward_features(vit.patchify(pixels(2, size=48), 8)).shape == (2, 1 + 36, 64)


# --- FSDP2 -----------------------------------------------------------------------------------------


def _fsdp_worker(rank: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    from vit.parallelize import apply_activation_checkpointing, apply_fsdp

    torch.manual_seed(0)
    reference = vit.create_model(HYBRID)
    nn.init.normal_(reference.head.fc.weight, std=0.5)
    x = vit.patchify(pixels(4, seed=3), 8)
    y = torch.tensor([0, 3, 6, 9])
    F.cross_entropy(reference(x), y).backward()
    model = vit.create_model(HYBRID, device="meta")
    apply_activation_checkpointing(model)
    apply_fsdp(model, param_dtype=None)
    model.to_empty(device="cpu")
    model.init_weights()
    for name, param in model.named_parameters():  # the stem is sharded with the root, half per rank
        rows = param.shape[0]
        assert abs(param.to_local().numel() - param.numel() / 2) <= param.numel() / rows, name
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference.get_parameter(name).detach()
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    mine = slice(2 * rank, 2 * rank + 2)
    logits = model(x[mine])
    torch.testing.assert_close(logits, reference(x[mine]), rtol=1e-5, atol=1e-5)
    F.cross_entropy(logits, y[mine]).backward()
    for name, param in model.named_parameters():
        expected = reference.get_parameter(name).grad
        torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=1e-4, atol=1e-5, msg=name)


def test_fsdp_shards_the_hybrid_and_matches_the_plain_gradients():
    spawn(_fsdp_worker)
