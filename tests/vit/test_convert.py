"""Weight conversion from transformers, timm and torchvision: the converted model computes the same function.

transformers is installed here, so its models are the reference. timm and torchvision are not: their
state dicts are built with the key layout and shapes of their source code, and their forward is
computed by an independent reference below (torchvision's with nn.MultiheadAttention, as it does).
The tests against the real libraries run wherever they are installed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import vit
from vit.config import IMAGENET_MEAN, IMAGENET_STD
from vit.model import VisionTransformer

D, DEPTH, HEADS, MLP, P, SIZE, CLASSES = 64, 2, 4, 128, 8, 32, 5
T = 1 + (SIZE // P) ** 2


def randomize(module: nn.Module, seed: int = 0) -> None:
    """Random values everywhere (norms and heads too), so every tensor's mapping matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 1.0 if ("norm" in name or ".ln" in name) and name.endswith("weight") else 0.0  # near 1
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + scale)


def random_state_dict(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    for k in sd:  # norm scales near 1, as trained ones are
        if ("norm" in k or ".ln" in k or k.startswith("encoder.ln")) and k.endswith("weight"):
            sd[k] = sd[k] + 1.0
    return sd


def load_converted(sd: dict[str, torch.Tensor], source: str, **overrides) -> VisionTransformer:
    converted = vit.convert_state_dict(sd, source)
    model = VisionTransformer(vit.config_from_state_dict(converted, source, num_heads=HEADS, **overrides))
    model.load_state_dict(converted)
    return model.eval()


def images(batch: int = 2, size: int = SIZE) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


# --- transformers ---------------------------------------------------------------------------------


def hf_config(**kwargs):
    import transformers

    return transformers.ViTConfig(
        image_size=SIZE,
        patch_size=P,
        hidden_size=D,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        intermediate_size=MLP,
        attn_implementation="eager",  # the plain softmax path, independent of SDPA
        **kwargs,
    )


def test_hf_vit_model_embeddings_and_pooler_match():
    from transformers import ViTModel

    hf = ViTModel(hf_config()).eval()
    randomize(hf)
    model = load_converted(hf.state_dict(), "hf")
    assert (
        model.config.norm_eps == 1e-12 and model.config.head == "pretrain" and model.config.num_classes == 0
    )
    x = images()
    with torch.no_grad():
        out = hf(pixel_values=x)
        torch.testing.assert_close(model.forward_features(x), out.last_hidden_state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.embed(x), out.last_hidden_state[:, 0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.embed(x, pre_logits=True), out.pooler_output, rtol=1e-4, atol=1e-4)


def test_hf_classifier_logits_match_and_published_key_names_convert(tmp_path):
    from transformers import ViTForImageClassification

    hf = ViTForImageClassification(hf_config(num_labels=CLASSES)).eval()
    randomize(hf)
    # save_pretrained writes the published checkpoints' names (vit.encoder.layer.N.attention.attention.query).
    hf.save_pretrained(tmp_path)
    published = load_file(tmp_path / "model.safetensors")
    assert any(".attention.attention.query." in k for k in published)
    assert all(k.startswith(("vit.", "classifier.")) for k in published)
    x = images()
    with torch.no_grad():
        expected = hf(pixel_values=x).logits
        for sd in (hf.state_dict(), published):
            model = load_converted(sd, "hf")
            assert (model.config.head, model.config.num_classes) == ("finetune", CLASSES)
            torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-4)
        # The uint8 path: the published google/vit-* models scale pixels to [-1, 1].
        pixels = torch.randint(0, 256, (2, SIZE, SIZE, 3), dtype=torch.uint8)
        as_hf_expects = (pixels.float() / 255 - 0.5) / 0.5
        torch.testing.assert_close(
            model(vit.patchify(pixels, P)),
            hf(pixel_values=as_hf_expects.permute(0, 3, 1, 2)).logits,
            rtol=1e-4,
            atol=1e-4,
        )


def test_hf_interpolated_position_embeddings_match_resampling():
    from transformers import ViTModel

    hf = ViTModel(hf_config(), add_pooling_layer=False).eval()
    randomize(hf)
    model = load_converted(hf.state_dict(), "hf", image_size=48)  # loading resamples pos_embed
    x = images(size=48)
    with torch.no_grad():
        expected = hf(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
        torch.testing.assert_close(model.forward_features(x), expected, rtol=1e-4, atol=1e-4)


def test_hf_config_maps_to_a_vit_config():
    config = vit.config_from_hf(hf_config(layer_norm_eps=1e-6, qkv_bias=False))
    assert (config.embed_dim, config.depth, config.num_heads, config.mlp_dim) == (D, DEPTH, HEADS, MLP)
    assert (config.image_size, config.patch_size, config.norm_eps, config.qkv_bias) == (SIZE, P, 1e-6, False)
    with pytest.raises(ValueError, match="exact GELU"):
        vit.config_from_hf({**hf_config().to_dict(), "hidden_act": "relu"})


# --- timm -----------------------------------------------------------------------------------------


def timm_shapes(pre_logits: int | None = None, no_embed_class: bool = False) -> dict[str, tuple[int, ...]]:
    """Key layout of timm.models.vision_transformer.VisionTransformer (class token, qkv_bias)."""
    shapes = {
        "cls_token": (1, 1, D),
        "pos_embed": (1, T - 1 if no_embed_class else T, D),
        "patch_embed.proj.weight": (D, 3, P, P),
        "patch_embed.proj.bias": (D,),
    }
    for i in range(DEPTH):
        b = f"blocks.{i}."
        shapes |= {
            b + "norm1.weight": (D,),
            b + "norm1.bias": (D,),
            b + "attn.qkv.weight": (3 * D, D),
            b + "attn.qkv.bias": (3 * D,),
            b + "attn.proj.weight": (D, D),
            b + "attn.proj.bias": (D,),
            b + "norm2.weight": (D,),
            b + "norm2.bias": (D,),
            b + "mlp.fc1.weight": (MLP, D),
            b + "mlp.fc1.bias": (MLP,),
            b + "mlp.fc2.weight": (D, MLP),
            b + "mlp.fc2.bias": (D,),
        }
    shapes |= {"norm.weight": (D,), "norm.bias": (D,)}
    width = D
    if pre_logits:  # older timm: representation layer `pre_logits.fc` (Linear + Tanh)
        shapes |= {"pre_logits.fc.weight": (pre_logits, D), "pre_logits.fc.bias": (pre_logits,)}
        width = pre_logits
    return shapes | {"head.weight": (CLASSES, width), "head.bias": (CLASSES,)}


def timm_reference(
    sd: dict[str, torch.Tensor], x: torch.Tensor, no_embed_class: bool = False
) -> torch.Tensor:
    """timm's ViT forward, written out: conv patch embed, fused qkv as (B, T, 3, H, hd), pre-LN blocks."""
    b = x.shape[0]
    x = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=P)
    x = x.flatten(2).transpose(1, 2)  # (B, N, D)
    cls = sd["cls_token"].expand(b, -1, -1)
    if no_embed_class:
        x = torch.cat([cls, x + sd["pos_embed"]], dim=1)
    else:
        x = torch.cat([cls, x], dim=1) + sd["pos_embed"]
    for i in range(DEPTH):
        p = f"blocks.{i}."
        h = F.layer_norm(x, (D,), sd[p + "norm1.weight"], sd[p + "norm1.bias"], eps=1e-6)
        qkv = F.linear(h, sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"])
        q, k, v = qkv.reshape(b, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)).softmax(-1)
        h = (attn @ v).transpose(1, 2).reshape(b, T, D)
        x = x + F.linear(h, sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"])
        h = F.layer_norm(x, (D,), sd[p + "norm2.weight"], sd[p + "norm2.bias"], eps=1e-6)
        h = F.linear(
            F.gelu(F.linear(h, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"])),
            sd[p + "mlp.fc2.weight"],
            sd[p + "mlp.fc2.bias"],
        )
        x = x + h
    x = F.layer_norm(x, (D,), sd["norm.weight"], sd["norm.bias"], eps=1e-6)[:, 0]
    if "pre_logits.fc.weight" in sd:
        x = torch.tanh(F.linear(x, sd["pre_logits.fc.weight"], sd["pre_logits.fc.bias"]))
    return F.linear(x, sd["head.weight"], sd["head.bias"])


@pytest.mark.parametrize("pre_logits, no_embed_class", [(None, False), (48, False), (None, True)])
def test_timm_conversion_matches_the_reference(pre_logits, no_embed_class):
    sd = random_state_dict(timm_shapes(pre_logits, no_embed_class))
    model = load_converted(sd, "timm")
    assert model.config.head == ("pretrain" if pre_logits else "finetune")
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), timm_reference(sd, x, no_embed_class), rtol=1e-4, atol=1e-4)
    assert model.config.mean == (0.5, 0.5, 0.5)


def test_timm_parts_vitray_lacks_are_errors():
    sd = random_state_dict(timm_shapes() | {"blocks.0.ls1.gamma": (D,)})
    with pytest.raises(ValueError, match=r"cannot convert 1 key\(s\).*blocks\.0\.ls1\.gamma"):
        vit.convert_state_dict(sd, "timm")
    sd = random_state_dict(timm_shapes() | {"fc_norm.weight": (D,), "fc_norm.bias": (D,)})
    with pytest.raises(ValueError, match="fc_norm"):
        vit.convert_state_dict(sd, "timm")
    with pytest.raises(ValueError, match="unknown source 'jax'"):
        vit.convert_state_dict(sd, "jax")


def test_config_is_inferred_from_a_converted_b16():
    # Real ViT-B/16 shapes, on the meta device: nothing is allocated.
    sd = {}
    for key, shape in timm_shapes().items():
        shape = tuple({D: 768, MLP: 3072, 3 * D: 2304, P: 16, T: 197, CLASSES: 1000}.get(s, s) for s in shape)
        sd[key.replace("blocks.1.", "blocks.11.")] = torch.empty(shape, device="meta")
    sd |= {
        k.replace("blocks.0.", f"blocks.{i}."): v
        for k, v in sd.items()
        if "blocks.0." in k
        for i in range(1, 11)
    }
    config = vit.config_from_state_dict(vit.convert_state_dict(sd, "timm"))
    assert config == vit.get_config("vit_b16", head="finetune")


# --- torchvision ----------------------------------------------------------------------------------


def torchvision_shapes(representation_size: int | None = None, legacy_mlp: bool = False) -> dict:
    """Key layout of torchvision.models.vision_transformer.VisionTransformer."""
    fc1, fc2 = ("linear_1", "linear_2") if legacy_mlp else ("0", "3")
    shapes = {
        "class_token": (1, 1, D),
        "conv_proj.weight": (D, 3, P, P),
        "conv_proj.bias": (D,),
        "encoder.pos_embedding": (1, T, D),
    }
    for i in range(DEPTH):
        b = f"encoder.layers.encoder_layer_{i}."
        shapes |= {
            b + "ln_1.weight": (D,),
            b + "ln_1.bias": (D,),
            b + "self_attention.in_proj_weight": (3 * D, D),
            b + "self_attention.in_proj_bias": (3 * D,),
            b + "self_attention.out_proj.weight": (D, D),
            b + "self_attention.out_proj.bias": (D,),
            b + "ln_2.weight": (D,),
            b + "ln_2.bias": (D,),
            b + f"mlp.{fc1}.weight": (MLP, D),
            b + f"mlp.{fc1}.bias": (MLP,),
            b + f"mlp.{fc2}.weight": (D, MLP),
            b + f"mlp.{fc2}.bias": (D,),
        }
    shapes |= {"encoder.ln.weight": (D,), "encoder.ln.bias": (D,)}
    width = D
    if representation_size:
        shapes |= {
            "heads.pre_logits.weight": (representation_size, D),
            "heads.pre_logits.bias": (representation_size,),
        }
        width = representation_size
    return shapes | {"heads.head.weight": (CLASSES, width), "heads.head.bias": (CLASSES,)}


def torchvision_reference(sd: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """torchvision's forward, rebuilt from torch modules: Conv2d, nn.MultiheadAttention, LayerNorm."""
    conv = nn.Conv2d(3, D, P, stride=P)
    conv.load_state_dict({"weight": sd["conv_proj.weight"], "bias": sd["conv_proj.bias"]})
    x = conv(x).reshape(x.shape[0], D, -1).permute(0, 2, 1)
    x = torch.cat([sd["class_token"].expand(x.shape[0], -1, -1), x], dim=1) + sd["encoder.pos_embedding"]
    for i in range(DEPTH):
        p = f"encoder.layers.encoder_layer_{i}."
        layer = {k.removeprefix(p): v for k, v in sd.items() if k.startswith(p)}
        fc1, fc2 = ("linear_1", "linear_2") if "mlp.linear_1.weight" in layer else ("0", "3")
        mha = nn.MultiheadAttention(D, HEADS, batch_first=True)
        mha.load_state_dict(
            {k.removeprefix("self_attention."): v for k, v in layer.items() if "self_attention" in k}
        )
        h = F.layer_norm(x, (D,), layer["ln_1.weight"], layer["ln_1.bias"], eps=1e-6)
        x = x + mha(h, h, h, need_weights=False)[0]
        h = F.layer_norm(x, (D,), layer["ln_2.weight"], layer["ln_2.bias"], eps=1e-6)
        h = F.gelu(F.linear(h, layer[f"mlp.{fc1}.weight"], layer[f"mlp.{fc1}.bias"]))
        x = x + F.linear(h, layer[f"mlp.{fc2}.weight"], layer[f"mlp.{fc2}.bias"])
    x = F.layer_norm(x, (D,), sd["encoder.ln.weight"], sd["encoder.ln.bias"], eps=1e-6)[:, 0]
    if "heads.pre_logits.weight" in sd:
        x = torch.tanh(F.linear(x, sd["heads.pre_logits.weight"], sd["heads.pre_logits.bias"]))
    return F.linear(x, sd["heads.head.weight"], sd["heads.head.bias"])


@pytest.mark.parametrize("representation_size, legacy_mlp", [(None, False), (48, False), (None, True)])
def test_torchvision_conversion_matches_the_reference(representation_size, legacy_mlp):
    sd = random_state_dict(torchvision_shapes(representation_size, legacy_mlp))
    model = load_converted(sd, "torchvision")
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), torchvision_reference(sd, x), rtol=1e-4, atol=1e-4)
    # torchvision's weights expect ImageNet normalization; the uint8 path applies it.
    assert (model.config.mean, model.config.std) == (IMAGENET_MEAN, IMAGENET_STD)
    pixels = torch.randint(0, 256, (2, SIZE, SIZE, 3), dtype=torch.uint8)
    as_torchvision_expects = (pixels.float() / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    with torch.no_grad():
        torch.testing.assert_close(
            model(vit.patchify(pixels, P)),
            torchvision_reference(sd, as_torchvision_expects.permute(0, 3, 1, 2)),
            rtol=1e-4,
            atol=1e-4,
        )


# --- the real libraries, where installed ------------------------------------------------------------


def test_real_timm_models_convert():
    import timm

    x = images()
    for kwargs in ({}, {"class_token": True, "no_embed_class": True}, {"qkv_bias": False}):
        ref = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=SIZE,
            patch_size=P,
            embed_dim=D,
            depth=DEPTH,
            num_heads=HEADS,
            mlp_ratio=MLP / D,
            num_classes=CLASSES,
            **kwargs,
        ).eval()
        randomize(ref)
        model = load_converted(ref.state_dict(), "timm")
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


def test_real_torchvision_models_convert():
    import torchvision as tv

    x = images()
    for representation_size in (None, 48):
        ref = tv.models.VisionTransformer(
            image_size=SIZE,
            patch_size=P,
            num_layers=DEPTH,
            num_heads=HEADS,
            hidden_dim=D,
            mlp_dim=MLP,
            num_classes=CLASSES,
            representation_size=representation_size,
        ).eval()
        randomize(ref)
        model = load_converted(ref.state_dict(), "torchvision")
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


def test_hf_with_a_missing_projection_names_the_source_key():
    from transformers import ViTModel

    sd = ViTModel(hf_config()).state_dict()
    del sd["layers.1.attention.k_proj.weight"]
    with pytest.raises(ValueError, match=r"has no layers\.1\.attention\.k_proj\.weight \(beside") as info:
        vit.convert_state_dict(sd, "hf")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("library", ["timm", "hf"])
def test_each_librarys_names_are_one_table_read_both_ways(library):
    """`vit.convert.NAMES`: every key of a vitray ViT, renamed to the library's name (as `vit.export` does)
    and back (as `convert_state_dict` does), is itself again; transformers' names are the published ones."""
    from vit.convert import rename

    keys = vit.create_model("vit_tiny_test", head="pretrain", num_classes=4).state_dict().keys()
    keys = [k for k in keys if k not in ("patch_embed.mean", "patch_embed.std")]  # the preprocessing's
    if library == "hf":  # transformers keeps Q, K and V apart: split as the export does
        roles = ("query", "key", "value")
        keys = [
            n for k in keys for n in ([k.replace(".qkv.", f".{r}.") for r in roles] if ".qkv." in k else [k])
        ]
    theirs = {k: rename(k, library, to_vitray=False) for k in keys}
    assert None not in theirs.values() and len(set(theirs.values())) == len(keys)
    assert all(rename(name, library) == k for k, name in theirs.items())
    if library == "hf":
        assert theirs["blocks.1.attn.key.weight"] == "encoder.layer.1.attention.attention.key.weight"
        assert (
            rename("layers.1.attention.k_proj.weight", "hf") == "blocks.1.attn.key.weight"
        )  # transformers 5
    else:
        assert (
            theirs["head.fc.weight"] == "head.weight"
            and theirs["head.pre_logits.bias"] == "pre_logits.fc.bias"
        )
