"""What a pretraining run is: one frozen dataclass, resolved from a preset plus overrides.

The command line (`jobs/pretrain.py`) is a preset plus a few flags; every flag is a field here.
The resolved config is saved beside every checkpoint and in the final export, so a run can always
say what it was.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.data.config import DataConfig

OBJECTIVES = ("supervised", "mae")


@dataclass(frozen=True)
class TrainConfig:
    # --- what to train (a vit.VARIANTS name; overrides replace ViTConfig fields) -------------
    model: str = "vit_b16"
    image_size: int = 224
    num_classes: int = 1000
    model_overrides: dict[str, Any] = field(default_factory=dict)

    # --- objective (pipeline.train.objective) --------------------------------------------------
    objective: str = "supervised"  # "supervised": labels, classifier head; "mae": masked autoencoding
    # MAE (He et al. 2022): share of patches hidden from the encoder, targets, the decoder's size.
    mask_ratio: float = 0.75
    norm_pix_loss: bool = True  # reconstruct each patch's standardized pixels (the paper's better targets)
    decoder_dim: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16

    # --- fine-tuning (jobs/finetune.py) ----------------------------------------------------------
    weights: str | None = None  # fine-tuning starts from these: an export, a run dir or a checkpoint
    eval_data: str = ""  # held-out shards, evaluated with the eval crop
    eval_every: int = 0  # steps between evaluations of eval_data (0: only at the end)

    # --- data ----------------------------------------------------------------------------------
    data: str = ""  # shard URL(s): path, dir, glob, brace range, s3://, gs://, comma-separated
    label_key: str | None = "cls"  # member extension holding the label, "json:<field>", None: no labels
    shuffle_buffer: int = 2000  # local sample shuffle buffer per worker
    # Augmentation: random-resized-crop area share and aspect range (w/h), horizontal flips.
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True
    max_bad_fraction: float = 0.01  # share of corrupt samples that fails the run

    # --- optimization (defaults: the ViT paper's pretraining recipe) --------------------------
    optimizer: str = "adamw"  # "adamw", or "sgd" with momentum (the paper's fine-tuning)
    momentum: float = 0.9  # SGD only
    batch_size: int = 4096  # global: images per optimizer step, across all workers
    micro_batch_size: int = 64  # images per worker per forward/backward; the rest is accumulation
    lr: float = 1e-3  # peak learning rate, after warmup
    min_lr: float = 0.0
    weight_decay: float = 0.1  # not applied to biases, norms, position and CLS embeddings
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 10_000
    max_steps: int = 100_000  # length of the schedule
    lr_schedule: str = "cosine"  # "cosine" or "linear" decay after warmup
    grad_clip: float = 1.0  # global-norm clipping
    max_skipped_steps: int = 5  # steps in a row skipped for a non-finite loss/gradient that fail the run
    seed: int = 0

    # --- systems -------------------------------------------------------------------------------
    activation_checkpointing: bool = False
    compile: bool = False
    # Speed switches; each computes what its default does (tests/train/test_speed_paths.py).
    compile_scope: str = "blocks"  # with compile: "blocks" (one graph per block) or "model" (whole forward)
    ac_mode: str = "full"  # with activation_checkpointing: "full", "alternate" (every other block), "ops"
    optimizer_impl: str = "auto"  # AdamW: auto (fused on CUDA, else foreach), fused, foreach, for-loop
    fp8: bool = False  # float8 training of the blocks' Linear layers (torchao; compute capability 8.9+)
    prefetch_steps: int = 2  # steps of input built ahead on a background thread (0: built by the step)

    # --- cluster shape -------------------------------------------------------------------------
    num_workers: int = 2
    use_gpu: bool = True
    cpus_per_worker: float = 1.0  # the rest of the cluster's CPUs decode data
    placement_strategy: str = "PACK"  # of the workers over nodes: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    # Decode CPUs per worker; None: decided each epoch from the cluster.
    data_cpus_per_worker: float | None = None
    # Ranks sharing one FSDP shard group (HSDP); None: the workers of a node.
    shard_group_size: int | None = None
    shared_out: bool = False  # a local --out is one filesystem mounted at the same path on every node

    # --- run -----------------------------------------------------------------------------------
    out: str = ""  # run directory: local path, s3:// or gs://
    log_every: int = 10
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    max_failures: int = 3  # worker-group restarts from the latest checkpoint
    stop_at_step: int | None = None  # end this run early (the schedule still follows max_steps)
    tensorboard: bool = False  # also write TensorBoard event files under <out>/tensorboard/ (rank 0)
    wandb: str | None = None  # also log to this Weights & Biases project (rank 0)

    # ------------------------------------------------------------------------------------------
    @property
    def world_batch_per_micro_step(self) -> int:
        return self.micro_batch_size * self.num_workers

    @property
    def last_step(self) -> int:
        return self.max_steps if self.stop_at_step is None else min(self.stop_at_step, self.max_steps)

    def validate(self) -> None:
        """Raise a one-line ValueError for a config that cannot run (before any cluster work)."""
        if not self.data:
            raise ValueError(
                "no training data: pass --data with a shard URL (path, glob, brace range, s3://...)"
            )
        if not self.out:
            raise ValueError(
                "no output location: pass --out with a run directory (local path, s3:// or gs://)"
            )
        for name in (
            "batch_size",
            "micro_batch_size",
            "max_steps",
            "num_workers",
            "log_every",
            "checkpoint_every",
            "max_skipped_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.batch_size % self.world_batch_per_micro_step:
            raise ValueError(
                f"--batch-size {self.batch_size} is not a multiple of --micro-batch-size x --num-workers "
                f"= {self.world_batch_per_micro_step}; pick a batch size divisible by it"
            )
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"--placement-strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got {self.placement_strategy!r}"
            )
        if self.data_cpus_per_worker is not None and self.data_cpus_per_worker <= 0:
            raise ValueError(f"--data-cpus-per-worker must be positive, got {self.data_cpus_per_worker}")
        if self.shard_group_size is not None and (
            self.shard_group_size < 1 or self.num_workers % self.shard_group_size
        ):
            raise ValueError(
                f"--shard-group-size {self.shard_group_size} does not divide --num-workers {self.num_workers}; "
                "use a divisor of it (usually the GPUs of one node), or leave it out"
            )
        if self.prefetch_steps < 0:
            raise ValueError(f"prefetch_steps must be 0 or more, got {self.prefetch_steps}")
        if self.lr_schedule not in ("cosine", "linear"):
            raise ValueError(f"--lr-schedule must be 'cosine' or 'linear', got {self.lr_schedule!r}")
        if not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ValueError(f"--crop-scale {self.crop_scale} must satisfy 0 < MIN <= MAX <= 1, e.g. 0.08,1")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"--crop-ratio {self.crop_ratio} must satisfy 0 < MIN <= MAX, e.g. 0.75,1.33")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"--max-bad-fraction must be in [0, 1], got {self.max_bad_fraction}")
        if self.warmup_steps >= self.max_steps and self.max_steps > 1:
            raise ValueError(
                f"--warmup-steps {self.warmup_steps} leaves no decay within --max-steps {self.max_steps}; "
                "use fewer warmup steps"
            )
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        self._validate_objective()
        self._validate_speed()
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb needs the wandb package: pip install 'vitray[wandb]'")

    def _validate_speed(self) -> None:
        choices = {
            "compile_scope": ("blocks", "model"),
            "ac_mode": ("full", "alternate", "ops"),
            "optimizer_impl": ("auto", "fused", "foreach", "for-loop"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.fp8 and not self.use_gpu:
            raise ValueError("--fp8 needs GPUs (compute capability 8.9+, e.g. H100); drop --fp8 or --cpu")
        if self.fp8 and importlib.util.find_spec("torchao") is None:
            raise ValueError("--fp8 needs the torchao package: pip install 'vitray[fp8]'")

    def _validate_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be 0 (only at the end) or more, got {self.eval_every}")
        if self.objective == "supervised":
            if self.label_key is None:
                raise ValueError(
                    "--label-key none leaves supervised training without labels; pass a label key "
                    "(cls, json:<field>) or --objective mae"
                )
            return
        if self.weights or self.eval_data:
            raise ValueError("fine-tuning and --eval-data are supervised; drop --objective mae")
        if not 0 < self.mask_ratio < 1:
            raise ValueError(
                f"--mask-ratio must be strictly between 0 and 1 (MAE's is 0.75), got {self.mask_ratio}"
            )
        for name in ("decoder_dim", "decoder_depth", "decoder_num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.decoder_dim % 4 or self.decoder_dim % self.decoder_num_heads:
            raise ValueError(
                f"--decoder-dim {self.decoder_dim} must be a multiple of 4 and of --decoder-num-heads "
                f"{self.decoder_num_heads}, e.g. 512 with 16 heads"
            )

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown training config fields {unknown}; known: {sorted(known)}")
        # JSON has no tuples: restore them where the field expects one.
        fixed = {
            k: tuple(v) if isinstance(v, list) and "tuple" in str(known[k].type) else v
            for k, v in values.items()
        }
        return cls(**fixed)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def data_config(config: TrainConfig, patch_size: int) -> DataConfig:
    """The training input transform: random-resized crops of the run's size; supervised runs need
    labels in range, MAE runs none (labels are read where present) and get the mask drawn."""
    supervised = config.objective == "supervised"
    return DataConfig(
        image_size=config.image_size,
        patch_size=patch_size,
        scale=config.crop_scale,
        ratio=config.crop_ratio,
        hflip=config.hflip,
        mask_ratio=None if supervised else config.mask_ratio,
        label_key=config.label_key,
        require_labels=supervised,
        num_classes=config.num_classes if supervised else None,
        seed=config.seed,
        shuffle_buffer=config.shuffle_buffer,
        max_bad_fraction=config.max_bad_fraction,
    )
