"""vitray's export format: a directory holding ``weights.safetensors`` and ``config.json``.

``config.json`` is ``{"format": "vitray", "model": <ViTConfig.to_dict()>, "preprocessing": {...},
...extra}``; the extra keys (a training summary, say) are the caller's. The weights hold the input
normalization as buffers (``patch_embed.mean`` / ``patch_embed.std``), so a model loaded from them
normalizes uint8 patches exactly as it was trained to. vit reads and writes local directories only:
putting an export on an object store, or reading one from there, is `pipeline.storage`'s (a staged
local copy; `pipeline.model_source.load_model_source` reads any --weights so).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from vit.config import ARCHITECTURE_FIELDS, ViTConfig
from vit.convert import block_indices, config_from_state_dict
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
    """Write ``weights.safetensors`` + ``config.json`` into the local ``directory``; returns the directory.

    ``state_dict`` is a plain (full, unsharded) state dict of the model `config` describes; a state
    dict that does not fit the config is an error, so an export can always be loaded back. The weights
    are written first and config.json last (a config.json present means the export is complete); a
    caller whose readers must never see a file half-written writes into a staging directory and moves
    it in whole (the training run's export: `pipeline.storage.upload_dir`).
    """
    extra = dict(extra or {})
    clash = sorted(set(extra) & {"format", "model"})
    if clash:
        raise ValueError(f"extra metadata may not use the reserved keys {clash}")
    from safetensors.torch import save_file  # here, so that `import vit` needs torch alone

    check_weights(state_dict, config, "the state dict")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    meta = {"format": FORMAT, "model": config.to_dict(), "preprocessing": preprocessing(config), **extra}
    local = _local(directory)
    local.mkdir(parents=True, exist_ok=True)
    save_file(tensors, local / WEIGHTS_FILE, metadata={"format": "pt"})
    (local / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return str(directory)


def load_config(path: str | os.PathLike, *, shown_as: str | None = None) -> tuple[ViTConfig, dict[str, Any]]:
    """The ViTConfig of a local export (its directory, or either file in it), and the whole config.json.
    ``shown_as`` names the export in messages (the URL a staged copy came from); default: its path."""
    name = shown_as or _export_dir(path)
    file = _local(_export_dir(path)) / CONFIG_FILE
    if not file.exists():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {name}; is it a vitray export directory?")
    try:
        meta = json.loads(file.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{CONFIG_FILE} in {name} is not JSON: {_first_line(e)}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "model" not in meta:
        raise ValueError(f"{CONFIG_FILE} in {name} is not a vitray export (no format/model keys)")
    try:
        return ViTConfig.from_dict(meta["model"]), meta
    except ValueError as e:
        raise ValueError(f"{CONFIG_FILE} in {name}: {e}") from e


def load_pretrained(
    path: str | os.PathLike,
    map_location: torch.device | str = "cpu",
    *,
    as_state_dict: bool = False,
    shown_as: str | None = None,
    **overrides: Any,
) -> tuple[VisionTransformer | dict[str, torch.Tensor], ViTConfig]:
    """Load a local export: ``(model, config)``, or ``(state_dict, config)`` with ``as_state_dict=True``;
    ``shown_as`` names it in messages (as `load_config`).

    ``overrides`` replace config fields of the model: another ``image_size`` resamples the position
    embeddings; another head (``head``, ``num_classes``, ``representation_size``) starts freshly
    initialized, e.g. ``load_pretrained(d, head="finetune", num_classes=10)`` for fine-tuning.
    The model is built on the meta device and takes the loaded tensors without copying them.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, _ = load_config(path, shown_as=shown_as)
    name = shown_as or _export_dir(path)
    file = _local(_export_dir(path)) / WEIGHTS_FILE
    if not file.exists():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {name}")
    # The header first: the config is checked against the file's own shapes before any data is read or
    # any model of the config's size is built.
    with open(file, "rb") as stream:
        shapes = read_header(stream, file.stat().st_size, f"{WEIGHTS_FILE} in {name}")
    check_shapes(shapes, config, WEIGHTS_FILE)
    try:
        state_dict = load_file(file, device=str(map_location))
    except SafetensorError as e:
        raise ValueError(f"{WEIGHTS_FILE} in {name} is not readable: {_first_line(e)}") from e
    check_weights(state_dict, config, WEIGHTS_FILE)
    check_values(state_dict, f"{WEIGHTS_FILE} in {name}")
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
    check_shapes({k: v.shape for k, v in state_dict.items()}, config, what)
    for name in ("mean", "std"):
        buffer = state_dict[f"patch_embed.{name}"]
        have = buffer.float().cpu()
        # Within the buffer's own precision (an export may hold bf16 tensors).
        if not torch.allclose(have, torch.tensor(getattr(config, name)), atol=torch.finfo(buffer.dtype).eps):
            raise ValueError(
                f"{what} normalizes inputs with {name} {have.tolist()}, the config says "
                f"{list(getattr(config, name))}: they come from different models"
            )


def check_shapes(shapes: Mapping[str, Sequence[int]], config: ViTConfig, what: str) -> None:
    """Raise a one-line ValueError unless tensors of these shapes (name -> shape: a safetensors header,
    a checkpoint's metadata, a state dict) are the state dict of the model ``config`` describes.

    Shapes alone decide, so this runs before any data is read. The depth is compared first, from the
    names: a config that claims more blocks than the weights hold is refused before anything of its size
    is built, and the model built last (on the meta device, for the exact names) is never deeper than
    the weights.
    """
    try:
        depth = len(block_indices(shapes))
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e
    try:
        meta = {k: torch.empty(tuple(v), device="meta") for k, v in shapes.items()}
        inferred = config_from_state_dict(meta, num_heads=1)  # no shape tells the number of heads
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError):
        inferred = None  # not a ViT's shapes: the names compared below say what is off
    for field in ("depth", *ARCHITECTURE_FIELDS, "image_size", "head", "pre_logits_dim", "num_classes"):
        if inferred is None and field != "depth":
            break
        have, want = depth if field == "depth" else getattr(inferred, field), getattr(config, field)
        if have != want:
            raise ValueError(
                f"{what} holds a ViT with {field} {have}, the config says {want}: they come from "
                "different models; export weights and config together with save_pretrained"
            )
    try:
        expected = {
            k: tuple(v.shape) for k, v in VisionTransformer(config, device="meta").state_dict().items()
        }
    except (RuntimeError, OverflowError) as e:  # sizes beyond any tensor: no file holds such weights
        raise ValueError(f"{what} cannot hold the model its config describes: {_first_line(e)}") from e
    got = {k: tuple(v) for k, v in shapes.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        other = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(
            f"{what} does not fit the config {config.name}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, other shapes {other[:3]}"
        )


def check_values(state_dict: dict[str, torch.Tensor], what: str) -> None:
    """Raise a one-line ValueError unless every tensor is floating point and finite: NaN or infinite
    weights give NaN embeddings for every image."""
    for name, tensor in state_dict.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{what}: tensor {name!r} is {tensor.dtype}; a ViT's weights are floating point")
        finite = torch.isfinite(tensor)
        if not finite.all():
            raise ValueError(
                f"{what}: tensor {name!r} holds {int((~finite).sum())} value(s) that are NaN or infinite; "
                "a run that diverged leaves such weights: use a checkpoint from before it diverged"
            )


# Bits per element of each safetensors dtype (the format's own list).
SAFETENSORS_BITS = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"), 8),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 16),
    **dict.fromkeys(("I32", "U32", "F32"), 32),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 64),
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def read_header(stream: BinaryIO, size: int, what: str) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a safetensors file of ``size`` bytes, from its header alone (no tensor data
    is read); a one-line ValueError when the header is damaged or promises more than the file holds."""
    damaged = f"{what} is damaged or not a safetensors file"
    if size < 8:
        raise ValueError(f"{damaged}: {size} byte(s), fewer than a header's length field")
    length = int.from_bytes(stream.read(8), "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"{damaged}: its header claims {length} bytes, the file holds {size - 8} after it")
    try:
        header = json.loads(stream.read(length))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{damaged}: its header is not JSON ({_first_line(e)})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{damaged}: its header is not a JSON object")
    data = size - 8 - length
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{damaged}: tensor {name!r} has no dtype, shape and data_offsets") from None
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
            raise ValueError(f"{damaged}: tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{damaged}: tensor {name!r} has the shape {shape!r}")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= data):
            raise ValueError(
                f"{damaged}: tensor {name!r} has data_offsets {[begin, end]!r}, outside the {data} bytes of data"
            )
        if math.prod(shape) * SAFETENSORS_BITS[dtype] != 8 * (end - begin):
            raise ValueError(
                f"{damaged}: tensor {name!r} of shape {shape} and dtype {dtype} has {end - begin} bytes of data"
            )
        shapes[name] = tuple(shape)
    return shapes


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _export_dir(path: str | os.PathLike) -> str:
    path = str(path)
    return path.rsplit("/", 1)[0] if path.endswith((WEIGHTS_FILE, CONFIG_FILE)) else path.rstrip("/")


def _local(directory: str | os.PathLike) -> Path:
    """``directory`` as a local path; a URL is refused in one line (staging it is pipeline.storage's)."""
    text = str(directory)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"{text} is not a local directory: vit reads and writes local exports only; stage a remote one "
            "with pipeline.storage (load_model_source reads any --weights)"
        )
    return Path(text.removeprefix("file://"))
