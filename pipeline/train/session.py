"""This worker's link to Ray Train, behind the few calls the worker loop makes (`pipeline.train.loop`
runs with any object that has them: the tests use an in-process one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
from ray.train import Checkpoint


class RaySession:
    """This worker's link to Ray Train: who it is, the checkpoint to resume from, where reports go."""

    def __init__(self) -> None:
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.node_id = ray.get_runtime_context().get_node_id()

    @contextlib.contextmanager
    def resume_from(self) -> Iterator[tuple[Path, str] | None]:
        """(local directory, where it came from) of the checkpoint to resume from, or None."""
        resumed = ray.train.get_checkpoint()
        if resumed is None:
            yield None
            return
        with resumed.as_directory() as directory:
            yield Path(directory), resumed.path

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None = None, name: str = "") -> None:
        """Collective: hand metrics (and this rank's part of a checkpoint) to Ray Train."""
        if checkpoint_dir is None:
            ray.train.report(metrics)
        else:
            ray.train.report(
                metrics, checkpoint=Checkpoint.from_directory(checkpoint_dir), checkpoint_dir_name=name
            )
