"""This worker's link to Ray Train, behind the few calls the worker loop makes (`pipeline.train.loop`
runs with any object that has them: the tests use an in-process one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
from ray.train import Checkpoint, CheckpointUploadMode

from pipeline import storage


class RaySession:
    """This worker's link to Ray Train: who it is, the checkpoint to resume from, where reports go
    (``run_dir``, the run directory with the job's storage options)."""

    def __init__(self, run_dir: storage.Location) -> None:
        self.run_dir = run_dir
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

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: str | None = None,
        name: str = "",
        written: Future | None = None,
        validation: bool = False,
    ) -> Future | None:
        """Collective: hand metrics (and this rank's part of a checkpoint) to Ray Train; with ``validation``,
        Ray Train probes the checkpoint once registered (`pipeline.train.scoring.probe`).

        Without ``written`` the checkpoint is uploaded before this returns. With it (a future that
        completes once DCP has written ``checkpoint_dir`` whole, `pipeline.train.checkpointing.saver`), the upload
        waits for it in Ray Train's upload thread, beside training, and this returns a future that
        completes once this rank's files are in storage (or fails with the upload's error); the caller
        removes ``checkpoint_dir`` after that. Ray Train registers the checkpoint once every rank's
        upload is in, in the order of the reports. Reports without a checkpoint never wait for an
        upload in flight (Ray Train queues them behind it).
        """
        if checkpoint_dir is None:
            ray.train.report(metrics, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
            return None
        store = ray.train.get_context().get_storage()
        if written is None:
            # On object stores the files go through `storage.upload_dir`, each checked once uploaded:
            # Ray Train's own copy (pyarrow's copy_files) can drop a file whose S3 part upload failed
            # three times and report success, registering a checkpoint that cannot be resumed from.
            remote = not self.run_dir.is_local
            ray.train.report(
                metrics,
                checkpoint=Checkpoint.from_directory(checkpoint_dir),
                checkpoint_dir_name=name,
                checkpoint_upload_fn=partial(upload_checked, store, self.run_dir) if remote else None,
                validation=validation,
            )
            return None
        uploaded: Future = Future()
        ray.train.report(
            metrics,
            checkpoint=Checkpoint.from_directory(checkpoint_dir),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=False,
            checkpoint_upload_fn=partial(upload_when_written, written, uploaded, store, self.run_dir),
            validation=validation,
        )
        return uploaded


def upload_when_written(
    written: Future,
    uploaded: Future,
    store: Any,
    run_dir: storage.Location,
    checkpoint: Checkpoint,
    name: str,
) -> Checkpoint:
    """In Ray Train's upload thread: wait until DCP has written the checkpoint, then `upload_checked` it
    (into a local run directory too: each file replaced whole); ``uploaded`` says how it went."""
    try:
        written.result()
        persisted = upload_checked(store, run_dir, checkpoint, name)
    except BaseException as e:
        if not uploaded.done():
            uploaded.set_exception(e)
        raise
    if not uploaded.done():
        uploaded.set_result(None)
    return persisted


def upload_checked(store: Any, run_dir: storage.Location, checkpoint: Checkpoint, name: str) -> Checkpoint:
    """This rank's checkpoint files into `name` under the run directory, every file checked; the
    checkpoint there as Ray Train registers it, in its storage (StorageContext `store`, whose experiment
    directory is the run directory: `pipeline.train.driver.ray_storage`)."""
    storage.upload_dir(checkpoint.path, run_dir.join(name))
    return Checkpoint(
        path=f"{store.experiment_fs_path.rstrip('/')}/{name}", filesystem=store.storage_filesystem
    )
