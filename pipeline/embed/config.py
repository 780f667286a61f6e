"""What an embedding run is: one frozen dataclass that the command line of ``jobs/embed.py`` fills."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

EMBEDDINGS = ("cls", "pre_logits")
CPU_BATCH_SIZE, GPU_BATCH_SIZE = 64, 256  # default images per forward
# What `--label-key auto` means: the training run's label key, else this.
DEFAULT_LABEL_KEY = "cls"


@dataclass(frozen=True)
class EmbedConfig:
    """One embedding run; the command line of ``jobs/embed.py`` maps onto it field by field."""

    data: str  # shard URL(s), as for training
    weights: str  # export dir, run dir, checkpoint dir, HF dir or weights file
    out: str  # output directory: local path, s3://, gs://
    weights_format: str = "auto"  # auto | vitray | timm | torchvision | hf
    model: str | None = None  # vit.VARIANTS name; checked against the weights' shapes
    embedding: str = (
        "cls"  # "cls": [CLS] after the final LN; "pre_logits": the pretraining head's hidden layer
    )
    image_size: int | None = None  # None: the model's own
    batch_size: int | None = None  # images per forward; None: `forward_batch_size`'s default
    concurrency: int = 1  # actors, each holding one model (one GPU each with use_gpu)
    use_gpu: bool = False
    cpus_per_actor: float = 1.0  # logical CPUs per actor; on CPU also its torch threads
    overwrite: bool = False
    label_key: str | None = "auto"  # "auto": the training run's; None: unlabeled shards
    crop_fraction: float | None = None  # None: the training run's, else DataConfig's default
    interpolation: str | None = None  # eval resampling; None: the training run's, else bicubic
    max_bad_fraction: float = 0.01
    storage_options: dict | None = None  # fsspec options for reading shards and writing --out

    def validate(self) -> None:
        """A one-line ValueError for a value that cannot work."""
        for name in ("data", "weights", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.embedding not in EMBEDDINGS:
            raise ValueError(f"--embedding must be one of {', '.join(EMBEDDINGS)}, got {self.embedding!r}")
        if (
            (self.batch_size is not None and self.batch_size <= 0)
            or self.concurrency <= 0
            or self.cpus_per_actor <= 0
        ):
            raise ValueError("--batch-size, --concurrency and --cpus-per-actor must be positive")

    def forward_batch_size(self) -> int:
        """Images per forward: ``batch_size``, else 64 on CPU (a few hundred MB of activations at 224 px)
        and 256 on a GPU, where ViT-B/16 to ViT-H/14 at 224 px need that many to keep it busy."""
        return self.batch_size or (GPU_BATCH_SIZE if self.use_gpu else CPU_BATCH_SIZE)

    def replace(self, **changes: Any) -> EmbedConfig:
        return dataclasses.replace(self, **changes)
