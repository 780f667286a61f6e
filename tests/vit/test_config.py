"""ViTConfig, the variant table, and the sizes they give: parameter counts and FLOPs against the papers."""

from __future__ import annotations

import json

import pytest

import vit
from vit.config import ViTConfig


def test_config_round_trips_through_json():
    config = vit.get_config("vit_b16", image_size=384, num_classes=10, pool="gap", mean=(0.1, 0.2, 0.3))
    again = ViTConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert isinstance(again.mean, tuple)


def test_derived_sizes():
    config = vit.get_config("vit_h14", image_size=518)
    assert (config.grid_size, config.num_patches, config.patch_dim, config.head_dim) == (37, 37 * 37, 588, 80)
    assert config.pre_logits_dim == 1280
    assert vit.get_config("vit_b16", representation_size=512).pre_logits_dim == 512
    assert vit.get_config("vit_b16", head="finetune", representation_size=512).pre_logits_dim == 768


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"image_size": 225}, "not divisible by patch_size 16"),
        ({"embed_dim": 770}, "not divisible by num_heads 12"),
        ({"pool": "max"}, "pool must be one of"),
        ({"head": "mlp"}, "head must be one of"),
        ({"num_classes": -1}, "num_classes must be >= 0"),
        ({"mean": (0.5, 0.5)}, "one value per channel"),
        ({"std": (0.5, 0.0, 0.5)}, "std must be positive"),
        ({"depth": 0}, "depth must be a positive integer"),
    ],
)
def test_bad_configs_fail_with_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        vit.get_config("vit_b16", **overrides)
    assert "\n" not in str(info.value)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown model 'vit_x16'; choose one of: vit_ti16, vit_s16") as info:
        vit.create_model("vit_x16")
    assert "vit_G14" in str(info.value)
    with pytest.raises(ValueError, match=r"unknown ViTConfig field\(s\) \['width'\]"):
        vit.create_model("vit_tiny_test", width=3)
    with pytest.raises(ValueError, match="unknown ViTConfig field"):
        ViTConfig.from_dict({**vit.VARIANTS["vit_b16"].to_dict(), "attn_drop_rate": 0.1})


def test_variant_table_follows_the_papers():
    shape = {
        name: (c.embed_dim, c.depth, c.mlp_dim, c.num_heads, c.patch_size) for name, c in vit.VARIANTS.items()
    }
    assert shape["vit_ti16"] == (192, 12, 768, 3, 16)
    assert shape["vit_s16"] == (384, 12, 1536, 6, 16)
    assert shape["vit_b16"] == (768, 12, 3072, 12, 16)
    assert shape["vit_b32"] == (768, 12, 3072, 12, 32)
    assert shape["vit_l16"] == (1024, 24, 4096, 16, 16)
    assert shape["vit_l32"] == (1024, 24, 4096, 16, 32)
    assert shape["vit_h14"] == (1280, 32, 5120, 16, 14)
    assert shape["vit_g14"] == (1408, 40, 6144, 16, 14)
    assert shape["vit_G14"] == (1664, 48, 8192, 16, 14)
    assert shape["vit_s4"] == (384, 12, 1536, 6, 4)  # S's widths on 4-pixel patches, at 32 px
    assert vit.VARIANTS["vit_s4"].num_patches == 64


def count_params(name: str, **overrides) -> int:
    model = vit.create_model(name, device="meta", **overrides)
    return sum(p.numel() for p in model.parameters())


# Published counts that exclude the classification head (the encoder alone: what the ViT paper's
# Table 1 and Zhai et al.'s Table 2 count; with a 1000-class head B/16 would be 86.6M, 0.7% off).
ENCODER_PARAMS = {
    "vit_b16": 86e6,  # Dosovitskiy et al. 2021, Table 1
    "vit_l16": 304e6,  # ibid.
    "vit_h14": 632e6,  # ibid.
    "vit_g14": 1011e6,  # Zhai et al. 2022, Table 2
    "vit_G14": 1843e6,  # ibid.
}


@pytest.mark.parametrize("name", ENCODER_PARAMS)
def test_encoder_param_counts_match_the_papers(name):
    count = count_params(name, head="finetune", num_classes=0)
    assert count == pytest.approx(ENCODER_PARAMS[name], rel=0.005)


# Published counts that include a 1000-class linear head (ImageNet-1k models).
HEAD_1K_PARAMS = {
    # torchvision's weight tables give exact integers (meta["num_params"] of ViT_*_Weights).
    "vit_b16": (86_567_656, 0),
    "vit_b32": (88_224_232, 0),
    "vit_l16": (304_326_632, 0),
    "vit_l32": (306_535_400, 0),
    "vit_h14": (632_045_800, 0),
    # timm's model cards (vit_tiny/small_patch16_224.augreg_in21k_ft_in1k), in 0.1M.
    "vit_ti16": (5.7e6, 0.005),
    "vit_s16": (22.1e6, 0.005),
}


@pytest.mark.parametrize("name", HEAD_1K_PARAMS)
def test_param_counts_with_an_imagenet_head_match_published_ones(name):
    expected, rel = HEAD_1K_PARAMS[name]
    count = count_params(name, head="finetune", num_classes=1000)
    assert count == pytest.approx(expected, rel=rel, abs=0)


@pytest.mark.parametrize("name, gflops", [("vit_b16", 35.2), ("vit_l16", 123.2), ("vit_h14", 334.8)])
def test_flops_match_the_paper(name, gflops):
    assert vit.count_flops(vit.get_config(name)) / 1e9 == pytest.approx(gflops, rel=0.01)


def test_flops_grow_as_the_model_does():
    # Attention scores grow with T^2, the rest with T: 4x the pixels is a bit more than 4x the FLOPs.
    base = vit.count_flops(vit.get_config("vit_b16"))
    big = vit.count_flops(vit.get_config("vit_b16", image_size=448))
    assert 4 * base < big < 4.5 * base
    parts = vit.flops_breakdown(vit.get_config("vit_b16", num_classes=0, head="finetune"))
    assert parts["head"] == 0
    assert parts["patch_embed"] == 2 * 196 * 768 * 768
    assert 3 * parts["mlp"] == 8 * parts["qkv"]  # 2 T D 4D against T D 3D
    assert parts["attention_scores"] == parts["attention_values"] == 2 * 12 * 197 * 197 * 768
