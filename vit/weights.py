"""vitray's export format: a directory holding ``weights.safetensors`` and ``config.json``.

``config.json`` is ``{"format": "vitray", "model": <ViTConfig.to_dict()>, "preprocessing": {...},
...extra}``; the extra keys (a training summary, say) are the caller's. The weights hold the input
normalization as buffers (``patch_embed.mean`` / ``patch_embed.std``), so a model loaded from them
normalizes uint8 patches exactly as it was trained to. Directories may be local paths or fsspec
URLs (``s3://``, ``gs://``); remote files go through a local temporary copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from vit.config import ARCHITECTURE_FIELDS, ViTConfig
from vit.convert import config_from_state_dict
from vit.model import VisionTransformer

WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "vitray"
HEAD_FIELDS = ("head", "num_classes", "representation_size")


def preprocessing(config: ViTConfig) -> dict[str, Any]:
    """What a model expects as input, recorded beside its weights."""
    return {
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "num_channels": config.num_channels,
        "mean": list(config.mean),
        "std": list(config.std),
        "input": "uint8 patches (B, N, P*P*C): grid row-major, pixels row-major, channels innermost "
        "(the model normalizes them); or float images (B, C, H, W) already normalized with mean/std",
    }


def save_pretrained(
    directory: str | os.PathLike,
    state_dict: dict[str, torch.Tensor],
    config: ViTConfig,
    extra: dict | None = None,
) -> str:
    """Write ``weights.safetensors`` + ``config.json`` into ``directory``; returns the directory.

    ``state_dict`` is a plain (full, unsharded) state dict of the model `config` describes; a state
    dict that does not fit the config is an error, so an export can always be loaded back.
    """
    extra = dict(extra or {})
    clash = sorted(set(extra) & {"format", "model"})
    if clash:
        raise ValueError(f"extra metadata may not use the reserved keys {clash}")
    from safetensors.torch import save_file  # here, so that `import vit` needs torch alone

    check_weights(state_dict, config, "the state dict")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    meta = {"format": FORMAT, "model": config.to_dict(), "preprocessing": preprocessing(config), **extra}
    with _local_dir(directory, write=True) as local:
        # Weights first, config last (a config.json present means the export is complete), each under a
        # temporary name and renamed, so a reader never sees a half-written file.
        tmp = _temporary_name(local / WEIGHTS_FILE)
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, local / WEIGHTS_FILE)
        tmp = _temporary_name(local / CONFIG_FILE)
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, local / CONFIG_FILE)
    return str(directory)


def load_config(path: str | os.PathLike) -> tuple[ViTConfig, dict[str, Any]]:
    """The ViTConfig of an export (its directory, or either file in it), and the whole config.json."""
    with _local_dir(_export_dir(path), files=(CONFIG_FILE,)) as local:
        file = local / CONFIG_FILE
        if not file.exists():
            raise FileNotFoundError(
                f"no {CONFIG_FILE} in {_export_dir(path)}; is it a vitray export directory?"
            )
        meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT or "model" not in meta:
        raise ValueError(
            f"{CONFIG_FILE} in {_export_dir(path)} is not a vitray export (no format/model keys)"
        )
    return ViTConfig.from_dict(meta["model"]), meta


def load_pretrained(
    path: str | os.PathLike,
    map_location: torch.device | str = "cpu",
    *,
    as_state_dict: bool = False,
    **overrides: Any,
) -> tuple[VisionTransformer | dict[str, torch.Tensor], ViTConfig]:
    """Load an export: ``(model, config)``, or ``(state_dict, config)`` with ``as_state_dict=True``.

    ``overrides`` replace config fields of the model: another ``image_size`` resamples the position
    embeddings; another head (``head``, ``num_classes``, ``representation_size``) starts freshly
    initialized, e.g. ``load_pretrained(d, head="finetune", num_classes=10)`` for fine-tuning.
    The model is built on the meta device and takes the loaded tensors without copying them.
    """
    from safetensors.torch import load_file

    config, _ = load_config(path)
    with _local_dir(_export_dir(path), files=(WEIGHTS_FILE,)) as local:
        file = local / WEIGHTS_FILE
        if not file.exists():
            raise FileNotFoundError(f"no {WEIGHTS_FILE} in {_export_dir(path)}")
        state_dict = load_file(file, device=str(map_location))
    check_weights(state_dict, config, WEIGHTS_FILE)
    if as_state_dict:
        if overrides:
            raise ValueError("overrides apply to a model; load with as_state_dict=False to use them")
        return state_dict, config

    if {"mean", "std"} & set(overrides):
        raise ValueError(
            "mean/std are part of the weights (the model's input layer); they cannot be overridden"
        )
    new_config = config.replace(**overrides)
    new_head = any(getattr(new_config, f) != getattr(config, f) for f in HEAD_FIELDS)
    if new_head:
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("head.")}
    model = VisionTransformer(new_config, device="meta")
    model.load_state_dict(state_dict, strict=not new_head, assign=True)
    if new_head:
        model.head.to_empty(device=map_location)
        model.head.reset_parameters()
    return model, new_config


def check_weights(state_dict: dict[str, torch.Tensor], config: ViTConfig, what: str) -> None:
    """Raise a one-line ValueError when ``state_dict`` is not a state dict of the model ``config`` describes."""
    expected = {k: tuple(v.shape) for k, v in VisionTransformer(config, device="meta").state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    if got != expected:
        try:
            inferred = config_from_state_dict(state_dict)
        except (ValueError, KeyError, IndexError):
            inferred = None
        if inferred is not None:
            for field in (*ARCHITECTURE_FIELDS, "image_size", "head", "pre_logits_dim", "num_classes"):
                have, want = getattr(inferred, field), getattr(config, field)
                if have != want:
                    raise ValueError(
                        f"{what} holds a ViT with {field} {have}, the config says {want}: they come from "
                        "different models; export weights and config together with save_pretrained"
                    )
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        shapes = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(
            f"{what} does not fit the config {config.name}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, other shapes {shapes[:3]}"
        )
    for name in ("mean", "std"):
        buffer = state_dict[f"patch_embed.{name}"]
        have = buffer.float().cpu()
        # Within the buffer's own precision (an export may hold bf16 tensors).
        if not torch.allclose(have, torch.tensor(getattr(config, name)), atol=torch.finfo(buffer.dtype).eps):
            raise ValueError(
                f"{what} normalizes inputs with {name} {have.tolist()}, the config says "
                f"{list(getattr(config, name))}: they come from different models"
            )


def _temporary_name(path: Path) -> Path:
    # The scheme of `pipeline.storage.temporary_name` (vit/ imports nothing from pipeline/): hidden, unique
    # per writer, recognized as uncommitted by the jobs that list output directories.
    return path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"


def _export_dir(path: str | os.PathLike) -> str:
    path = str(path)
    return path.rsplit("/", 1)[0] if path.endswith((WEIGHTS_FILE, CONFIG_FILE)) else path.rstrip("/")


@contextmanager
def _local_dir(
    directory: str | os.PathLike, write: bool = False, files: tuple[str, ...] = ()
) -> Iterator[Path]:
    """A local directory standing for ``directory``: itself, or a temporary copy for an fsspec URL."""
    directory = str(directory)
    if "://" not in directory or directory.startswith("file://"):
        local = Path(directory.removeprefix("file://"))
        if write:
            local.mkdir(parents=True, exist_ok=True)
        yield local
        return
    import fsspec  # only for remote exports

    fs, root = fsspec.core.url_to_fs(directory)
    tmp = Path(tempfile.mkdtemp(prefix="vitray-export-"))
    try:
        for name in files:
            if fs.exists(f"{root}/{name}"):
                fs.get_file(f"{root}/{name}", str(tmp / name))
        yield tmp
        if write:
            fs.makedirs(root, exist_ok=True)
            # Weights first: a config.json present means the export is complete.
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                fs.put_file(str(tmp / name), f"{root}/{name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
