"""What a run optimizes: the batch columns it reads, the per-sample loss, its FLOPs, what it exports.

    supervised  columns (patches, label)              cross-entropy of the classifier, top-1 hits
                with --label-smoothing / --mixup-alpha / --cutmix-alpha: cross-entropy against soft
                targets (`pipeline.train.step.mixing`), a hit being the argmax of the soft target
                export: the ViT as trained
    mae         columns (visible, masked, ids_shuffle) reconstruction error on the masked patches
                export: the encoder alone, under the ViT's own names; its pool (gap) is what the
                embedding job uses by default

Native-aspect batches (``--patches native``, `pipeline.data.native`): the patches come with their
coordinates, mask and grid (supervised: patches, coords, mask, grid, label; mae: visible, masked,
coords, mask, grid), in micro-batches of one token budget, ``micro_batch_size x max_patches``: as many
images as their padded length lets in. Each image's loss counts once, whatever its patches.

Under --compile every forward has the configured micro-batch size: an epoch's short last micro-batch
is padded with copies of its first sample, whose outputs are dropped before the loss, and a pass of
zero loss takes a full batch. A compiled graph sees one batch shape for the whole run, so an epoch's
end recompiles nothing (a new batch size recompiled the whole model: tens of seconds, mid-run).
Native micro-batches are padded alike to the rows their length holds (``budget // length``): a graph
per length, and the lengths are a few (`pipeline.data.native.padded_length`).

The step (`pipeline.train.step.train_step.TrainStep`) and the loop call the objective instead of naming a loss
or a column, so both objectives share every other part of a run: FSDP2, accumulation, skipped steps,
checkpoints, resume, metrics. The module itself is built by `pipeline.train.step.model.create_module`
(what gets built is the model's business; what it is trained for is this module's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import vit
from pipeline.data import native
from pipeline.train.config import TrainConfig
from pipeline.train.observe.mfu import train_flops
from pipeline.train.step.mixing import Mixer
from pipeline.train.step.model import mae_config, model_config


class Objective:
    """The supervised objective, and the interface every objective has."""

    name = "supervised"
    columns: tuple[str, ...] = ("patches", "label")  # host batch columns, in the order `losses` takes
    has_accuracy = True

    def __init__(self, config: TrainConfig):
        self.config = config
        self.model_config = model_config(config)
        self.mixer = Mixer(config.task, self.model_config) if Mixer.wanted(config.task) else None
        # Under compile, the one batch size every forward has (see the module's docstring).
        self.rows = config.optim.micro_batch_size if config.speed.compile else None
        data = config.data_for(self.model_config.patch_size)
        # Native-aspect input: the most patches an image has (None: square), and a micro-batch's tokens.
        self.max_patches = data.patch_budget if data.native else None
        self.budget = config.optim.micro_batch_size * data.patch_budget
        if self.max_patches is not None:
            self.columns = (*native.INPUTS, "label")

    def forward(self, model: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        """``model(*inputs)``, padded to `rows` samples (copies of the first) under compile; the
        output keeps the real samples' rows. Samples are independent in the model (no batch
        statistics), so the padding changes no real sample's output or gradient."""
        n, rows = inputs[0].shape[0], self.rows
        if rows is not None and self.max_patches is not None:  # the rows this micro-batch's length holds
            rows = self.budget // inputs[self.columns.index("coords")].shape[1]
        if rows is None or n >= rows:
            return model(*inputs)
        pad = rows - n
        return model(*(torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) for t in inputs))[:n]

    def losses(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...], seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch -> (per-sample losses ``(B,)`` float32, top-1 hits (a 0-dim count) or None).

        ``seed`` (`pipeline.train.step.mixing.mix_seed`) draws this micro-batch's Mixup/CutMix; without it
        (a pass of zero loss, or mixing off) the labels are the targets, smoothed if asked. With mixed
        targets a hit is a prediction of the soft target's largest class (the label of the larger share).
        """
        *inputs, labels = batch  # uint8 (B, N, K) (native: and coords, mask, grid), int64 (B,)
        if self.mixer is None or seed is None:
            logits = self.forward(model, *inputs).float()  # (B, num_classes)
            smoothing = self.config.task.label_smoothing
            losses = F.cross_entropy(logits, labels, reduction="none", label_smoothing=smoothing)
            return losses, (logits.detach().argmax(-1) == labels).sum()
        patches, targets = self.mixer(inputs[0], labels, seed)  # uint8 (B, N, K), float32 (B, num_classes)
        logits = self.forward(model, patches).float()
        losses = F.cross_entropy(logits, targets, reduction="none")
        return losses, (logits.detach().argmax(-1) == targets.argmax(-1)).sum()

    def idle_batch(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Zeros in `losses`' form, one sample (`rows` under compile): the input of a rank without samples."""
        c, b = self.model_config, self.rows or 1
        if self.max_patches is not None:
            return (*self.idle_native(c.patch_dim, device), torch.zeros(b, dtype=torch.long, device=device))
        patches = torch.zeros(b, c.num_patches, c.patch_dim, dtype=torch.uint8, device=device)
        return patches, torch.zeros(b, dtype=torch.long, device=device)

    def idle_inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The model's part of `idle_batch` (what an evaluation forward of a rank without images takes)."""
        return self.idle_batch(device)[:-1]

    def idle_native(self, patch_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A native-aspect sample of max_patches zero patches (`rows` of them under compile): patches,
        coords, mask, grid, each patch on a grid of one (nothing is padding, nothing out of range)."""
        b, t = (self.rows and self.budget // self.max_patches) or 1, self.max_patches
        return (
            torch.zeros(b, t, patch_dim, dtype=torch.uint8, device=device),
            torch.zeros(b, t, 2, dtype=torch.int16, device=device),
            torch.ones(b, t, dtype=torch.bool, device=device),
            torch.ones(b, 2, dtype=torch.int16, device=device),
        )

    def participate(self, model: nn.Module, device: torch.device) -> None:
        """A forward/backward of zero loss: FSDP2's collectives run, every gradient it adds is zero."""
        losses, _ = self.losses(model, self.idle_batch(device))
        (losses.sum() * 0.0).backward()

    def flops_per_image(self) -> float:
        """Model FLOPs of one training image (`pipeline.train.observe.mfu.train_flops` of the ViT's forward); a
        native-aspect image at its most patches."""
        return train_flops(vit.count_flops(self.model_config, num_patches=self.max_patches))

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint records of the objective; a resume must find the same."""
        return {"objective": self.name}

    def export_state(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full state dict -> what ``final/`` holds, a state dict of `model_config`'s ViT. The
        export's config.json records `checkpoint_meta` too."""
        return state_dict


class MAEObjective(Objective):
    """Masked autoencoding (`vit.mae`): the data stage drew the mask; the model returns the losses."""

    name = "mae"
    columns = ("visible", "masked", "ids_shuffle")
    has_accuracy = False

    def __init__(self, config: TrainConfig):
        super().__init__(config)
        self.mae_config = mae_config(config)
        if self.max_patches is None:
            self.num_visible = _num_visible(self.model_config.num_patches, config.task.mask_ratio)
        else:
            self.columns = native.MAE_INPUTS
            self.num_visible = native.native_visible(self.max_patches, config.task.mask_ratio)

    def losses(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...], seed: int | None = None
    ) -> tuple[torch.Tensor, None]:
        # uint8 (B, n, K), uint8 (B, N-n, K), int16/32 (B, N); native: and coords, mask, grid in its place
        return self.forward(model, *batch).float(), None

    def idle_batch(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        c, n, b = self.model_config, self.num_visible, self.rows or 1
        if self.max_patches is not None:
            patches, coords, mask, grid = self.idle_native(c.patch_dim, device)
            return patches[:, :n], patches[:, n:], coords, mask, grid
        visible = torch.zeros(b, n, c.patch_dim, dtype=torch.uint8, device=device)
        masked = torch.zeros(b, c.num_patches - n, c.patch_dim, dtype=torch.uint8, device=device)
        return visible, masked, torch.arange(c.num_patches, device=device).repeat(b, 1)

    def flops_per_image(self) -> float:
        """`train_flops` of the encoder over the visible tokens + the decoder over all, `vit.count_mae_flops`."""
        c, n = self.model_config, self.num_visible
        return train_flops(vit.count_mae_flops(c, self.mae_config, n, num_patches=self.max_patches))

    def checkpoint_meta(self) -> dict[str, Any]:
        return {
            "objective": self.name,
            "mask_ratio": self.config.task.mask_ratio,
            "mae": self.mae_config.to_dict(),
        }

    def export_state(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The encoder only (the decoder serves pretraining alone; checkpoints keep it)."""
        from vit.mae import encoder_state_dict

        return encoder_state_dict(state_dict)


def _num_visible(num_patches: int, mask_ratio: float) -> int:
    from pipeline.data.masking import num_visible

    return num_visible(num_patches, mask_ratio)


# One class per name in `pipeline.train.sections.OBJECTIVES`, the names' one home: the config checks
# --objective without importing torch, and this module imports the config (never the other way).
CLASSES: tuple[type[Objective], ...] = (Objective, MAEObjective)


def objective_for(config: TrainConfig) -> Objective:
    """The objective `config.task.objective` names."""
    return next(cls for cls in CLASSES if cls.name == config.task.objective)(config)
