"""Exports for timm and transformers: the libraries' own models, loaded from the exported files, compute
what the vitray model computes, carry its normalization, and import back to the same state dict."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import vit
from vit.config import IMAGENET_MEAN, IMAGENET_STD
from vit.export import check_exportable, save_hf, save_timm, to_hf, to_timm

TINY = "vit_tiny_test"  # embed_dim 64, depth 2, 4 heads, mlp 128, patch 8, image 32
TOL = {"rtol": 1e-4, "atol": 1e-4}  # the import tests' tolerance


def tiny(**overrides) -> vit.VisionTransformer:
    """A tiny vitray model with ImageNet normalization (not the libraries' default) and no zero or
    constant tensor left (a zero-init classifier would hide a wrong mapping)."""
    model = vit.create_model(TINY, mean=IMAGENET_MEAN, std=IMAGENET_STD, **overrides)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def images(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def pixels(batch: int = 3) -> torch.Tensor:
    """uint8 images (B, H, W, C), for the path where each library applies the recorded mean/std."""
    return torch.randint(
        0, 256, (batch, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )


def assert_same_state_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --- timm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, encoder_only",
    [
        ({"head": "finetune"}, False),  # a classifier on [CLS]
        ({"head": "finetune", "pool": "gap"}, False),  # mean of the patch tokens
        ({"head": "finetune", "num_classes": 0}, False),  # no head
        ({}, True),  # the pretraining head dropped
    ],
)
def test_timm_loads_the_export_and_computes_the_same(tmp_path, overrides, encoder_only):
    import timm
    from timm.data import resolve_data_config

    model = tiny(**overrides)
    save_timm(tmp_path, model.state_dict(), model.config, encoder_only=encoder_only)
    spec = json.loads((tmp_path / "config.json").read_text())
    # The documented way: the named model with the recorded arguments, then the state dict.
    ref = timm.create_model(spec["architecture"], pretrained=False, **spec["model_args"]).eval()
    ref.load_state_dict(load_file(tmp_path / "model.safetensors"))
    # timm's own folder loader, which also reads the preprocessing.
    local = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    x = images()
    with torch.no_grad():
        for library_model in (ref, local):
            features = library_model.forward_head(library_model.forward_features(x), pre_logits=True)
            torch.testing.assert_close(features, model.embed(x), **TOL)
            expected = model.embed(x) if encoder_only else model(x)
            torch.testing.assert_close(library_model(x), expected, **TOL)
    data = resolve_data_config({}, model=local)
    assert tuple(data["mean"]) == IMAGENET_MEAN and tuple(data["std"]) == IMAGENET_STD
    assert tuple(data["input_size"]) == (3, 32, 32)
    # The uint8 path: timm's normalization from the export gives vitray's logits on the same pixels.
    u8 = pixels()
    as_timm_normalizes = (u8.float() / 255 - torch.tensor(data["mean"])) / torch.tensor(data["std"])
    patches = vit.patchify(u8, 8)  # the model normalizes these itself, with its own buffers
    with torch.no_grad():
        expected = model.embed(patches) if encoder_only else model(patches)
        torch.testing.assert_close(local(as_timm_normalizes.permute(0, 3, 1, 2)), expected, **TOL)


@pytest.mark.parametrize(
    "overrides", [{"head": "finetune"}, {"head": "finetune", "num_classes": 0, "qkv_bias": False}]
)
def test_timm_export_imports_back_to_the_same_state_dict(overrides):
    model = tiny(**overrides)
    exported, spec = to_timm(model.state_dict(), model.config)
    mean, std = spec["pretrained_cfg"]["mean"], spec["pretrained_cfg"]["std"]
    back = vit.convert_state_dict(exported, "timm", mean=mean, std=std)
    assert_same_state_dict(back, model.state_dict())
    config = vit.config_from_state_dict(back, "timm", num_heads=spec["model_args"]["num_heads"])
    assert config.architecture() == model.config.architecture()


# --- transformers -------------------------------------------------------------------------------------


def test_hf_classifier_loads_and_computes_the_same(tmp_path):
    from transformers import ViTForImageClassification, ViTImageProcessor

    model = tiny(head="finetune")
    save_hf(tmp_path, model.state_dict(), model.config)
    hf = ViTForImageClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = images()
    with torch.no_grad():
        out = hf(pixel_values=x, output_hidden_states=True)
        torch.testing.assert_close(out.logits, model(x), **TOL)
        cls = hf.vit.layernorm(out.hidden_states[-1])[:, 0]  # [CLS] after the final LayerNorm
        torch.testing.assert_close(cls, model.embed(x), **TOL)
    # The export's preprocessor applies the model's mean/std: the uint8 path agrees.
    processor = ViTImageProcessor.from_pretrained(tmp_path)
    assert list(processor.image_mean) == list(IMAGENET_MEAN) and list(processor.image_std) == list(
        IMAGENET_STD
    )
    assert processor.size == {"height": 32, "width": 32}
    u8 = pixels()
    inputs = processor(images=list(u8.numpy()), do_resize=False, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(hf(**inputs).logits, model(vit.patchify(u8, 8)), **TOL)


@pytest.mark.parametrize(
    "overrides, encoder_only",
    [
        ({"num_classes": 0}, False),  # the pretraining head's hidden layer: ViTModel's pooler
        ({}, True),  # pretraining head and classifier dropped
        ({"head": "finetune", "num_classes": 0}, False),
    ],
)
def test_hf_vit_model_loads_and_computes_the_same(tmp_path, overrides, encoder_only):
    from transformers import ViTModel

    model = tiny(**overrides)
    save_hf(tmp_path, model.state_dict(), model.config, encoder_only=encoder_only)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["ViTModel"]
    pooler = model.config.head == "pretrain" and not encoder_only
    hf = ViTModel.from_pretrained(tmp_path, add_pooling_layer=pooler, attn_implementation="eager").eval()
    x = images()
    with torch.no_grad():
        out = hf(pixel_values=x)
        torch.testing.assert_close(out.last_hidden_state, model.forward_features(x), **TOL)
        torch.testing.assert_close(out.last_hidden_state[:, 0], model.embed(x), **TOL)
        if pooler:
            torch.testing.assert_close(out.pooler_output, model.embed(x, pre_logits=True), **TOL)


@pytest.mark.parametrize("overrides", [{"head": "finetune"}, {"num_classes": 0, "representation_size": 48}])
def test_hf_export_imports_back_to_the_same_state_dict(overrides):
    model = tiny(**overrides)
    exported, hf_config, preprocessor = to_hf(model.state_dict(), model.config)
    back = vit.convert_state_dict(
        exported, "hf", mean=preprocessor["image_mean"], std=preprocessor["image_std"]
    )
    assert_same_state_dict(back, model.state_dict())
    config = vit.config_from_hf(hf_config)
    assert config.architecture() == model.config.architecture() and config.num_heads == model.config.num_heads


# --- what a target cannot represent ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, overrides, match",
    [
        ("timm", {}, "no Linear -> tanh layer before its classifier.*pass --encoder-only"),
        ("timm", {"num_classes": 0}, "no Linear -> tanh layer"),
        ("timm", {"head": "finetune", "norm_eps": 1e-12}, "LayerNorm eps 1e-06, this model 1e-12.*--to hf"),
        ("hf", {}, "classifies the \\[CLS\\] token directly.*pass --encoder-only"),
        ("hf", {"head": "finetune", "pool": "gap"}, "pool gap.*--to timm"),
        ("timm", {"name": "vit_r_tiny_test"}, "hybrid"),
        ("hf", {"name": "vit_r_tiny_test"}, "hybrid"),
    ],
)
def test_what_the_target_cannot_represent_is_a_one_line_error(target, overrides, match):
    name = overrides.pop("name", TINY)
    config = vit.get_config(name, **overrides)
    with pytest.raises(ValueError, match=match) as info:
        check_exportable(config, target)
    assert "\n" not in str(info.value)
    model = vit.create_model(config, device="meta")
    export = to_timm if target == "timm" else to_hf
    with pytest.raises(ValueError, match=match):
        export(model.state_dict(), config)


def test_weights_of_another_model_are_refused():
    model = tiny(head="finetune")
    other = vit.get_config(TINY, head="finetune", num_classes=3)
    for export in (to_timm, to_hf):
        with pytest.raises(ValueError, match="num_classes 10, the config says 3"):
            export(model.state_dict(), other)


def test_an_mlp_width_that_float_ratios_miss_is_built_exactly_by_timm():
    # timm sizes the MLP as int(embed_dim * mlp_ratio): 28 * (61 / 28) is 60.99999..., one unit short.
    import timm

    config = vit.get_config(TINY, embed_dim=28, num_heads=4, mlp_dim=61, head="finetune")
    model = vit.create_model(config).eval()
    exported, spec = to_timm(model.state_dict(), config)
    ref = timm.create_model(spec["architecture"], pretrained=False, **spec["model_args"]).eval()
    ref.load_state_dict(exported)
    with torch.no_grad():
        torch.testing.assert_close(ref.forward_features(images()), model.forward_features(images()), **TOL)
