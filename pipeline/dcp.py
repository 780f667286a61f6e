"""A training checkpoint as files: its layout on storage, and its model read back without trusting it.

Training writes checkpoints (`pipeline.train.checkpointing.checkpoint`, collectively, with the optimizer); the
embedding job and the other jobs downstream read the model part of one (`load_model_state`, in one
process without a process group). Both sides share this module, so neither imports the other.

    <run>/checkpoint_00001000/  __<rank>_0.distcp (each rank's shards), .metadata (DCP's global layout,
                                written last), train_state.json (step, data position, RNG), config.json

A directory counts only once `.metadata`, `train_state.json`, `config.json` and every shard file the
metadata names are there whole; `latest_complete` skips anything else (a crash mid-save, or mid-upload,
leaves an ignorable directory).

DCP's `.metadata` is a pickle. It is read through `MetadataUnpickler`, which admits only the exact
classes checkpoint metadata holds, never torch's own unpickler (`safe_reader`). DCP reads a non-tensor
entry with ``torch.load(weights_only=False)``: the model read takes tensors only, and a training resume,
which needs the optimizer's plain values (learning rates, betas), reads them as plain data only
(`plain_data_planner`).
"""

from __future__ import annotations

import importlib
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch

import vit
from pipeline import compat, storage
from vit.weights import check_shapes

TRAIN_STATE = "train_state.json"
CONFIG = "config.json"
METADATA = ".metadata"  # written by DCP, last


class CheckpointRefusedError(ValueError):
    """A checkpoint this run must not read: it holds something that reading would execute, or the
    state of another model, objective or optimizer; the message is one line."""


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def is_complete(directory: storage.Location | str | Path) -> bool:
    """True once a checkpoint directory (local or URL) holds its `.metadata`, `train_state.json` and
    `config.json` (those two readable JSON) and every shard file the metadata names, each as long as the
    metadata says. Rank 0 writes the first three, so they alone do not show that the other ranks'
    `__<rank>_0.distcp` files arrived; a copy into storage cut short (a killed upload to a local or
    mounted `--out` writes files in place) leaves files that exist but are short. Metadata cut short
    makes the directory incomplete; metadata naming what `MetadataUnpickler` refuses was written to run
    code, not cut short, and raises `CheckpointRefusedError` (one line) rather than being passed over."""
    fs, path = storage.filesystem(directory)
    fs.invalidate_cache(path)  # a listing cached before the last rank's upload would hide its file
    try:
        entries = fs.ls(path, detail=True)
        sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") or 0 for e in entries}
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not {METADATA, TRAIN_STATE, CONFIG} <= set(sizes):
        return False
    try:
        for name in (TRAIN_STATE, CONFIG):
            json.loads(fs.cat_file(f"{path}/{name}"))
        with fs.open(f"{path}/{METADATA}", "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
        ends: dict[str, int] = {}  # shard file -> the end of its last entry
        for info in (metadata.storage_data or {}).values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except RefusedName as e:
        raise CheckpointRefusedError(
            f"checkpoint {directory}: {e}; remove that checkpoint directory (an earlier one is then used)"
        ) from e
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError):  # JSONDecodeError too
        return False
    return all(name in sizes and sizes[name] >= end for name, end in ends.items())


def latest_complete(run_dir: storage.Location | str | Path) -> storage.Location | None:
    """The complete ``checkpoint_<step>`` with the highest step under a run directory, or None."""
    run_dir = storage.as_location(run_dir)
    fs, root = run_dir.fs()
    if not fs.isdir(root):
        return None
    names = sorted((p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)), reverse=True)
    for name in names:
        if name.startswith("checkpoint_") and is_complete(run_dir.join(name)):
            return run_dir.join(name)
    return None


class RefusedName(pickle.UnpicklingError):
    """A pickle names a class or function outside `MetadataUnpickler.NAMES`."""


class MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP metadata holds, as exact ``(module, name)`` pairs: DCP's own dataclasses,
    torch.Size, dtypes, layouts and paths. Never a whole module and never a dotted name: with pickle
    protocol 4 a name like ``os.system`` would be resolved through an allowed module's own imports."""

    NAMES: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",  # admitted to read the layout; `load_model_state` reads no such entry
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        }
        | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
        | {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
        | {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
        | {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.NAMES:
            raise RefusedName(f"checkpoint metadata refers to {module}.{name}; refusing to unpickle it")
        # A plain getattr: the base class would walk a dotted ``name`` attribute by attribute.
        return getattr(importlib.import_module(module), name)


def load_model_state(
    directory: storage.Location | str, config: vit.ViTConfig, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The model part of a DCP checkpoint as a full CPU state dict; one process, no process group.
    ``prefix``: where the ViT sits in the trained module (``encoder.`` in a masked autoencoder).

    ``config`` (the checkpoint's config.json) is checked against the tensor sizes in the metadata before
    the model is allocated: a config that claims a larger model than the checkpoint holds is refused in
    one line, never built."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(safe_reader(directory), directory)
    head = f"model.{prefix}"
    try:
        entries = {n: e for n, e in metadata.state_dict_metadata.items() if n.startswith(head)}
        _refuse_non_tensors(directory, metadata, list(entries))
        shapes = {
            n[len(head) :]: tuple(e.size) for n, e in entries.items() if isinstance(e, TensorStorageMetadata)
        }
    except (AttributeError, TypeError) as e:
        raise ValueError(f"--weights {directory}: its {METADATA} is damaged ({e})") from e
    check_shapes(shapes, config, f"--weights {directory}")
    model = vit.VisionTransformer(config, device="meta").to_empty(device="cpu")
    return load_module_state(directory, model, prefix)


def _read_metadata(reader: Any, directory: storage.Location | str) -> Any:
    try:
        return reader.read_metadata()  # on its own: DCP would bury a refusal in its own exception
    except (pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"--weights {directory}: {e or 'its ' + METADATA + ' is cut short'}") from e


def load_module_state(
    directory: storage.Location | str, module: torch.nn.Module, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The entries ``model.<prefix><name>`` of a DCP checkpoint for every ``name`` of ``module``'s state
    dict, as a CPU state dict under ``module``'s names (``module`` gives the shapes: build it on CPU)."""
    import torch.distributed.checkpoint as dcp

    reader = safe_reader(directory)
    metadata = _read_metadata(reader, directory)
    # Only the model: the optimizer's tensors are never read.
    state = {"model": {prefix + name: value for name, value in module.state_dict().items()}}
    _refuse_non_tensors(directory, metadata, [f"model.{name}" for name in state["model"]])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=reader, planner=_tensors_only_planner(), no_dist=True)
        except Exception as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise ValueError(
                f"--weights {directory} does not hold this model's weights ({type(e).__name__}: {first}); "
                "is it a complete checkpoint of the model its config.json names?"
            ) from e
    return {name[len(prefix) :]: value for name, value in state["model"].items()}


def _refuse_non_tensors(directory: storage.Location | str, metadata: Any, names: list[str]) -> None:
    """DCP reads a non-tensor entry with ``torch.load(weights_only=False)``, which runs whatever the
    entry's pickle says: every entry this load reads must be a tensor (other entries are never read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for name in names:
        entry = metadata.state_dict_metadata.get(name)
        if entry is not None and not isinstance(entry, TensorStorageMetadata):
            raise ValueError(
                f"--weights {directory}: checkpoint entry {name} is not a tensor ({type(entry).__name__}); "
                "refusing to read it, since reading it would unpickle code: use a checkpoint written by vitray"
            )


def _tensors_only_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnlyPlanner(DefaultLoadPlanner):
        # A second lock on the same door: DCP's own byte path would unpickle with weights_only=False.
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise ValueError(
                f"checkpoint entry {read_item.dest_index.fqn} is not a tensor; refusing to read it"
            )

    return TensorsOnlyPlanner()


def safe_reader(directory: storage.Location | str) -> Any:
    """A DCP storage reader for a checkpoint directory (local or URL) whose ``.metadata`` goes through
    `MetadataUnpickler`."""
    import torch.distributed.checkpoint as dcp

    directory = storage.as_location(directory)
    if directory.is_local:
        return _safe_reader(dcp.FileSystemReader)(directory.local_path)
    return _safe_reader(compat.fsspec_checkpoint_reader())(directory.url, **directory.options)


def plain_data_planner() -> Any:
    """A DCP load planner whose non-tensor entries must unpickle with ``torch.load(weights_only=True)``
    (numbers, strings, containers), else `CheckpointRefusedError`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainDataPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            data = value.read()
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as e:
                raise CheckpointRefusedError(
                    f"checkpoint entry {read_item.dest_index.fqn} is not plain data; refusing to unpickle it"
                ) from e
            # The same bytes passed the restricted load just above, so DCP's own (unrestricted) load of
            # them runs no code; it stays the one that puts the value in place.
            super().load_bytes(read_item, io.BytesIO(data))

    return PlainDataPlanner()


def _safe_reader(base: type) -> type:
    """``base`` (a DCP FileSystemReader) whose metadata goes through `MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(base):
        # The body of FileSystemReader.read_metadata, with the restricted unpickler instead of pickle.load.
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = compat.dcp_metadata_path(self, kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader
