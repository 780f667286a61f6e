"""The tests' one tiny training config: `vit_tiny_test` (embed_dim 64, depth 2, patch 8, 4 heads) at
32 px, 4 classes, one CPU worker taking the whole batch of 8 in one micro-batch. Tests change what
they test with ``tiny_config(field=value, ...)`` (field names across sections, as flags name them)."""

from __future__ import annotations

from typing import Any

from pipeline.train.config import TrainConfig

TINY = "vit_tiny_test"

_TINY = TrainConfig().replace(
    model=TINY,
    image_size=32,
    num_classes=4,
    batch_size=8,
    micro_batch_size=8,
    num_workers=1,
    lr=1e-3,
    warmup_steps=2,
    max_steps=100,
    use_gpu=False,
    shards="unused",
    out="unused",
)


def tiny_config(**changes: Any) -> TrainConfig:
    """The tiny config with ``changes``."""
    return _TINY.replace(**changes)
