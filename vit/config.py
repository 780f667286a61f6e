"""ViT configuration: one frozen dataclass in the paper's vocabulary, and the table of named variants.

A config is plain data: `to_dict()` / `from_dict()` round-trip through JSON, which is how the
training job stores it beside every checkpoint and the final export (`config.json`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

POOLS = ("cls", "gap")
HEADS = ("pretrain", "finetune")
MAX_NORM_EPS = 1e-2

# The original ViT scales pixels to [-1, 1]: (x - 0.5) / 0.5 over [0, 1] pixels.
VIT_MEAN = (0.5, 0.5, 0.5)
VIT_STD = (0.5, 0.5, 0.5)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# The fields that decide the shape of every encoder tensor at a given resolution, in the order a
# mismatch is reported. Checks add what else they care about: the image size (pos_embed's length), the
# head (its shapes), the number of heads (same tensors, another computation).
ARCHITECTURE_FIELDS = (
    "embed_dim",
    "depth",
    "mlp_dim",
    "patch_size",
    "num_channels",
    "qkv_bias",
    "backbone_layers",
    "backbone_width",
)

# The fields that act in training mode only: in eval mode a model computes the same function whatever
# their values, so they are no part of what an embedding or a comparison of models depends on, and a
# fine-tuning run sets its own rather than inheriting the pretraining run's.
REGULARIZATION_FIELDS = ("drop_path_rate", "dropout")


@dataclass(frozen=True)
class ViTConfig:
    """Everything that decides a ViT's shapes and its computation; of training, only the regularization
    that training mode applies (`REGULARIZATION_FIELDS`: no parameter, no effect in eval mode)."""

    name: str = "vit_b16"
    image_size: int = 224  # square input side, in pixels; a multiple of patch_size
    patch_size: int = 16
    num_channels: int = 3
    embed_dim: int = 768  # D, the width of every token
    depth: int = 12  # number of encoder blocks
    num_heads: int = 12
    mlp_dim: int = 3072  # hidden width of each block's MLP
    num_classes: int = 1000  # 0: no classifier, forward() returns the (pre-)logits features
    pool: str = "cls"  # "cls": the [CLS] token; "gap": mean of the patch tokens
    head: str = "pretrain"  # "pretrain": Linear -> tanh -> Linear; "finetune": one zero-init Linear
    representation_size: int | None = None  # hidden width of the pretraining head; None: embed_dim
    qkv_bias: bool = True
    norm_eps: float = 1e-6
    # Input normalization over [0, 1] pixels, applied inside the model to uint8 patches.
    mean: tuple[float, ...] = VIT_MEAN
    std: tuple[float, ...] = VIT_STD
    # Hybrid (Sec. 3.1): a ResNet (vit/hybrid.py) whose feature map becomes the tokens through 1x1
    # patches. Bottleneck units per stage, e.g. (3, 4, 9) for R50+ViT-B/16; None: the plain ViT. The
    # hybrid still reads uint8 patches: patch_size is then the ResNet's total stride, 4 * 2^(stages-1).
    backbone_layers: tuple[int, ...] | None = None
    backbone_width: int | None = None  # the stem's channels (64 in ResNet-50); stage i: 4 * width * 2^i out
    # Regularization, in training mode only (no parameters: state dicts are the same with or without).
    # Stochastic depth (Huang et al. 2016) as in timm / DeiT: each block's two residual branches are
    # dropped per sample, block i of depth with rate drop_path_rate * i / (depth - 1) (0 in the first).
    drop_path_rate: float = 0.0
    # Dropout where the ViT paper puts it (Appendix B.1): after adding the position embeddings, after
    # the attention's output projection and after each of the MLP's two Linear layers.
    dropout: float = 0.0

    def __post_init__(self) -> None:
        # JSON gives lists; keep the dataclass hashable and comparable.
        for name in ("mean", "std"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not all(_is_number(v) for v in values):
                raise ValueError(f"{name} must be a list of numbers, one per channel, got {values!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if self.backbone_layers is not None and not isinstance(self.backbone_layers, (str, int)):
            object.__setattr__(self, "backbone_layers", tuple(self.backbone_layers))
        self.validate()

    # --- derived sizes ---------------------------------------------------------------------------
    @property
    def grid_size(self) -> int:
        """Patches along each side of the image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """N, the number of patch tokens (the sequence has 1 + N tokens with [CLS])."""
        return self.grid_size**2

    @property
    def patch_dim(self) -> int:
        """P*P*C, the length of one flattened patch."""
        return self.patch_size**2 * self.num_channels

    @property
    def backbone_stride(self) -> int | None:
        """The hybrid ResNet's total stride (4 for the stem, x2 per stage after the first); None if plain."""
        if self.backbone_layers is None:
            return None
        return 4 * 2 ** (len(self.backbone_layers) - 1)

    @property
    def backbone_channels(self) -> int | None:
        """C', the channels of the hybrid's feature map (what the 1x1 patch projection reads); None if plain."""
        if self.backbone_layers is None or self.backbone_width is None:
            return None
        return 4 * self.backbone_width * 2 ** (len(self.backbone_layers) - 1)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def pre_logits_dim(self) -> int:
        """Width of what the classifier reads: the pretraining head's hidden layer, or embed_dim."""
        if self.head == "pretrain":
            return self.representation_size or self.embed_dim
        return self.embed_dim

    def architecture(self) -> dict[str, Any]:
        """``{field: value}`` of `ARCHITECTURE_FIELDS`: equal for two configs whose encoders share shapes."""
        return {name: getattr(self, name) for name in ARCHITECTURE_FIELDS}

    # --- checks ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise a one-line ValueError that says what to change."""
        sizes = ("image_size", "patch_size", "num_channels", "embed_dim", "depth", "num_heads", "mlp_dim")
        for field in sizes:
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field, kind in (("name", str), ("pool", str), ("head", str), ("qkv_bias", bool)):
            if not isinstance(getattr(self, field), kind):
                raise ValueError(f"{field} must be a {kind.__name__}, got {getattr(self, field)!r}")
        if not _is_int(self.num_classes):
            raise ValueError(f"num_classes must be an integer, got {self.num_classes!r}")
        if self.representation_size is not None and not _is_int(self.representation_size):
            raise ValueError(
                f"representation_size must be an integer or None, got {self.representation_size!r}"
            )
        if self.image_size % self.patch_size:
            lower = self.image_size // self.patch_size * self.patch_size
            raise ValueError(
                f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}; "
                f"use a multiple of {self.patch_size} (e.g. {max(lower, self.patch_size)})"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}; "
                f"pick num_heads among the divisors of {self.embed_dim}"
            )
        if self.num_classes < 0:
            raise ValueError(f"num_classes must be >= 0 (0 means no classifier), got {self.num_classes}")
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.representation_size is not None and self.representation_size <= 0:
            raise ValueError(f"representation_size must be positive or None, got {self.representation_size}")
        if len(self.mean) != self.num_channels or len(self.std) != self.num_channels:
            raise ValueError(
                f"mean and std need one value per channel ({self.num_channels}), "
                f"got {len(self.mean)} and {len(self.std)}"
            )
        # The input layer scales [0, 1] pixels: (x - mean) / std, per channel.
        if not all(0.0 <= m <= 1.0 for m in self.mean):
            raise ValueError(f"mean must lie in [0, 1] (pixels are scaled to [0, 1] first), got {self.mean}")
        if not all(0.0 < s < math.inf for s in self.std):
            raise ValueError(f"std must be positive and finite, got {self.std}")
        # LayerNorm's eps guards a division; a large one flattens every token to its bias (1e-12 to 1e-5 in use).
        if not _is_number(self.norm_eps) or not 0.0 < self.norm_eps <= MAX_NORM_EPS:
            raise ValueError(
                f"norm_eps must be a small positive number, in (0, {MAX_NORM_EPS:g}], got {self.norm_eps!r}"
            )
        for field in REGULARIZATION_FIELDS:
            value = getattr(self, field)
            if not _is_number(value) or not 0 <= value < 1:
                raise ValueError(f"{field} must be in [0, 1) (0: off), got {value!r}")
        self._validate_backbone()

    def _validate_backbone(self) -> None:
        layers, width = self.backbone_layers, self.backbone_width
        if layers is None:
            if width is not None:
                raise ValueError(
                    "backbone_width applies to hybrids only; set backbone_layers too, or drop it"
                )
            return
        if (
            not isinstance(layers, tuple)
            or not layers
            or any(not isinstance(n, int) or n <= 0 for n in layers)
        ):
            raise ValueError(f"backbone_layers must be a non-empty list of positive integers, got {layers!r}")
        if not isinstance(width, int) or width <= 0 or width % 32:
            raise ValueError(
                f"backbone_width must be a positive multiple of 32 (GroupNorm uses 32 groups), got {width!r}"
            )
        if self.patch_size != self.backbone_stride:
            raise ValueError(
                f"a hybrid's patch_size is its ResNet's stride: {len(layers)} stage(s) give "
                f"{self.backbone_stride}, not {self.patch_size}; set patch_size={self.backbone_stride}"
            )

    # --- plain data ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        """Inverse of `to_dict`; unknown keys are an error (a config from another tool or version)."""
        if not isinstance(data, dict):
            raise ValueError(f"a ViTConfig is a JSON object of fields, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown ViTConfig field(s) {unknown}; valid fields: {sorted(fields)}")
        return cls(**data)

    def replace(self, **overrides: Any) -> ViTConfig:
        """A copy with some fields replaced; unknown field names are an error."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown ViTConfig field(s) {unknown}; valid fields: {sorted(fields)}")
        return dataclasses.replace(self, **overrides)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _variant(name: str, patch_size: int, width: int, depth: int, mlp: int, heads: int) -> ViTConfig:
    return ViTConfig(
        name=name, patch_size=patch_size, embed_dim=width, depth=depth, mlp_dim=mlp, num_heads=heads
    )


# (width D, depth, MLP, heads). Sources: B, L, H from Dosovitskiy et al. 2021 ("An Image Is Worth
# 16x16 Words"), Table 1; Ti and S from Touvron et al. 2021 (DeiT), Table 1, as used by Steiner et
# al. 2021 (AugReg); g and G from Zhai et al. 2022 ("Scaling Vision Transformers"), Table 2.
# Parameter counts: the papers' figures (B/16 86M, L/16 304M, H/14 632M, g/14 1011M, G/14 1843M)
# count the encoder without a classification head (here 85.8M, 303.3M, 630.8M, 1011.2M, 1842.8M);
# with a 1000-class linear head the counts equal torchvision's exactly (B/16: 86,567,656).
VARIANTS: dict[str, ViTConfig] = {
    cfg.name: cfg
    for cfg in (
        _variant("vit_ti16", 16, 192, 12, 768, 3),  # DeiT
        _variant("vit_s16", 16, 384, 12, 1536, 6),  # DeiT
        _variant("vit_b16", 16, 768, 12, 3072, 12),  # ViT paper
        _variant("vit_b32", 32, 768, 12, 3072, 12),  # ViT paper
        _variant("vit_l16", 16, 1024, 24, 4096, 16),  # ViT paper
        _variant("vit_l32", 32, 1024, 24, 4096, 16),  # ViT paper
        _variant("vit_h14", 14, 1280, 32, 5120, 16),  # ViT paper
        _variant("vit_g14", 14, 1408, 40, 6144, 16),  # Zhai et al.
        _variant("vit_G14", 14, 1664, 48, 8192, 16),  # Zhai et al.
        # 4-pixel patches for 32-64 px images (Fashion-MNIST, CIFAR sizes): the `small` preset's model,
        # which learns real small images on 2 CPU workers in minutes.
        ViTConfig(
            name="vit_mini4",
            image_size=32,
            patch_size=4,
            embed_dim=128,
            depth=6,
            num_heads=4,
            mlp_dim=512,
            num_classes=10,
        ),
        # DeiT-S's encoder on 4-pixel patches at 32 px (64 tokens; 21.3 M parameters without a head):
        # a ViT the size DeiT's recipe was made for, on small images; a GPU's model (jobs/benchmarks/
        # gpu.sh learn-5k-s4: plain training against the recipe on 5,000 Fashion-MNIST images).
        _variant("vit_s4", 4, 384, 12, 1536, 6).replace(image_size=32, num_classes=10),
        # Small enough to train on 2 CPU workers in seconds: the tests' and the demo's model.
        ViTConfig(
            name="vit_tiny_test",
            image_size=32,
            patch_size=8,
            embed_dim=64,
            depth=2,
            num_heads=4,
            mlp_dim=128,
            num_classes=10,
        ),
        # Hybrids, paper Sec. 3.1 and Appendix D.2: ResNet-50 stages as the stem, 1x1 patches on its
        # feature map. For /16 the paper drops stage 4 and moves its 3 units into stage 3: (3, 4, 9);
        # for /32 it keeps ResNet-50 whole: (3, 4, 6, 3). patch_size is the stem's stride.
        ViTConfig(
            name="vit_r50_b16", patch_size=16, backbone_layers=(3, 4, 9), backbone_width=64
        ),  # timm vit_base_r50_s16_224
        ViTConfig(
            name="vit_r50_l32",
            patch_size=32,
            embed_dim=1024,
            depth=24,
            num_heads=16,
            mlp_dim=4096,
            backbone_layers=(3, 4, 6, 3),
            backbone_width=64,
        ),  # timm vit_large_r50_s32_224
        # The tests' hybrid: vit_tiny_test's encoder on a two-stage ResNet of stride 8 (same patches).
        ViTConfig(
            name="vit_r_tiny_test",
            image_size=32,
            patch_size=8,
            embed_dim=64,
            depth=2,
            num_heads=4,
            mlp_dim=128,
            num_classes=10,
            backbone_layers=(1, 1),
            backbone_width=32,
        ),
    )
}


def get_config(name: str, **overrides: Any) -> ViTConfig:
    """The named variant's config with some fields replaced (image_size, num_classes, pool, head, ...)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(VARIANTS)}")
    return VARIANTS[name].replace(**overrides)
