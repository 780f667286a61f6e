"""vit: the Vision Transformer of vitray, in pure PyTorch.

    import vit
    model = vit.create_model("vit_b16", num_classes=10)
    emb = model.embed(patches)  # uint8 (B, N, P*P*C) -> (B, D)

Distributed setup (FSDP2, activation checkpointing, compile) is in `vit.parallelize`, the one
module here that imports torch.distributed.

Every Ray Data decode worker imports `vit.patchify`, so importing the package must not pull torch in
(about a second and 300 MB per worker process): the torch-free modules are imported here, the rest
on first use of one of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vit.config import ARCHITECTURE_FIELDS, REGULARIZATION_FIELDS, VARIANTS, ViTConfig, get_config
from vit.flops import count_flops, count_mae_flops, flops_breakdown, mae_flops_breakdown
from vit.patchify import patchify, unpatchify

# Names from modules that need torch -> the module defining them.
_LAZY = {
    "config_from_hf": "vit.convert",
    "config_from_state_dict": "vit.convert",
    "convert_state_dict": "vit.convert",
    "VisionTransformer": "vit.model",
    "create_model": "vit.model",
    "MAEConfig": "vit.mae",
    "MaskedAutoencoder": "vit.mae",
    "create_mae": "vit.mae",
    "resample_pos_embed": "vit.pos_embed",
    "load_config": "vit.weights",
    "load_pretrained": "vit.weights",
    "save_pretrained": "vit.weights",
}
__all__ = [
    "ARCHITECTURE_FIELDS",
    "REGULARIZATION_FIELDS",
    "VARIANTS",
    "MAEConfig",
    "MaskedAutoencoder",
    "ViTConfig",
    "VisionTransformer",
    "config_from_hf",
    "config_from_state_dict",
    "convert_state_dict",
    "count_flops",
    "count_mae_flops",
    "create_mae",
    "create_model",
    "flops_breakdown",
    "get_config",
    "load_config",
    "load_pretrained",
    "mae_flops_breakdown",
    "patchify",
    "resample_pos_embed",
    "save_pretrained",
    "unpatchify",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'vit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


if TYPE_CHECKING:  # what type checkers and editors see
    from vit.convert import config_from_hf as config_from_hf
    from vit.convert import config_from_state_dict as config_from_state_dict
    from vit.convert import convert_state_dict as convert_state_dict
    from vit.mae import MAEConfig as MAEConfig
    from vit.mae import MaskedAutoencoder as MaskedAutoencoder
    from vit.mae import create_mae as create_mae
    from vit.model import VisionTransformer as VisionTransformer
    from vit.model import create_model as create_model
    from vit.pos_embed import resample_pos_embed as resample_pos_embed
    from vit.weights import load_config as load_config
    from vit.weights import load_pretrained as load_pretrained
    from vit.weights import save_pretrained as save_pretrained
