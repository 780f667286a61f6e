"""Vision Transformer (Dosovitskiy et al. 2021, "An Image Is Worth 16x16 Words"), in one file.

    x -> PatchEmbed -> [CLS] + patches + pos_embed -> depth x Block -> LayerNorm -> pool -> Head

Input is either uint8 patches ``(B, N, P*P*C)`` in the layout of `vit.patchify` (what the data
pipeline sends; the model normalizes them) or a float image batch ``(B, C, H, W)`` that is already
normalized (the torchvision / timm / transformers convention), which the model patchifies itself.

Native-aspect batches (NaViT, Dehghani et al. 2023; SigLIP 2's NaFlex): images of their own patch grids
in one batch, ``(B, T, P*P*C)`` uint8 with ``coords`` ``(B, T, 2)`` (each patch's row and column in its
image's grid), ``mask`` ``(B, T)`` (True for an image's patches, False for padding) and ``grid``
``(B, 2)`` (each image's (gh, gw)). The learned position grid is resampled to each image's grid, bicubic
as for a new resolution (`vit.pos_embed.sample_pos_embed`); padding is kept out of attention (a key
mask) and out of pooling; [CLS] is as for square input. A square image on the model's own grid computes
what the square path computes.

Staged forward: `forward_features` -> tokens ``(B, 1+N, D)``, `embed` -> ``(B, D)``, `forward` ->
logits. Every layer takes ``device=``, so the model builds on the meta device; `init_weights` is
separate from construction so a sharded meta model can be materialized and initialized in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vit.config import ViTConfig, get_config
from vit.hybrid import ResNet
from vit.patchify import patchify, unpatchify
from vit.pos_embed import resample_pos_embed, sample_pos_embed


class PatchEmbed(nn.Module):
    """Patches -> tokens: a Linear over the flattened patch, with the input normalization inside.

    The Linear over ``k = (p1, p2, c)`` equals a Conv2d(kernel=stride=P) whose weight ``(D, C, P, P)``
    is permuted to ``(D, P, P, C)``. mean/std are buffers, so exported weights carry their preprocessing.

    Hybrid (``config.backbone_layers``): the patches are put back together into the image, a ResNet
    (`vit.hybrid`) turns it into a feature map ``(B, C', H/P, W/P)``, and the Linear projects each
    of its positions (1x1 patches, a Linear over ``C'``).
    """

    def __init__(self, config: ViTConfig, device: torch.device | str | None = None):
        super().__init__()
        self.patch_size = config.patch_size
        self.num_channels = config.num_channels
        self.num_patches = config.num_patches
        self.backbone = ResNet(config, device) if config.backbone_layers is not None else None
        in_features = config.patch_dim if self.backbone is None else config.backbone_channels
        self.proj = nn.Linear(in_features, config.embed_dim, device=device)
        self.register_buffer("mean", torch.tensor(config.mean, device=device))  # (C,)
        self.register_buffer("std", torch.tensor(config.std, device=device))  # (C,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8 and x.dim() == 3:  # (B, N, P*P*C), channels innermost
            b, n, k = x.shape
            p, c = self.patch_size, self.num_channels
            if k != p * p * c:
                raise ValueError(
                    f"patches hold {k} values each, but this model takes {p}x{p}x{c} = {p * p * c}; "
                    f"patchify with patch_size {p}"
                )
            scale = 1.0 / (255.0 * self.std)  # uint8 -> [0, 1] -> (x - mean) / std in one multiply-add
            shift = -self.mean / self.std
            x = x.reshape(b, n, k // self.num_channels, self.num_channels).float() * scale + shift
            x = x.reshape(b, n, k)
            if self.backbone is not None:
                x = self._image(x)  # (B, C, H, W)
        elif x.is_floating_point() and x.dim() == 4:  # (B, C, H, W), already normalized
            if self.backbone is None:
                x = patchify(x.permute(0, 2, 3, 1), self.patch_size)  # (B, N, P*P*C)
        else:
            raise ValueError(
                f"expected uint8 patches (B, N, P*P*C) or a float image batch (B, C, H, W), "
                f"got a {x.dtype} tensor of shape {tuple(x.shape)}"
            )
        if self.backbone is not None:
            x = self.backbone(x).flatten(2).transpose(1, 2)  # (B, C', H/P, W/P) -> (B, N, C'), row-major
        # Match the weight's dtype: under FSDP mixed precision the Linear holds bf16 weights.
        return self.proj(x.to(self.proj.weight.dtype))  # (B, N, D)

    def _image(self, patches: torch.Tensor) -> torch.Tensor:
        """Normalized patches ``(B, N, P*P*C)`` -> the image they tile ``(B, C, H, W)``, for the ResNet."""
        n = patches.shape[1]
        if n != self.num_patches:
            raise ValueError(
                f"got {n} patches, but this hybrid was built for {self.num_patches}: its ResNet reads the "
                "whole image, so pass every patch of an image of the model's image_size (or build the "
                "model with that image_size; masked-patch input needs a plain ViT)"
            )
        grid = math.isqrt(n)
        return unpatchify(patches, self.patch_size, (grid, grid), self.num_channels).permute(0, 3, 1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with one fused QKV projection and PyTorch's SDPA kernels."""

    def __init__(self, config: ViTConfig, device: torch.device | str | None = None):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=config.qkv_bias, device=device)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, device=device)
        self.proj_drop = _dropout(config.dropout)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads)  # (B, T, 3, H, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, hd)
        return q, k, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, T, D)``; ``mask`` bool ``(B, 1, 1, T)``: the keys each token may attend to (None: all)."""
        b, t, d = x.shape
        q, k, v = self._qkv(x)
        # Flash / memory-efficient kernels on GPU; scale is the default 1/sqrt(hd). A key mask takes the
        # memory-efficient kernel (flash has no mask).
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, hd)
        x = x.transpose(1, 2).reshape(b, t, d)  # (B, T, D)
        return self.proj_drop(self.proj(x))

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """The softmax attention weights ``(B, H, T, T)``, computed explicitly (slow; for inspection)."""
        q, k, _ = self._qkv(x)
        return (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)


class MLP(nn.Module):
    """Linear -> GELU -> Linear, D -> mlp_dim -> D (dropout after each Linear when configured)."""

    def __init__(self, config: ViTConfig, device: torch.device | str | None = None):
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_dim, device=device)
        self.act = nn.GELU()  # exact (erf) GELU, as in the paper and in timm / torchvision / transformers
        self.drop1 = _dropout(config.dropout)
        self.fc2 = nn.Linear(config.mlp_dim, config.embed_dim, device=device)
        self.drop2 = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LN encoder block: LN -> MSA -> residual, LN -> MLP -> residual; with stochastic depth, each
    residual branch scaled per sample by `drop_path_keep`'s draw."""

    def __init__(self, config: ViTConfig, device: torch.device | str | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=config.norm_eps, device=device)
        self.attn = Attention(config, device)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=config.norm_eps, device=device)
        self.mlp = MLP(config, device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # Xavier-uniform weights (QKV as three D x D matrices), zero biases, LayerNorm ones/zeros.
        d = self.attn.proj.in_features
        bound = math.sqrt(6.0 / (2 * d))  # Xavier-uniform of one D x D slice of QKV
        nn.init.uniform_(self.attn.qkv.weight, -bound, bound)
        if self.attn.qkv.bias is not None:
            nn.init.zeros_(self.attn.qkv.bias)
        for linear in (self.attn.proj, self.mlp.fc1, self.mlp.fc2):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)
        self.norm1.reset_parameters()
        self.norm2.reset_parameters()

    def forward(
        self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` ``(B, T, D)``; ``keep`` ``(2, B)``: stochastic depth's scale of each sample's attention and
        MLP branch, 0 (dropped) or 1 / (1 - rate) (`drop_path_keep`); None: both branches kept. ``mask``
        bool ``(B, 1, 1, T)``: the keys attention may read (`key_mask`); None: every token."""
        if keep is None:
            x = x + self._attend(self.norm1(x), mask)
            return x + self.mlp(self.norm2(x))
        keep = keep.to(x.dtype)
        x = x + self._attend(self.norm1(x), mask) * keep[0].view(-1, 1, 1)
        return x + self.mlp(self.norm2(x)) * keep[1].view(-1, 1, 1)

    def _attend(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # Square input calls attention as it always has (one argument).
        return self.attn(x) if mask is None else self.attn(x, mask)


class Head(nn.Module):
    """Pretraining: Linear -> tanh -> Linear (one hidden layer). Fine-tuning: one Linear."""

    def __init__(self, config: ViTConfig, device: torch.device | str | None = None):
        super().__init__()
        self.pre_logits = None
        if config.head == "pretrain":
            self.pre_logits = nn.Linear(config.embed_dim, config.pre_logits_dim, device=device)
        self.fc = None
        if config.num_classes > 0:
            self.fc = nn.Linear(config.pre_logits_dim, config.num_classes, device=device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # LeCun-normal hidden layer and a zero classifier, as in the original ViT code.
        if self.pre_logits is not None:
            _lecun_normal_(self.pre_logits)
        if self.fc is not None:
            nn.init.zeros_(self.fc.weight)
            nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.pre_logits is not None:
            x = torch.tanh(self.pre_logits(x))  # (B, R)
        if pre_logits or self.fc is None:
            return x
        return self.fc(x)  # (B, num_classes)


class VisionTransformer(nn.Module):
    """ViT: ``forward_features`` -> ``(B, 1+N, D)``, ``embed`` -> ``(B, D)``, ``forward`` -> logits.

    Parameter names (``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks.N.{norm1, attn.qkv,
    attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``, ``head.{pre_logits, fc}``) are what checkpoints,
    exports and `vit.convert_state_dict` use.
    """

    def __init__(self, config: ViTConfig, *, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        d = config.embed_dim
        self.patch_embed = PatchEmbed(config, device)
        # Stored without a leading batch axis: FSDP shards dim 0, so these split across ranks too.
        self.cls_token = nn.Parameter(torch.empty(d, device=device))  # (D,)
        self.pos_embed = nn.Parameter(torch.empty(1 + config.num_patches, d, device=device))  # (1+N, D)
        self.pos_drop = _dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, device) for _ in range(config.depth))
        self.norm = nn.LayerNorm(d, eps=config.norm_eps, device=device)
        self.head = Head(config, device)
        # Weights made for another image size or patch grid: resample pos_embed as they load.
        self.register_load_state_dict_pre_hook(_resample_pos_embed_on_load)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Reference initialization, in place (works on FSDP2's DTensor parameters; no-op on meta).

        As in the original ViT code: Linear weights Xavier-uniform (QKV as three D x D matrices),
        biases zero, patch embedding and pretraining hidden layer LeCun-normal, [CLS] zero, position
        embeddings normal(0.02), classifier zero, LayerNorm ones/zeros, normalization buffers from
        the config. (The original draws MLP biases from normal(1e-6); zero is the same in practice.)
        """
        c = self.config
        pe = self.patch_embed
        pe.mean.copy_(torch.tensor(c.mean, device=pe.mean.device))
        pe.std.copy_(torch.tensor(c.std, device=pe.std.device))
        _lecun_normal_(pe.proj)
        if pe.backbone is not None:
            pe.backbone.init_weights()
        nn.init.zeros_(self.cls_token)
        nn.init.normal_(self.pos_embed, std=0.02)
        for block in self.blocks:
            block.reset_parameters()
        self.norm.reset_parameters()
        self.head.reset_parameters()

    # --- staged forward --------------------------------------------------------------------------
    def prepare_tokens(
        self,
        x: torch.Tensor,
        ids_keep: torch.Tensor | None = None,
        *,
        coords: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input -> the encoder's input sequence ``(B, 1+N, D)``: [CLS] and patch tokens plus pos_embed.

        With ``ids_keep`` ``(B, n)`` (int64), ``x`` holds only the ``n`` patches at those grid positions
        (uint8 ``(B, n, P*P*C)``, as masked autoencoding sends them) and the sequence is ``(B, 1+n, D)``:
        each token gets the position embedding of where it sits in the full grid.

        With ``coords`` ``(B, T, 2)`` and ``grid`` ``(B, 2)`` (native-aspect input, module docstring):
        ``x`` holds ``T`` patches (padding included), each at (row, col) of its image's own grid, and
        gets the position embedding resampled to that grid there -> ``(B, 1+T, D)``.
        """
        if coords is not None:
            return self._native_tokens(x, coords, grid)
        x = self.patch_embed(x)  # (B, N, D), or (B, n, D) with ids_keep
        b, n, d = x.shape
        if ids_keep is not None:
            if ids_keep.shape != (b, n):
                raise ValueError(
                    f"ids_keep has shape {tuple(ids_keep.shape)}; expected {(b, n)}, one per patch"
                )
            pos = self.pos_embed[1:][ids_keep]  # (B, n, D): gathered, so gradients reach those rows only
            cls = (self.cls_token + self.pos_embed[0]).view(1, 1, d).expand(b, -1, -1)  # (B, 1, D)
            return self.pos_drop(torch.cat([cls, x + pos], dim=1))  # (B, 1+n, D)
        if n != self.config.num_patches:
            c = self.config
            raise ValueError(
                f"got {n} patches, but the model was built for {c.num_patches} "
                f"(image_size {c.image_size}, patch_size {c.patch_size}); resize the input or "
                "build the model with that image_size (its position embeddings are resampled on load)"
            )
        cls = self.cls_token.view(1, 1, d).expand(b, -1, -1)  # (B, 1, D)
        return self.pos_drop(torch.cat([cls, x], dim=1) + self.pos_embed)  # (B, 1+N, D)

    def _native_tokens(
        self, x: torch.Tensor, coords: torch.Tensor, grid: torch.Tensor | None
    ) -> torch.Tensor:
        if self.patch_embed.backbone is not None:
            raise ValueError(
                "native-aspect input needs a plain ViT: a hybrid's ResNet reads a whole square image; "
                "use square patches (--patches square) or a model without backbone_layers"
            )
        if x.dtype != torch.uint8 or x.dim() != 3:
            raise ValueError(
                f"native-aspect input is uint8 patches (B, T, P*P*C) beside coords and grid; got a {x.dtype} "
                f"tensor of shape {tuple(x.shape)}"
            )
        b, t = x.shape[:2]
        if grid is None or coords.shape != (b, t, 2) or grid.shape != (b, 2):
            raise ValueError(
                f"native-aspect input of {b} x {t} patches needs coords of shape {(b, t, 2)} and grid of "
                f"shape {(b, 2)}; got {tuple(coords.shape)} and {None if grid is None else tuple(grid.shape)}"
            )
        tokens = self.patch_embed(x)  # (B, T, D)
        d, side = tokens.shape[-1], self.config.grid_size
        pos = sample_pos_embed(self.pos_embed[1:], (side, side), coords, grid)  # (B, T, D)
        # [CLS] + its position as the square path adds them: the same sums, so on the model's own grid
        # every token is what that path makes, to the bit.
        cls = (self.cls_token + self.pos_embed[0]).view(1, 1, d).expand(b, -1, -1)  # (B, 1, D)
        return self.pos_drop(torch.cat([cls, tokens + pos.to(tokens.dtype)], dim=1))  # (B, 1+T, D)

    def forward_features(
        self,
        x: torch.Tensor,
        ids_keep: torch.Tensor | None = None,
        *,
        coords: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """uint8 patches ``(B, N, P*P*C)`` or float images ``(B, C, H, W)`` -> tokens ``(B, 1+N, D)``.

        With ``ids_keep`` ``(B, n)``: a subset of the patches, at those grid positions -> ``(B, 1+n, D)``.
        Native-aspect input (module docstring): ``coords``, ``mask`` and ``grid`` beside ``(B, T,
        P*P*C)`` patches -> ``(B, 1+T, D)``; a padded token's output is no image's (`pool` leaves it out).
        """
        if (coords is None) != (mask is None) or (coords is None) != (grid is None):
            raise ValueError("native-aspect input takes coords, mask and grid together (or none of them)")
        x = self.prepare_tokens(x, ids_keep, coords=coords, grid=grid)
        # Square input calls the blocks as it always has; native input adds the key mask (B, 1, 1, 1+T).
        masked = () if mask is None else (key_mask(mask),)
        rate = self.config.drop_path_rate
        if not (self.training and rate > 0):
            for block in self.blocks:
                x = block(x, None, *masked) if masked else block(x)
            return self.norm(x)
        # Drawn here, outside the blocks: activation checkpointing recomputes a block with the same
        # masks, and every block's forward has the same inputs, so compiled blocks share one graph.
        keep = drop_path_keep(rate, len(self.blocks), x.shape[0], x.device)  # (depth, 2, B)
        for block, block_keep in zip(self.blocks, keep, strict=True):
            x = block(x, block_keep, *masked)
        return self.norm(x)

    def pool(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens ``(B, 1+N, D)`` -> ``(B, D)``: the [CLS] token, or the mean of the patch tokens (with
        ``mask`` ``(B, N)``: of the image's own, padding left out)."""
        if self.config.pool == "cls":
            return tokens[:, 0]
        if mask is None:
            return tokens[:, 1:].mean(dim=1)
        weights = mask.to(tokens.dtype).unsqueeze(-1)  # (B, N, 1)
        return (tokens[:, 1:] * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)

    def forward_head(
        self, tokens: torch.Tensor, pre_logits: bool = False, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens ``(B, 1+N, D)`` -> logits ``(B, num_classes)``, or the head's input to its last Linear."""
        return self.head(self.pool(tokens, mask), pre_logits=pre_logits)

    def embed(
        self,
        x: torch.Tensor,
        pre_logits: bool = False,
        *,
        coords: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input -> embedding ``(B, D)``: the pooled token after the final LN (the [CLS] token by default).

        With ``pre_logits=True``: the pretraining head's hidden layer, tanh(Linear(pooled)) ``(B, R)``
        (the same as the default for a fine-tuning head, which has no hidden layer). Native-aspect
        input: as `forward_features`.
        """
        tokens = self.forward_features(x, coords=coords, mask=mask, grid=grid)
        if pre_logits:
            return self.forward_head(tokens, pre_logits=True, mask=mask)
        return self.pool(tokens, mask)

    def forward(
        self,
        x: torch.Tensor,
        coords: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input -> logits ``(B, num_classes)`` (the embedding when num_classes is 0); native-aspect
        input: ``model(patches, coords, mask, grid)``, the data pipeline's columns in that order."""
        tokens = self.forward_features(x, coords=coords, mask=mask, grid=grid)
        return self.forward_head(tokens, mask=mask)

    def attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each block's attention weights, ``depth x (B, H, 1+N, 1+N)``; a separate, slow path."""
        x = self.prepare_tokens(x)
        maps = []
        for block in self.blocks:
            maps.append(block.attn.attention_map(block.norm1(x)))
            x = block(x)
        return maps


def key_mask(mask: torch.Tensor) -> torch.Tensor:
    """Patch mask ``(B, T)`` (True: an image's patch) -> attention's key mask ``(B, 1, 1, 1+T)`` for the
    sequence with [CLS] in front: every token reads [CLS] and its image's patches, never padding."""
    cls = torch.ones_like(mask[:, :1], dtype=torch.bool)
    return torch.cat([cls, mask.bool()], dim=1)[:, None, None, :]


def drop_path_keep(
    rate: float, depth: int, batch: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Stochastic depth's per-sample scales ``(depth, 2, B)`` of each block's attention and MLP branch.

    Block ``i`` drops each of its branches for each sample independently with ``r_i = rate * i / (depth
    - 1)`` (timm's linear rule: 0 in the first block, ``rate`` in the last), and scales a kept one by
    ``1 / (1 - r_i)`` so that its expectation is unchanged. Drawn from torch's RNG on ``device``.
    """
    rates = torch.linspace(0.0, rate, depth, device=device).view(depth, 1, 1)  # (depth, 1, 1)
    keep = 1.0 - rates
    return (torch.rand(depth, 2, batch, device=device) < keep).float() / keep  # (depth, 2, B)


def _dropout(rate: float) -> nn.Module:
    # No module at 0: the forward is today's to the bit, and no dropout kernel runs.
    return nn.Dropout(rate) if rate > 0 else nn.Identity()


def _lecun_normal_(linear: nn.Linear) -> None:
    # Truncated normal with std sqrt(1 / fan_in), cut at 2 std (flax's default kernel init).
    std = math.sqrt(1.0 / linear.in_features)
    nn.init.trunc_normal_(linear.weight, std=std, a=-2 * std, b=2 * std)
    nn.init.zeros_(linear.bias)


def _resample_pos_embed_on_load(module: VisionTransformer, state_dict: dict, prefix: str, *args) -> None:
    key = prefix + "pos_embed"
    if key not in state_dict:
        return
    pos_embed = state_dict[key]
    if pos_embed.dim() == 3:  # (1, T, D): the layout of timm and transformers
        pos_embed = pos_embed[0]
    if pos_embed.shape[0] != module.pos_embed.shape[0]:
        pos_embed = resample_pos_embed(pos_embed, module.config.grid_size)
    state_dict[key] = pos_embed


def create_model(
    name: str | ViTConfig, *, device: torch.device | str | None = None, **overrides
) -> VisionTransformer:
    """A ViT from a `vit.VARIANTS` name (or a config), with config fields replaced by ``overrides``.

    ``create_model("vit_b16", image_size=384, num_classes=10, head="finetune")``; with
    ``device="meta"`` nothing is allocated (materialize with ``to_empty`` + ``init_weights``).
    """
    config = name.replace(**overrides) if isinstance(name, ViTConfig) else get_config(name, **overrides)
    return VisionTransformer(config, device=device)
