"""Load ViT weights from timm, torchvision and transformers into vitray's layout.

    sd = convert_state_dict(torch.load("vit_b_16.pth"), "torchvision")
    model = VisionTransformer(config_from_state_dict(sd))
    model.load_state_dict(sd)

The converted model computes the same function as the source model on the source's input: a
float image batch ``(B, C, H, W)``, normalized as that model expects. For vitray's uint8 path the
conversion also stores the normalization constants the source's published models were trained with
(override them with ``mean=`` / ``std=`` for a checkpoint trained otherwise):

- timm: mean = std = 0.5 ([-1, 1] scaling; the original and AugReg ViTs). DeiT and some other timm
  ViTs use ImageNet mean/std instead: pass it.
- torchvision: ImageNet mean/std, which all of torchvision's ViT weights use.
- hf (transformers ViTModel / ViTForImageClassification): mean = std = 0.5, as in google/vit-*.

What each library calls the parts, and the two layout changes:
- the patch projection is a Conv2d ``(D, C, P, P)``; vitray's Linear over (p1, p2, c) takes it
  permuted to ``(D, P, P, C)`` and flattened;
- transformers keeps Q, K and V as three Linears; they are stacked into one fused ``(3D, D)`` QKV
  (timm and torchvision already store them fused in that order).

timm's hybrids (``vit_base_r50_s16_224``, ``vit_large_r50_s32_224``) convert too: their ResNet's
``patch_embed.backbone.stages.I.blocks.J.*`` become ``patch_embed.backbone.stages.I.J.*`` (the same
weight-standardized convolutions and GroupNorms), and the 1x1 projection ``(D, C', 1, 1)`` a Linear.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from typing import Any

import torch

from vit.config import IMAGENET_MEAN, IMAGENET_STD, VARIANTS, VIT_MEAN, VIT_STD, ViTConfig

SOURCES = ("timm", "torchvision", "hf")

# Normalization the source's published weights expect, and its LayerNorm eps.
SOURCE_NORMALIZATION = {
    "timm": (VIT_MEAN, VIT_STD),
    "torchvision": (IMAGENET_MEAN, IMAGENET_STD),
    "hf": (VIT_MEAN, VIT_STD),
}
SOURCE_NORM_EPS = {"timm": 1e-6, "torchvision": 1e-6, "hf": 1e-12}

BLOCK_PARTS = ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
_BLOCK_PARTS = "(" + "|".join(re.escape(part) for part in BLOCK_PARTS) + ")"
_TV_LAYER = "encoder.layers.encoder_layer_{}."  # torchvision's block
_HF_LAYER = "encoder.layer.{}."  # transformers' block, as published checkpoints name it
_HF5_LAYER = "layers.{}."  # and as transformers 5 names it

# Each library's names of vitray's parts, (theirs, vitray's), one table read both ways: `convert_state_dict`
# renames a library's keys to vitray's (left to right), `vit.export` vitray's to the library's (right to
# left). ``{}`` stands for a block's (or a ResNet stage's and unit's) number; a name that ends in "." or "_"
# is a prefix, any other the whole key. The first pair that matches a key renames it: where a library has
# named a part two ways, the name an export writes comes first, the other after it.
NAMES: dict[str, list[tuple[str, str]]] = {
    "timm": [
        ("cls_token", "cls_token"),
        ("pos_embed", "pos_embed"),
        ("patch_embed.proj.", "patch_embed.proj."),
        ("patch_embed.backbone.stem.", "patch_embed.backbone.stem."),
        ("patch_embed.backbone.stages.{}.blocks.{}.", "patch_embed.backbone.stages.{}.{}."),
        *((f"blocks.{{}}.{part}.", f"blocks.{{}}.{part}.") for part in BLOCK_PARTS),
        ("norm.", "norm."),
        ("head.", "head.fc."),
        ("pre_logits.fc.", "head.pre_logits."),  # older timm: the representation layer
    ],
    "torchvision": [
        ("class_token", "cls_token"),
        ("encoder.pos_embedding", "pos_embed"),
        ("conv_proj.", "patch_embed.proj."),
        (_TV_LAYER + "ln_1.", "blocks.{}.norm1."),
        (_TV_LAYER + "ln_2.", "blocks.{}.norm2."),
        (_TV_LAYER + "self_attention.in_proj_", "blocks.{}.attn.qkv."),
        (_TV_LAYER + "self_attention.out_proj.", "blocks.{}.attn.proj."),
        # MLP as nn.Sequential (Linear, GELU, Dropout, Linear, Dropout); before 0.13: linear_1/linear_2
        (_TV_LAYER + "mlp.0.", "blocks.{}.mlp.fc1."),
        (_TV_LAYER + "mlp.linear_1.", "blocks.{}.mlp.fc1."),
        (_TV_LAYER + "mlp.3.", "blocks.{}.mlp.fc2."),
        (_TV_LAYER + "mlp.linear_2.", "blocks.{}.mlp.fc2."),
        ("encoder.ln.", "norm."),
        ("heads.pre_logits.", "head.pre_logits."),
        ("heads.head.", "head.fc."),
    ],
    # Keys after an optional leading "vit." (ViTForImageClassification); both the names of published
    # checkpoints (encoder.layer.N.attention.attention.query), which an export writes and transformers 4 and
    # 5 both load, and those of transformers 5 (layers.N.attention.q_proj). Q, K, V keep separate names
    # here, fused into one QKV after the import and split before the export.
    "hf": [
        ("embeddings.cls_token", "cls_token"),
        ("embeddings.position_embeddings", "pos_embed"),
        ("embeddings.patch_embeddings.projection.", "patch_embed.proj."),
        (_HF_LAYER + "layernorm_before.", "blocks.{}.norm1."),
        (_HF5_LAYER + "layernorm_before.", "blocks.{}.norm1."),
        (_HF_LAYER + "layernorm_after.", "blocks.{}.norm2."),
        (_HF5_LAYER + "layernorm_after.", "blocks.{}.norm2."),
        *(
            (_HF_LAYER + f"attention.attention.{role}.", f"blocks.{{}}.attn.{role}.")
            for role in ("query", "key", "value")
        ),
        (_HF5_LAYER + "attention.q_proj.", "blocks.{}.attn.query."),
        (_HF5_LAYER + "attention.k_proj.", "blocks.{}.attn.key."),
        (_HF5_LAYER + "attention.v_proj.", "blocks.{}.attn.value."),
        (_HF_LAYER + "attention.output.dense.", "blocks.{}.attn.proj."),
        (_HF5_LAYER + "attention.o_proj.", "blocks.{}.attn.proj."),
        (_HF_LAYER + "intermediate.dense.", "blocks.{}.mlp.fc1."),
        (_HF_LAYER + "output.dense.", "blocks.{}.mlp.fc2."),
        (_HF5_LAYER + "mlp.fc1.", "blocks.{}.mlp.fc1."),
        (_HF5_LAYER + "mlp.fc2.", "blocks.{}.mlp.fc2."),
        ("layernorm.", "norm."),
        ("pooler.dense.", "head.pre_logits."),  # ViTModel's pooler: dense + tanh on [CLS]
        ("classifier.", "head.fc."),
    ],
}


def rename(key: str, library: str, *, to_vitray: bool = True) -> str | None:
    """``key`` renamed by `NAMES` of ``library``: from the library's name to vitray's, or (``to_vitray``
    False) the other way; None where no pair names it."""
    for theirs, ours in NAMES[library]:
        read, write = (theirs, ours) if to_vitray else (ours, theirs)
        match = _name_pattern(read).match(key)
        if match:
            return write.format(*match.groups()) + key[match.end() :]
    return None


@functools.cache
def _name_pattern(name: str) -> re.Pattern[str]:
    """A `NAMES` name as a pattern: its ``{}`` a number, a prefix where it ends in "." or "_"."""
    pattern = re.escape(name).replace(re.escape("{}"), r"(\d+)")
    return re.compile(pattern if name.endswith((".", "_")) else pattern + "$")


_BACKBONE_KEY = (
    r"patch_embed\.backbone\.(stem\.conv\.weight|stem\.norm\.(weight|bias)"
    r"|stages\.\d+\.\d+\.(conv[123]\.weight|norm[123]\.(weight|bias)|downsample\.(conv\.weight|norm\.(weight|bias))))"
)
BLOCK_KEY = re.compile(r"^blocks\.([0-9]+)\.")
# Every key of a vitray state dict, for the final check.
VITRAY_KEY = re.compile(
    rf"^(cls_token|pos_embed|patch_embed\.(mean|std)|patch_embed\.proj\.(weight|bias)|{_BACKBONE_KEY}"
    rf"|blocks\.\d+\.{_BLOCK_PARTS}\.(weight|bias)|norm\.(weight|bias)|head\.(pre_logits|fc)\.(weight|bias))$"
)


def convert_state_dict(
    state_dict: dict[str, torch.Tensor],
    source: str,
    *,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """A timm / torchvision / transformers ("hf") ViT state dict -> a vitray state dict.

    Keys vitray's ViT has no place for (layer scale, register tokens, a norm after pooling, ...)
    are a one-line error rather than silently dropped: the result would compute something else.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose one of {SOURCES}")
    sd = dict(state_dict)
    if source == "hf":
        sd = {k.removeprefix("vit."): v for k, v in sd.items()}
        sd.pop("embeddings.mask_token", None)  # masked-image-modeling input, unused for images
        if "classifier.weight" in sd:
            # ViTForImageClassification classifies the [CLS] token directly, never through a pooler.
            sd = {k: v for k, v in sd.items() if not k.startswith("pooler.")}
    if source == "timm" and any(k.startswith("fc_norm.") for k in sd):
        raise ValueError(
            "this timm model normalizes after pooling (fc_norm, global_pool='avg'); vitray's ViT "
            "normalizes the tokens before pooling, so it cannot compute the same function"
        )

    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}  # new key -> source key, to name the source's keys in errors
    unmatched = []
    for key, value in sd.items():
        new_key = rename(key, source)
        if new_key is None:
            unmatched.append(key)
        else:
            out[new_key], origin[new_key] = value, key
    if source == "hf":
        for missing, beside in _fuse_qkv(out):
            raise ValueError(
                f"this hf state dict has no {_source_key(origin[beside], beside, missing)} (beside "
                f"{origin[beside]}); attention needs query, key and value: is the file complete?"
            )
    unmatched += [origin.get(k, k) for k in out if not VITRAY_KEY.match(k)]
    if unmatched:
        raise ValueError(
            f"cannot convert {len(unmatched)} key(s) of this {source} state dict, e.g. {unmatched[:4]}: "
            "vitray's ViT has no such part (layer scale, register tokens, ...); is it a plain ViT?"
        )
    for key in ("cls_token", "pos_embed", "patch_embed.proj.weight"):
        if key not in out:
            raise ValueError(f"this {source} state dict has no {key}; is it a ViT state dict?")

    conv = out["patch_embed.proj.weight"]
    channels = conv.shape[1] if conv.dim() == 4 else 3
    if STEM_KEY in out:  # a hybrid: the projection reads the ResNet's features, the stem the pixels
        channels = out[STEM_KEY].shape[1]
    if conv.dim() == 4:  # Conv2d (D, C, P, P) -> Linear over (p1, p2, c): (D, P*P*C)
        out["patch_embed.proj.weight"] = conv.permute(0, 2, 3, 1).reshape(conv.shape[0], -1)
    dim = out["cls_token"].shape[-1]
    out["cls_token"] = out["cls_token"].reshape(dim)  # (1, 1, D) -> (D,)
    pos_embed = out["pos_embed"].reshape(-1, dim)  # (1, T, D) -> (T, D)
    if math.isqrt(pos_embed.shape[0]) ** 2 == pos_embed.shape[0]:
        # No position for [CLS] (timm's no_embed_class): adding a zero row computes the same.
        pos_embed = torch.cat([pos_embed.new_zeros(1, dim), pos_embed])
    out["pos_embed"] = pos_embed

    default_mean, default_std = SOURCE_NORMALIZATION[source]
    if channels != len(default_mean):  # not RGB: the [-1, 1] scaling per channel
        default_mean, default_std = (0.5,) * channels, (0.5,) * channels
    mean = mean if mean is not None else default_mean
    std = std if std is not None else default_std
    out["patch_embed.mean"] = torch.tensor(mean, dtype=torch.float32)
    out["patch_embed.std"] = torch.tensor(std, dtype=torch.float32)
    return out


STEM_KEY = "patch_embed.backbone.stem.conv.weight"  # (width, C, 7, 7): a hybrid's first convolution


def backbone_from_state_dict(state_dict: dict[str, torch.Tensor]) -> tuple[tuple[int, ...], int] | None:
    """A vitray hybrid's ``(backbone_layers, backbone_width)`` from its state dict's keys; None if plain."""
    if STEM_KEY not in state_dict:
        return None
    units: dict[int, int] = {}
    for key in state_dict:
        match = re.match(r"^patch_embed\.backbone\.stages\.(\d+)\.(\d+)\.", key)
        if match:
            stage, unit = int(match[1]), int(match[2])
            units[stage] = max(units.get(stage, 0), unit + 1)
    if not units or sorted(units) != list(range(len(units))):
        raise ValueError(f"the hybrid's ResNet stages in this state dict are incomplete: {sorted(units)}")
    return tuple(units[i] for i in range(len(units))), state_dict[STEM_KEY].shape[0]


def _fuse_qkv(sd: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """blocks.N.attn.{query,key,value}.{weight,bias} -> blocks.N.attn.qkv.{weight,bias}, stacked q;k;v.

    Returns ``(missing, present)`` key pairs of the incomplete triples (left as they are).
    """
    incomplete = []
    roles = re.compile(r"\.attn\.(query|key|value)\.")
    for key in sorted({roles.sub(".attn.query.", k) for k in sd if roles.search(k)}):
        parts = [key, key.replace(".query.", ".key."), key.replace(".query.", ".value.")]
        if all(p in sd for p in parts):
            sd[key.replace(".query.", ".qkv.")] = torch.cat([sd.pop(p) for p in parts], dim=0)  # (3D, ...)
        elif any(p in sd for p in parts):
            present = next(p for p in parts if p in sd)
            incomplete += [(p, present) for p in parts if p not in sd]
    return incomplete


def _source_key(present_source: str, present: str, missing: str) -> str:
    """The source's name of a missing Q/K/V key, from a present sibling's (q_proj -> k_proj, or
    .query. -> .key.)."""
    have, want = (re.search(r"\.attn\.(query|key|value)\.", k)[1] for k in (present, missing))
    for a, b in ((f"{have[0]}_proj", f"{want[0]}_proj"), (f".{have}.", f".{want}.")):
        if a in present_source:
            return present_source.replace(a, b)
    return missing


def config_from_state_dict(
    state_dict: dict[str, torch.Tensor], source: str | None = None, **overrides: Any
) -> ViTConfig:
    """The ViTConfig a vitray state dict (e.g. from `convert_state_dict`) was made for.

    Shapes give everything but three fields: ``num_heads`` (taken from the matching `VARIANTS`
    entry, else a head width of 64), ``pool`` ("cls") and ``norm_eps`` (the source's default:
    1e-12 for "hf", else 1e-6). Pass ``overrides`` for any field that should differ.
    """
    sd = state_dict
    if "cls_token" not in sd or "patch_embed.proj.weight" not in sd or "blocks.0.mlp.fc1.weight" not in sd:
        raise ValueError(
            "not a vitray ViT state dict (no cls_token / patch_embed / blocks); convert it first"
        )
    dim = sd["cls_token"].shape[-1]
    depth = len(block_indices(sd))
    mlp_dim = sd["blocks.0.mlp.fc1.weight"].shape[0]
    mean = _normalization(sd, "mean", VIT_MEAN)
    std = _normalization(sd, "std", VIT_STD)
    channels = len(mean)
    backbone = backbone_from_state_dict(sd)
    if backbone is None:
        patch_size = math.isqrt(sd["patch_embed.proj.weight"].shape[1] // channels)
    else:  # the hybrid's uint8 patches are as large as its ResNet's stride
        patch_size = 4 * 2 ** (len(backbone[0]) - 1)
    num_patches = sd["pos_embed"].reshape(-1, dim).shape[0] - 1
    grid = math.isqrt(num_patches)
    if grid * grid != num_patches and "image_size" not in overrides:
        raise ValueError(f"{num_patches} position embeddings are not a square grid; pass image_size=")
    pre_logits = sd.get("head.pre_logits.weight")
    fc = sd.get("head.fc.weight")
    fields: dict[str, Any] = {
        "image_size": grid * patch_size,
        "patch_size": patch_size,
        "num_channels": channels,
        "embed_dim": dim,
        "depth": depth,
        "mlp_dim": mlp_dim,
        "num_classes": fc.shape[0] if fc is not None else 0,
        "head": "pretrain" if pre_logits is not None else "finetune",
        "representation_size": pre_logits.shape[0] if pre_logits is not None else None,
        "qkv_bias": "blocks.0.attn.qkv.bias" in sd,
        "norm_eps": SOURCE_NORM_EPS.get(source or "", 1e-6),
        "mean": mean,
        "std": std,
        "backbone_layers": backbone[0] if backbone else None,
        "backbone_width": backbone[1] if backbone else None,
    }
    shape = (dim, depth, mlp_dim, patch_size, fields["backbone_layers"], fields["backbone_width"])
    match = next(
        (
            v
            for v in VARIANTS.values()
            if (v.embed_dim, v.depth, v.mlp_dim, v.patch_size, v.backbone_layers, v.backbone_width) == shape
        ),
        None,
    )
    fields["name"] = match.name if match else "vit_custom"
    fields["num_heads"] = match.num_heads if match else max(1, dim // 64)
    fields.update(overrides)
    return ViTConfig(**fields)


def block_indices(keys: Iterable[str]) -> list[int]:
    """The encoder block numbers that ``blocks.<i>.`` keys use, sorted; a one-line ValueError unless
    they are 0, 1, ..., n-1 (a far number would claim a model deeper than the weights)."""
    indices = sorted({int(m.group(1)) for k in keys if (m := BLOCK_KEY.match(k))})
    if indices != list(range(len(indices))):
        present = set(indices)
        missing = [i for i in range(len(indices) + 3) if i not in present][:3]
        raise ValueError(
            f"the weights hold {len(indices)} encoder block(s) numbered up to {indices[-1]}, without "
            f"block(s) {missing}: blocks must be numbered 0 to n-1"
        )
    return indices


def _normalization(sd: dict[str, torch.Tensor], name: str, default: tuple[float, ...]) -> tuple[float, ...]:
    tensor = sd.get(f"patch_embed.{name}")
    if tensor is None:
        return default
    if tensor.is_meta:  # shapes only (a header read before the data): one placeholder per channel
        return (0.5,) * tensor.shape[0]
    return _decimals(tensor)


def _decimals(values: torch.Tensor) -> tuple[float, ...]:
    # float32 buffers hold 0.485 as 0.48500001...; 7 significant digits give back the decimal.
    return tuple(float(f"{v:.7g}") for v in values.float().tolist())


def config_from_hf(hf_config: Any, **overrides: Any) -> ViTConfig:
    """A ViTConfig from a transformers ViTConfig (or its config.json dict); heads come from the weights.

    Fields with no transformers counterpart follow the conversion: a fine-tuning head when the
    model has a classifier (pass ``num_classes``), [CLS] pooling, mean = std = 0.5.
    """
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    if c.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported; vitray's ViT uses exact GELU")
    image_size, patch_size = c.get("image_size", 224), c.get("patch_size", 16)
    if not isinstance(image_size, int) or not isinstance(patch_size, int):
        raise ValueError(f"only square images and patches are supported, got {image_size} / {patch_size}")
    channels = c.get("num_channels", 3)
    fields = {
        "name": "vit_custom",
        "image_size": image_size,
        "patch_size": patch_size,
        "num_channels": channels,
        "embed_dim": c["hidden_size"],
        "depth": c["num_hidden_layers"],
        "num_heads": c["num_attention_heads"],
        "mlp_dim": c["intermediate_size"],
        "qkv_bias": c.get("qkv_bias", True),
        "norm_eps": c.get("layer_norm_eps", 1e-12),
        "head": "finetune",
        "num_classes": 0,
        "mean": (0.5,) * channels,
        "std": (0.5,) * channels,
    }
    fields.update(overrides)
    return ViTConfig(**fields)
