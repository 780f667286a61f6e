"""vitray weights for timm and transformers: the inverse of `vit.convert`.

    files = save_timm("out/", state_dict, config)   # timm.create_model("local-dir:out/", pretrained=True)
    files = save_hf("out/", state_dict, config)     # transformers.ViTModel.from_pretrained("out/")

Each export computes the same function as the vitray model on a float image batch ``(B, C, H, W)``
normalized with the model's mean/std, and carries that normalization: timm's ``pretrained_cfg`` (what
``timm.data.resolve_data_config`` reads), transformers' ``preprocessor_config.json`` (ViTImageProcessor).
Importing the files back with `vit.convert_state_dict` (and the recorded mean/std) gives the same
vitray state dict, tensor for tensor.

The two layout changes of the import, reversed: the patch projection, a Linear over (p1, p2, c)
``(D, P*P*C)``, becomes a Conv2d weight ``(D, C, P, P)``; for transformers the fused QKV ``(3D, D)``
is split into query, key and value. Keys are renamed by the import's own table, read backwards
(`vit.convert.NAMES`): in the names published checkpoints use (``encoder.layer.N.attention.attention.query``),
which transformers 4 and 5 both load.

What a target has no counterpart for is a one-line ValueError, never an export that computes
something else: timm's VisionTransformer has no Linear -> tanh layer before its classifier (vitray's
pretraining head) and a fixed LayerNorm eps of 1e-6; transformers' ViTForImageClassification
classifies the [CLS] token directly and its ViT pools nothing else; neither builds vitray's hybrids.
``encoder_only=True`` drops the head, which leaves the embeddings (the pooled token after the final
LayerNorm) as they are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from vit.config import VARIANTS, ViTConfig
from vit.convert import rename
from vit.weights import check_weights

TARGETS = ("timm", "hf")
TIMM_NORM_EPS = 1e-6  # timm's VisionTransformer builds LayerNorm(eps=1e-6) whatever its arguments
MODEL_FILE = "model.safetensors"  # the weights file name both libraries look for in a folder
CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
# PIL's resampling codes, as transformers' image processors record them.
PIL_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}

# vitray variant -> the timm model of the same architecture (its arguments are passed in full anyway).
TIMM_MODELS = {
    "vit_ti16": "vit_tiny_patch16_224",
    "vit_s16": "vit_small_patch16_224",
    "vit_b16": "vit_base_patch16_224",
    "vit_b32": "vit_base_patch32_224",
    "vit_l16": "vit_large_patch16_224",
    "vit_l32": "vit_large_patch32_224",
    "vit_h14": "vit_huge_patch14_224",
    "vit_g14": "vit_giant_patch14_224",
    "vit_G14": "vit_gigantic_patch14_224",
}
TIMM_FALLBACK = "vit_base_patch16_224"  # any other shape: its arguments override every size


def check_exportable(config: ViTConfig, target: str, encoder_only: bool = False) -> None:
    """A one-line ValueError when ``target`` cannot compute what the model ``config`` describes does."""
    if target not in TARGETS:
        raise ValueError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    library = {"timm": "timm", "hf": "transformers"}[target]
    if config.backbone_layers is not None:
        raise ValueError(
            f"{config.name} is a hybrid (a ResNet before the patch projection); the {library} export "
            "takes plain ViTs only"
        )
    has_head = not encoder_only and (config.head == "pretrain" or config.num_classes > 0)
    if target == "timm":
        if config.norm_eps != TIMM_NORM_EPS:
            raise ValueError(
                f"timm's ViT uses LayerNorm eps {TIMM_NORM_EPS:g}, this model {config.norm_eps:g}: it would "
                "compute something else; export --to hf, which records the eps"
            )
        if has_head and config.head == "pretrain":
            raise ValueError(
                "timm's VisionTransformer has no Linear -> tanh layer before its classifier, this model's "
                "pretraining head has one; pass --encoder-only to export the encoder (the same embeddings)"
            )
        return
    if config.pool != "cls":
        raise ValueError(
            f"transformers' ViT pools the [CLS] token, this model the mean of its patch tokens (pool "
            f"{config.pool}); export --to timm, which pools so too"
        )
    if has_head and config.head == "pretrain" and config.num_classes > 0:
        raise ValueError(
            "transformers' ViTForImageClassification classifies the [CLS] token directly, this model's "
            "pretraining head through a Linear -> tanh layer; pass --encoder-only to export the encoder "
            "(ViTModel, the same embeddings)"
        )


# --- timm ------------------------------------------------------------------------------------------


def to_timm(
    state_dict: dict[str, torch.Tensor],
    config: ViTConfig,
    *,
    encoder_only: bool = False,
    crop_fraction: float = 0.875,
    interpolation: str = "bicubic",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A vitray state dict -> ``(timm state dict, timm config)``.

    The config is timm's folder format (``config.json`` of a Hub model): ``architecture`` and
    ``model_args`` make the model, ``timm.create_model(architecture, pretrained=False, **model_args)``,
    which then takes the state dict with ``load_state_dict``; ``pretrained_cfg`` holds the input size,
    mean/std, crop and interpolation of the model's evaluation preprocessing.
    """
    check_exportable(config, "timm", encoder_only)
    check_weights(state_dict, config, "the state dict")
    out = {}
    for key, value in state_dict.items():
        if key.startswith("patch_embed.") and key.removeprefix("patch_embed.") in ("mean", "std"):
            continue  # the normalization goes to pretrained_cfg
        if key.startswith("head.") and encoder_only:
            continue
        out[_renamed(key, "timm")] = value
    out.update(_common_layout(state_dict, config))
    num_classes = 0 if encoder_only else config.num_classes
    model_args = {
        "img_size": config.image_size,
        "patch_size": config.patch_size,
        "in_chans": config.num_channels,
        "embed_dim": config.embed_dim,
        "depth": config.depth,
        "num_heads": config.num_heads,
        "mlp_ratio": _mlp_ratio(config),
        "qkv_bias": config.qkv_bias,
        "num_classes": num_classes,
        # vitray normalizes the tokens, then pools: timm's fc_norm (a norm after pooling) stays off.
        "global_pool": "token" if config.pool == "cls" else "avg",
        "class_token": True,
        "fc_norm": False,
    }
    pretrained_cfg = {
        "input_size": [config.num_channels, config.image_size, config.image_size],
        "fixed_input_size": True,
        "mean": list(config.mean),
        "std": list(config.std),
        "crop_pct": crop_fraction,
        "crop_mode": "center",
        "interpolation": interpolation,
        "num_classes": num_classes,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }
    timm_config = {
        "architecture": timm_model_name(config),
        "num_classes": num_classes,
        "num_features": config.embed_dim,
        "global_pool": model_args["global_pool"],
        "model_args": model_args,
        "pretrained_cfg": pretrained_cfg,
    }
    return out, timm_config


def _mlp_ratio(config: ViTConfig) -> float:
    # timm sizes the MLP as int(embed_dim * mlp_ratio): a ratio that lands a hair below the width would
    # build one unit less, so nudge it half a unit up (int() then cuts back to the width).
    ratio = config.mlp_dim / config.embed_dim
    if int(config.embed_dim * ratio) != config.mlp_dim:
        ratio = (config.mlp_dim + 0.5) / config.embed_dim
    return ratio


def _common_layout(state_dict: dict[str, torch.Tensor], config: ViTConfig) -> dict[str, torch.Tensor]:
    """The tensors whose shapes timm and transformers share and vitray does not: batch axes on [CLS]
    and the position embeddings, and the patch projection as a Conv2d ``(D, C, P, P)``."""
    d, p, c = config.embed_dim, config.patch_size, config.num_channels
    weight = state_dict["patch_embed.proj.weight"]  # (D, P*P*C), over (p1, p2, c)
    return {
        "cls_token": state_dict["cls_token"].reshape(1, 1, d),
        "pos_embed": state_dict["pos_embed"].reshape(1, -1, d),
        "patch_embed.proj.weight": weight.reshape(d, p, p, c).permute(0, 3, 1, 2).contiguous(),
    }


# --- transformers -------------------------------------------------------------------------------------


def to_hf(
    state_dict: dict[str, torch.Tensor],
    config: ViTConfig,
    *,
    encoder_only: bool = False,
    interpolation: str = "bicubic",
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """A vitray state dict -> ``(transformers state dict, config.json, preprocessor_config.json)``.

    A classifier (fine-tuning head) makes a ViTForImageClassification; anything else a ViTModel,
    whose pooler (Linear -> tanh on [CLS]) is the pretraining head's hidden layer where there is one.
    Without one, load it with ``add_pooling_layer=False``: transformers would otherwise add a pooler
    of random weights (its ``last_hidden_state`` is the same either way).
    """
    check_exportable(config, "hf", encoder_only)
    check_weights(state_dict, config, "the state dict")
    sd = {k: v for k, v in state_dict.items() if not (encoder_only and k.startswith("head."))}
    sd = {k: v for k, v in sd.items() if k not in ("patch_embed.mean", "patch_embed.std")}
    sd.update(_common_layout(state_dict, config))
    for key in [k for k in sd if ".attn.qkv." in k]:
        for role, part in zip(("query", "key", "value"), sd.pop(key).chunk(3, dim=0), strict=True):
            sd[key.replace(".qkv.", f".{role}.")] = part.contiguous()  # (D, D) / (D,)
    classifier = "head.fc.weight" in sd
    prefix = "vit." if classifier else ""
    out = {}
    for key, value in sd.items():
        name = _renamed(key, "hf")
        out[name if name.startswith("classifier.") else prefix + name] = value
    labels = {str(i): f"LABEL_{i}" for i in range(config.num_classes if classifier else 0)}
    hf_config = {
        "architectures": ["ViTForImageClassification" if classifier else "ViTModel"],
        "model_type": "vit",
        "hidden_size": config.embed_dim,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "gelu",  # exact (erf) GELU, vitray's
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": config.norm_eps,
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "num_channels": config.num_channels,
        "qkv_bias": config.qkv_bias,
        "encoder_stride": config.patch_size,
        "pooler_output_size": config.pre_logits_dim if "head.pre_logits.weight" in sd else config.embed_dim,
        "pooler_act": "tanh",
        "dtype": "float32",
    }
    if classifier:
        hf_config |= {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}
    preprocessor = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": config.image_size, "width": config.image_size},
        "resample": PIL_RESAMPLE.get(interpolation, PIL_RESAMPLE["bicubic"]),
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(config.mean),
        "image_std": list(config.std),
    }
    return out, hf_config, preprocessor


def _renamed(key: str, library: str) -> str:
    """A vitray key in ``library``'s name (`vit.convert.NAMES`, read right to left)."""
    name = rename(key, library, to_vitray=False)
    if name is None:  # check_weights let through a key vitray lacks
        raise ValueError(f"no {library} name for {key!r}")
    return name


# --- files ----------------------------------------------------------------------------------------------


def save_timm(
    directory: str | os.PathLike, state_dict: dict[str, torch.Tensor], config: ViTConfig, **options: Any
) -> list[str]:
    """Write ``model.safetensors`` + ``config.json`` (timm's folder format) into a local directory;
    returns the file names. ``options`` go to `to_timm`."""
    tensors, timm_config = to_timm(state_dict, config, **options)
    return _write(directory, tensors, {CONFIG_FILE: timm_config})


def save_hf(
    directory: str | os.PathLike, state_dict: dict[str, torch.Tensor], config: ViTConfig, **options: Any
) -> list[str]:
    """Write ``model.safetensors`` + ``config.json`` + ``preprocessor_config.json`` (what transformers'
    ``from_pretrained`` reads) into a local directory; returns the file names. ``options`` go to `to_hf`."""
    tensors, hf_config, preprocessor = to_hf(state_dict, config, **options)
    return _write(directory, tensors, {CONFIG_FILE: hf_config, PREPROCESSOR_FILE: preprocessor})


def _write(
    directory: str | os.PathLike, tensors: dict[str, torch.Tensor], files: dict[str, Any]
) -> list[str]:
    from safetensors.torch import save_file  # here, so that `import vit` needs torch alone

    local = Path(directory)
    local.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    save_file(tensors, local / MODEL_FILE, metadata={"format": "pt"})
    for name, content in files.items():
        (local / name).write_text(json.dumps(content, indent=2) + "\n")
    return [MODEL_FILE, *files]


def timm_model_name(config: ViTConfig) -> str:
    """The timm model of ``config``'s architecture (`TIMM_MODELS`), else `TIMM_FALLBACK`: cosmetic, since
    the export's ``model_args`` set every size."""
    variant = VARIANTS.get(config.name)
    if config.name in TIMM_MODELS and variant.architecture() == config.architecture():
        return TIMM_MODELS[config.name]
    return TIMM_FALLBACK
