"""Masked autoencoder (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners") on the ViT.

    visible patches (B, n, K) + ids_shuffle (B, N) -> encoder: the ViT over [CLS] + the n visible tokens
        -> decoder: embed to decoder_dim, append N - n mask tokens, + fixed 2D sin-cos positions,
           decoder_depth pre-LN blocks, LayerNorm, Linear -> pixels (B, N, K)
    loss: mean squared error on the N - n masked patches only (per-patch normalized pixels by default)

The mask is drawn in the data pipeline (`pipeline.data.masking`), which sends the visible patches, the
masked ones (the loss's targets) and ``ids_shuffle``, a permutation of the grid positions with the
visible ones first: ``visible[b, j]`` is the patch at grid position ``ids_shuffle[b, j]``, ``masked[b,
j]`` the one at ``ids_shuffle[b, n + j]``. Nothing here draws random numbers.

The decoder runs in that shuffled order and never restores the grid order: attention without a causal
mask is permutation-equivariant, so giving each token its own position embedding is all the order
there is. Predictions come out in the same order, so the masked ones are simply the last ``N - n``.

Native-aspect batches (images at their own patch grids, `vit.model`): the data stage masks each image's
own patches and sends, instead of ``ids_shuffle``, ``coords`` ``(B, n+m, 2)`` (the grid place of each
visible slot, then of each masked slot), ``mask`` ``(B, n+m)`` (which slots hold an image's patch) and
``grid`` ``(B, 2)``. The encoder sees the visible patches with their coordinates; the decoder's sin-cos
positions are computed from the coordinates (on a square grid: the same codes as the fixed table); the
loss is the mean over each image's own masked patches, padding left out of attention and loss alike.

The encoder is `vit.VisionTransformer` itself, under ``encoder.``: `encoder_state_dict` strips that
prefix and what is left loads into `vit.create_model` / `vit.load_pretrained` and the embedding job.
The decoder is pretraining-only and is dropped at export.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vit.config import ViTConfig, get_config
from vit.model import Block, VisionTransformer, key_mask


@dataclass(frozen=True)
class MAEConfig:
    """The decoder and the loss; the encoder is a `vit.ViTConfig`, the mask ratio the data pipeline's.

    Defaults are the paper's (Table 1 and Sec. 4): a 512-wide, 8-block decoder with 16 heads, MLP 4x,
    and per-patch normalized pixels as targets.
    """

    decoder_dim: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16
    decoder_mlp_dim: int | None = None  # None: 4 * decoder_dim
    norm_pix_loss: bool = True  # targets: each patch's pixels minus its mean, over its std

    def __post_init__(self) -> None:
        for field in ("decoder_dim", "decoder_depth", "decoder_num_heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MAEConfig: {field} must be a positive integer, got {value!r}")
        if self.decoder_dim % self.decoder_num_heads:
            raise ValueError(
                f"MAEConfig: decoder_dim {self.decoder_dim} is not divisible by decoder_num_heads "
                f"{self.decoder_num_heads}; pick a head count among its divisors"
            )
        if self.decoder_dim % 4:  # the 2D sin-cos code: sin and cos for each of the two axes
            raise ValueError(f"MAEConfig: decoder_dim {self.decoder_dim} must be a multiple of 4")
        if self.decoder_mlp_dim is not None and self.decoder_mlp_dim <= 0:
            raise ValueError(
                f"MAEConfig: decoder_mlp_dim must be positive or None, got {self.decoder_mlp_dim}"
            )

    def decoder_config(self, encoder: ViTConfig) -> ViTConfig:
        """The decoder blocks' shapes as a ViTConfig (what `vit.model.Block` reads), beside ``encoder``."""
        return encoder.replace(
            name=f"{encoder.name}_mae_decoder",
            embed_dim=self.decoder_dim,
            depth=self.decoder_depth,
            num_heads=self.decoder_num_heads,
            mlp_dim=self.decoder_mlp_dim or 4 * self.decoder_dim,
            num_classes=0,
            head="finetune",
            # The paper's decoder has neither (the encoder's are its own settings).
            drop_path_rate=0.0,
            dropout=0.0,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MAEConfig:
        """Inverse of `to_dict`; unknown keys are an error."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown MAEConfig field(s) {unknown}; valid fields: {sorted(fields)}")
        return cls(**data)


def sincos_pos_embed(embed_dim: int, grid_size: int) -> torch.Tensor:
    """Fixed 2D sin-cos position embeddings ``(1+N, D)``, N = grid_size**2, row 0 ([CLS]) all zeros.

    Half of D codes the row, half the column; each half is sin then cos of the position times
    frequencies 1 / 10000^(i / (D/4)), i = 0 .. D/4 - 1 (the Transformer's code, once per axis).
    """
    coords = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")  # (G, G) each, row-major like the patches
    grid = sincos_codes(embed_dim, torch.stack([rows, cols], dim=-1).reshape(-1, 2))  # (N, D)
    return torch.cat([torch.zeros(1, embed_dim), grid])  # (1+N, D)


def sincos_codes(embed_dim: int, coords: torch.Tensor) -> torch.Tensor:
    """The 2D sin-cos code of each (row, col) in ``coords`` ``(..., 2)`` -> float32 ``(..., D)``, computed
    in float64 (so a square grid's codes are `sincos_pos_embed`'s rows, to the bit)."""
    quarter = embed_dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64, device=coords.device) / quarter)

    def code(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.double().unsqueeze(-1) * omega  # (..., D/4)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (..., D/2)

    return torch.cat([code(coords[..., 0]), code(coords[..., 1])], dim=-1).float()  # (..., D)


def take_patches(patches: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``patches`` ``(B, N, K)`` at grid positions ``ids`` ``(B, n)`` -> ``(B, n, K)``."""
    return torch.take_along_dim(patches, ids.long().unsqueeze(-1), dim=1)


def unshuffle(x: torch.Tensor, ids_shuffle: torch.Tensor) -> torch.Tensor:
    """Rows in shuffled order ``(B, N, K)`` -> grid order: ``out[b, ids_shuffle[b, j]] = x[b, j]``."""
    index = ids_shuffle.long().unsqueeze(-1).expand_as(x)
    return torch.empty_like(x).scatter_(1, index, x)


def pixel_targets(
    patches: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...], *, norm_pix_loss: bool
) -> torch.Tensor:
    """uint8 patches ``(B, n, P*P*C)`` -> float32 reconstruction targets ``(B, n, P*P*C)``.

    Pixels are first normalized as the encoder's input is (``(x / 255 - mean) / std``, channels
    innermost); with ``norm_pix_loss`` each patch is then standardized by its own mean and (unbiased)
    variance + 1e-6, the paper's targets, which it found to give better representations.
    """
    b, n, k = patches.shape
    c = len(mean)
    mean_t = torch.tensor(mean, device=patches.device)
    std_t = torch.tensor(std, device=patches.device)
    x = ((patches.reshape(b, n, k // c, c).float() / 255.0 - mean_t) / std_t).reshape(b, n, k)
    if norm_pix_loss:
        x = (x - x.mean(dim=-1, keepdim=True)) / (x.var(dim=-1, keepdim=True) + 1e-6).sqrt()
    return x


def reconstruction(
    pred: torch.Tensor,
    visible: torch.Tensor,
    masked: torch.Tensor,
    ids_shuffle: torch.Tensor,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    *,
    norm_pix_loss: bool,
) -> torch.Tensor:
    """The image an MAE shows: visible patches as they were, masked ones predicted -> uint8 ``(B, N, K)``.

    In grid order (`vit.unpatchify` makes images of it). Predictions are mapped back to pixels with
    ``mean``/``std``; with ``norm_pix_loss`` they are standardized patches, which are given each
    masked patch's own mean and spread first (as the paper's figures do: they use the target's).
    """
    b, n_mask, k = masked.shape
    c = len(mean)
    x = pred[:, -n_mask:].float()  # (B, M, K), in the space of `pixel_targets`
    if norm_pix_loss:
        plain = pixel_targets(masked, mean, std, norm_pix_loss=False)
        x = x * (plain.var(dim=-1, keepdim=True) + 1e-6).sqrt() + plain.mean(dim=-1, keepdim=True)
    mean_t = torch.tensor(mean, device=x.device)
    std_t = torch.tensor(std, device=x.device)
    x = (x.reshape(b, n_mask, k // c, c) * std_t + mean_t).reshape(b, n_mask, k)
    filled = (x * 255.0).round().clamp(0, 255).to(torch.uint8)  # (B, M, K)
    return unshuffle(torch.cat([visible, filled], dim=1), ids_shuffle)  # (B, N, K)


class MAEDecoder(nn.Module):
    """Encoder tokens ``(B, 1+n, D)`` + ``ids_shuffle`` ``(B, N)`` -> pixel predictions ``(B, N, P*P*C)``.

    Parameters: ``embed`` (D -> decoder_dim), ``mask_token``, ``blocks.N.*`` (pre-LN, `vit.model.Block`),
    ``norm``, ``pred`` (decoder_dim -> P*P*C). Position embeddings are fixed 2D sin-cos, as in the
    paper's decoder: the decoder is thrown away after pretraining, so learning them buys nothing that
    lasts, and a fixed code gives the identical mask tokens distinct, smoothly varying positions from
    the first step. They are a buffer computed by `init_weights`, not persistent, so neither
    checkpoints nor exports carry them.
    """

    def __init__(self, encoder: ViTConfig, config: MAEConfig, device: torch.device | str | None = None):
        super().__init__()
        dec = config.decoder_config(encoder)
        self.grid_size = encoder.grid_size
        self.embed = nn.Linear(encoder.embed_dim, dec.embed_dim, device=device)
        self.mask_token = nn.Parameter(torch.empty(dec.embed_dim, device=device))  # (Dd,)
        pos = torch.empty(1 + encoder.num_patches, dec.embed_dim, device=device)
        self.register_buffer("pos_embed", pos, persistent=False)  # (1+N, Dd)
        self.blocks = nn.ModuleList(Block(dec, device) for _ in range(dec.depth))
        self.norm = nn.LayerNorm(dec.embed_dim, eps=dec.norm_eps, device=device)
        self.pred = nn.Linear(dec.embed_dim, encoder.patch_dim, device=device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The paper's: Xavier-uniform Linear weights, zero biases, mask token normal(0.02), fixed positions."""
        self.pos_embed.copy_(sincos_pos_embed(self.pos_embed.shape[1], self.grid_size))
        nn.init.normal_(self.mask_token, std=0.02)
        for linear in (self.embed, self.pred):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)
        for block in self.blocks:
            block.reset_parameters()
        self.norm.reset_parameters()

    def forward(
        self, latent: torch.Tensor, where: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Encoder tokens ``(B, 1+n, D)`` -> predictions ``(B, n+m, P*P*C)`` of the n visible and m masked
        slots. ``where``: ``ids_shuffle`` ``(B, N)`` (m = N - n); with ``mask`` ``(B, n+m)`` (native-aspect
        input), the slots' coordinates ``(B, n+m, 2)``, padded slots left out of attention."""
        b, t, _ = latent.shape  # t = 1 + n: [CLS] and the n visible tokens
        n_mask = where.shape[1] - (t - 1)
        x = self.embed(latent)  # (B, 1+n, Dd)
        masks = self.mask_token.to(x.dtype).view(1, 1, -1).expand(b, n_mask, -1)  # (B, m, Dd)
        x = torch.cat([x, masks], dim=1)  # (B, 1+n+m, Dd): [CLS], visible, masked (shuffled order)
        if mask is None:
            pos = self.pos_embed.to(x.dtype)  # a buffer: FSDP's mixed precision casts parameters only
            x = x + torch.cat([pos[:1].expand(b, 1, -1), pos[1:][where.long()]], dim=1)
        else:  # [CLS]'s code is zeros, as row 0 of the table
            codes = sincos_codes(x.shape[-1], where).to(x.dtype)  # (B, n+m, Dd)
            x = x + torch.cat([torch.zeros_like(codes[:, :1]), codes], dim=1)
        keys = None if mask is None else key_mask(mask)  # (B, 1, 1, 1+n+m)
        for block in self.blocks:
            x = block(x) if keys is None else block(x, None, keys)
        return self.pred(self.norm(x[:, 1:]))  # (B, n+m, P*P*C): [CLS] dropped, nothing to predict there


class MaskedAutoencoder(nn.Module):
    """`forward` (visible, masked, ids_shuffle) -> per-sample losses; `predict` -> pixel predictions.

    Parameter names: ``encoder.*`` (exactly a `vit.VisionTransformer`'s) and ``decoder.{embed,
    mask_token, blocks.N.*, norm, pred}``. `blocks` lists every transformer block, encoder's then
    decoder's: the units that `vit.parallelize` checkpoints, compiles and shards.
    """

    def __init__(self, encoder: ViTConfig, config: MAEConfig, *, device: torch.device | str | None = None):
        super().__init__()
        if getattr(encoder, "backbone_layers", None) is not None:
            raise ValueError(
                "masked autoencoding needs a plain ViT encoder: a hybrid's ResNet reads the whole image, "
                "not the visible patches; build the encoder without backbone_layers"
            )
        self.config = config
        self.encoder = VisionTransformer(encoder, device=device)
        self.decoder = MAEDecoder(encoder, config, device)
        self.decoder.init_weights()  # the encoder initialized itself

    @property
    def blocks(self) -> list[Block]:
        return [*self.encoder.blocks, *self.decoder.blocks]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize encoder and decoder in place (after ``to_empty`` on a meta-built model)."""
        self.encoder.init_weights()
        self.decoder.init_weights()

    def forward_encoder(
        self,
        visible: torch.Tensor,
        where: torch.Tensor,
        mask: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """uint8 visible patches ``(B, n, K)`` + ``ids_shuffle`` ``(B, N)`` -> tokens ``(B, 1+n, D)``; native-
        aspect input: ``where`` the slots' coordinates ``(B, n+m, 2)``, with ``mask`` and ``grid``."""
        n = visible.shape[1]
        if not 0 < n < where.shape[1]:
            raise ValueError(
                f"got {n} visible patches of {where.shape[1]}; a masked autoencoder needs at "
                "least one visible and one masked patch (mask_ratio strictly between 0 and 1)"
            )
        if mask is not None:
            return self.encoder.forward_features(visible, coords=where[:, :n], mask=mask[:, :n], grid=grid)
        return self.encoder.forward_features(visible, ids_keep=where[:, :n].long())

    def predict(
        self,
        visible: torch.Tensor,
        where: torch.Tensor,
        mask: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Visible patches ``(B, n, K)`` + ``ids_shuffle`` ``(B, N)`` -> predicted pixels ``(B, N, K)``.

        In the shuffled order: row j predicts grid position ``ids_shuffle[:, j]``; the last ``N - n``
        rows are the masked patches' (`unshuffle` puts rows back in grid order). In the space of
        `pixel_targets`: with ``norm_pix_loss``, each patch standardized. (On an FSDP-sharded model
        call the model itself: only ``forward`` gathers the parameters.) Native-aspect input (module
        docstring): ``where`` holds the slots' coordinates, with ``mask`` and ``grid`` -> ``(B, n+m, K)``.
        """
        latent = self.forward_encoder(visible, where, mask, grid)
        return self.decoder(latent, where, mask)

    def forward_loss(
        self, pred: torch.Tensor, masked: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Predictions ``(B, N, K)`` + the masked patches, uint8 ``(B, M, K)`` -> per-sample loss ``(B,)``.

        Mean squared error over the masked patches only (the last M rows of ``pred``), in float32;
        the mean over the batch is the paper's loss, since every sample has the same M. With ``mask``
        (native-aspect input, ``(B, n+M)``): the mean over each image's own masked patches.
        """
        m = masked.shape[1]
        c = self.encoder.config
        target = pixel_targets(masked, c.mean, c.std, norm_pix_loss=self.config.norm_pix_loss)
        squares = (pred[:, -m:].float() - target).pow(2)  # (B, M, K)
        if mask is None:
            return squares.mean(dim=(1, 2))
        real = mask[:, -m:].float()  # (B, M)
        return (squares.mean(dim=2) * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)

    def forward(
        self,
        visible: torch.Tensor,
        masked: torch.Tensor,
        where: torch.Tensor,
        mask: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One batch of the data stage -> per-sample reconstruction loss ``(B,)``, float32.

        ``visible`` uint8 ``(B, n, K)``, ``masked`` uint8 ``(B, N - n, K)``, ``where``: ``ids_shuffle``
        ``(B, N)``; native-aspect input: ``where`` the slots' coordinates ``(B, n+m, 2)``, ``mask``
        ``(B, n+m)`` and ``grid`` ``(B, 2)`` (the data pipeline's columns in that order).
        The loss, not the predictions, is what leaves the (FSDP root's) forward: one small tensor.
        """
        if (mask is None) != (grid is None):
            raise ValueError("native-aspect input takes coords, mask and grid together (or none of them)")
        return self.forward_loss(self.predict(visible, where, mask, grid), masked, mask)


def create_mae(
    name: str | ViTConfig,
    *,
    mae: MAEConfig | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> MaskedAutoencoder:
    """An MAE whose encoder is the named ViT (config fields replaced by ``overrides``).

    The encoder defaults to no classifier (``num_classes=0``, ``head="finetune"``) and ``pool="gap"``:
    the loss reaches the [CLS] token only through the decoder's attention, while every patch token
    is trained to describe its patch, so their mean is the embedding an export should offer (it is
    also what the paper fine-tunes from). Any of the three can be overridden.
    """
    encoder_defaults = {"num_classes": 0, "head": "finetune", "pool": "gap"}
    base = name if isinstance(name, ViTConfig) else get_config(name)
    encoder = base.replace(**{**encoder_defaults, **overrides})
    return MaskedAutoencoder(encoder, mae or MAEConfig(), device=device)


def encoder_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MAE state dict -> its encoder's, with `vit.VisionTransformer`'s names (``encoder.`` removed)."""
    prefix = "encoder."
    out = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not out:
        raise ValueError("no 'encoder.*' entries in this state dict; is it a MaskedAutoencoder's?")
    return out
