"""vit: the Vision Transformer of vitray, in pure PyTorch.

    import vit
    model = vit.create_model("vit_b16", num_classes=10)
    emb = model.embed(patches)  # uint8 (B, N, P*P*C) -> (B, D)

Distributed setup (FSDP2, activation checkpointing, compile) is in `vit.parallelize`, the one
module here that imports torch.distributed.
"""

from vit.config import VARIANTS, ViTConfig, get_config
from vit.convert import config_from_hf, config_from_state_dict, convert_state_dict
from vit.flops import count_flops, flops_breakdown
from vit.model import VisionTransformer, create_model
from vit.patchify import patchify, unpatchify
from vit.pos_embed import resample_pos_embed
from vit.weights import load_config, load_pretrained, save_pretrained

__all__ = [
    "VARIANTS",
    "ViTConfig",
    "VisionTransformer",
    "config_from_hf",
    "config_from_state_dict",
    "convert_state_dict",
    "count_flops",
    "create_model",
    "flops_breakdown",
    "get_config",
    "load_config",
    "load_pretrained",
    "patchify",
    "resample_pos_embed",
    "save_pretrained",
    "unpatchify",
]
