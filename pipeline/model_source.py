"""What ``--weights`` resolves to, for every job that takes a trained model: resolved, loaded, checked, fingerprinted.

Accepted, told apart by what the path holds (or named with ``weights_format``):

- a vitray export: a directory with ``weights.safetensors`` + ``config.json`` (a run's ``final/``),
  or a run directory, which means its ``final/``;
- a vitray DCP checkpoint: a ``checkpoint_*`` directory, or a run directory without ``final/``, which
  means its latest complete checkpoint. Only the model part is read, never the optimizer, in one
  process without a process group;
- timm / torchvision / transformers ("hf") weights: a ``.safetensors`` / ``.pth`` / ``.pt`` / ``.bin``
  file, a transformers model directory (``config.json`` + ``model.safetensors``; the mean/std of its
  ``preprocessor_config.json``), or a timm one (a ``config.json`` that names an ``architecture``, as
  `jobs/export.py` writes: heads, pooling and mean/std from it), converted with
  `vit.convert_state_dict`. ``model`` names the variant where shapes cannot tell the head count.

Nothing untrusted is unpickled: ``torch.load(weights_only=True)`` for ``.pth`` / ``.bin``, and DCP's
``.metadata`` (a pickle) goes through an unpickler that admits only checkpoint metadata classes.
Every mismatch between weights and ``model`` is a one-line ValueError, raised before any shard is read.

The fingerprint, ``sha256``, is over the state dict as the model runs it (float32, keys sorted: name,
dtype, shape and bytes of each tensor), so the same weights give the same hash from any source format.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

import vit
from pipeline import dcp, storage
from pipeline.data.config import DataConfig
from pipeline.settings import Settings, setting
from vit.weights import CONFIG_FILE, WEIGHTS_FILE, check_shapes, check_values, check_weights, read_header
from vit.weights import preprocessing as model_input

FORMATS = ("auto", "vitray", "timm", "torchvision", "hf")
FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HF_PREPROCESSOR = "preprocessor_config.json"  # a transformers folder's image processor: its mean/std


@dataclass(frozen=True, kw_only=True)
class Weights(Settings):
    """The section of a job's config that names a trained model (`pipeline.settings`; taken by
    inheriting it): ``--weights``, ``--weights-format``, ``--model``, which `load_model_source` takes."""

    weights: str = setting(
        help="run dir, final/ export, checkpoint_* dir, HF dir or weights file", required=True
    )
    weights_format: str = setting(
        "auto", "what --weights holds (auto: told from the files and their keys)", choices=FORMATS
    )
    model: str | None = setting(
        None, "variant name (e.g. vit_b16): checked against the weights; needed where shapes can't tell heads"
    )


@dataclass
class ModelSource:
    """Loaded weights, ready to ship: the config they run with, a float32 CPU state dict, its sha256."""

    config: vit.ViTConfig
    state_dict: dict[str, torch.Tensor]
    sha256: str
    kind: str  # "export", "checkpoint", "timm", "torchvision" or "hf"
    path: str  # the directory or file actually read (a run dir resolves to final/ or a checkpoint)
    preprocessing: dict[str, Any] | None = None  # the training DataConfig dict, where the weights carry it

    def describe(self) -> str:
        return f"{self.config.name} ({self.kind}: {self.path}, sha256 {self.sha256[:12]})"

    def model(self, device: torch.device | str, **options: Any) -> vit.VisionTransformer:
        """`inference_model` of these weights (``options``: its ``dtype`` and ``compile``)."""
        return inference_model(self.config, self.state_dict, device, **options)

    def eval_data(
        self, transform: Any = None, *, preprocessing: dict[str, Any] | None = None, **fields: Any
    ) -> DataConfig:
        """The model's evaluation transform, the one way a job that runs these weights gets it
        (`DataConfig.for_eval`): over the preprocessing the weights carry, or ``preprocessing`` (another
        record of it, an embedding output's say; ``{}``: the defaults), at the model's image and patch size;
        ``transform`` (an `EvalOverrides`) and ``fields`` as `DataConfig.for_eval` takes them."""
        return DataConfig.for_eval(
            self.preprocessing if preprocessing is None else preprocessing,
            image_size=self.config.image_size,
            patch_size=self.config.patch_size,
            transform=transform,
            **fields,
        )


def load_model_source(
    weights: storage.Location | str,
    *,
    weights_format: str = "auto",
    model: str | None = None,
    image_size: int | None = None,
) -> ModelSource:
    """Resolve and load ``--weights`` (a path or URL, or a `pipeline.storage.Location` with the job's
    storage options); ``image_size`` runs the model at another resolution (the position embeddings
    are resampled as they load). Raises a one-line ValueError on anything wrong."""
    if weights_format not in FORMATS:
        raise ValueError(f"unknown --weights-format {weights_format!r}; choose one of {', '.join(FORMATS)}")
    named = vit.get_config(model) if model else None  # an unknown name fails here, in one line
    weights = storage.as_location(weights)
    path = weights.url.rstrip("/") or weights.url
    kind, where = _resolve(weights.at(path), weights_format)
    preprocessing = None
    if kind == "export":
        # vit reads local files only: a remote export is fetched into a local copy, with the job's options.
        with storage.local_copy(where, (CONFIG_FILE, WEIGHTS_FILE)) as local:
            config, meta = vit.load_config(local, shown_as=where.url)
            preprocessing = _data_config_dict(meta.get("preprocessing"), config, where.join(CONFIG_FILE))
            if named is not None:
                _check_named(config, named, path)
            state_dict, config = vit.load_pretrained(local, as_state_dict=True, shown_as=where.url)
    elif kind == "checkpoint":
        saved = _read_json(where.join(CONFIG_FILE))
        if not isinstance(saved, dict) or "model_config" not in saved:
            raise ValueError(f"{where}/{CONFIG_FILE} has no model_config; is it a vitray checkpoint?")
        try:
            config = vit.ViTConfig.from_dict(saved["model_config"])
        except ValueError as e:
            raise ValueError(f"{where}/{CONFIG_FILE}: {e}") from e
        preprocessing = _data_config_dict(saved.get("data"), config, where.join(CONFIG_FILE))
        if named is not None:
            _check_named(config, named, path)
        # A masked autoencoder's checkpoint holds the ViT as its encoder (the decoder is not read).
        prefix = "encoder." if saved.get("objective") == "mae" else ""
        state_dict = dcp.load_model_state(where, config, prefix)
    else:
        state_dict, config, kind = _load_converted(where, kind, named, path)
    check_weights(state_dict, config, f"--weights {path}")
    if kind != "export":  # an export's values were checked as it loaded
        check_values(state_dict, f"--weights {path}")
    state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
    if image_size is not None and image_size != config.image_size:
        config = config.replace(image_size=image_size)  # validates divisibility by the patch size
    return ModelSource(config, state_dict, state_dict_sha256(state_dict), kind, where.url, preprocessing)


def inference_model(
    config: vit.ViTConfig,
    state_dict: dict[str, torch.Tensor],
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float32,
    compile: bool | str = False,
) -> vit.VisionTransformer:
    """The model for inference, built in this one place for every job that runs a trained model (the
    embedding job's actors, the search job's image query, the analyze job): in eval mode, no gradients,
    on ``device`` with weights in ``dtype``, taking the given tensors without a copy on CPU in float32.
    ``compile``: compile ``model.embed`` (True: inductor; a string names another torch.compile backend)."""
    model = vit.VisionTransformer(config, device="meta")
    model.load_state_dict(state_dict, assign=True)  # resamples pos_embed for another image_size
    # The input normalization constants stay float32: uint8 patches are scaled in float32, then cast.
    model = model.to(device).eval().requires_grad_(False)
    if dtype != torch.float32:
        for path, module in model.named_modules():
            if path.startswith("patch_embed.backbone"):
                continue  # a hybrid's ResNet takes the float32 image; its output is cast for the projection
            for name, param in module.named_parameters(recurse=False):
                setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))
    if compile:
        model.embed = torch.compile(model.embed, backend="inductor" if compile is True else compile)
    return model


def state_dict_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, keys sorted."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        tensor = tensor.contiguous().reshape(-1)
        digest.update(tensor.view(torch.uint8).numpy().data if tensor.numel() else b"")
    return digest.hexdigest()


def pack_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Numpy arrays for the object store: read back on the same node without a copy (float32 only)."""
    return {k: v.detach().cpu().numpy() for k, v in state_dict.items()}


def unpack_state_dict(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Tensors sharing the arrays' memory; arrays from the object store are read-only, which is fine
    for inference (nothing writes to the weights) and lets every actor of a node share one copy."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: torch.from_numpy(v) for k, v in arrays.items()}


# --- resolving a path ----------------------------------------------------------------------------


def _resolve(weights: storage.Location, weights_format: str) -> tuple[str, storage.Location]:
    """``(kind, location)`` of what ``weights`` holds; a one-line ValueError when it holds nothing usable."""
    path = weights.url
    fs, fs_path = weights.fs()
    if not fs.exists(fs_path):
        raise ValueError(
            f"--weights {path} does not exist; pass an export, run, checkpoint dir or weights file"
        )
    if not fs.isdir(fs_path):
        if path.endswith((WEIGHTS_FILE, CONFIG_FILE)) and weights_format in ("auto", "vitray"):
            return "export", weights.at(path.rsplit("/", 1)[0])
        if not path.endswith(FILE_SUFFIXES):
            raise ValueError(
                f"--weights {path} is a file but not {'/'.join(FILE_SUFFIXES)}; pass a weights file or a directory"
            )
        if weights_format == "vitray":
            raise ValueError(f"--weights {path} is a single file; a vitray export is a directory (final/)")
        return (weights_format if weights_format != "auto" else "file"), weights
    names = set(storage.list_files(weights))
    if weights_format in ("timm", "torchvision"):
        raise ValueError(
            f"--weights {path} is a directory; {weights_format} weights are one file (.pth/.safetensors)"
        )
    if weights_format in ("auto", "hf") and CONFIG_FILE in names and names & set(HF_WEIGHT_FILES):
        hf_config = _read_json(weights.join(CONFIG_FILE))
        if not isinstance(hf_config, dict) or hf_config.get("format") != "vitray":
            if weights_format == "auto" and isinstance(hf_config, dict) and "architecture" in hf_config:
                return "timm", weights  # timm's folder format (timm.create_model("local-dir:DIR"))
            return "hf", weights
    if weights_format == "hf":
        raise ValueError(
            f"--weights {path} is not a transformers model directory (config.json + model.safetensors)"
        )
    if WEIGHTS_FILE in names and CONFIG_FILE in names:
        return "export", weights
    if dcp.METADATA in names:
        return "checkpoint", weights
    final = weights.join("final")
    if {WEIGHTS_FILE, CONFIG_FILE} <= set(storage.list_files(final)):
        return "export", final
    latest = dcp.latest_complete(weights)
    if latest is not None:
        return "checkpoint", latest
    if weights_format == "vitray":
        raise ValueError(
            f"--weights {path} holds no vitray export (weights.safetensors + config.json), final/ or complete "
            "checkpoint_*; pass a vitray run, its final/ or a checkpoint_* directory"
        )
    raise ValueError(
        f"--weights {path} holds no vitray export (weights.safetensors + config.json), final/, complete "
        "checkpoint_* or transformers model; pass one of those, or a .safetensors/.pth file"
    )


def _read_json(file: storage.Location) -> Any:
    try:
        return json.loads(storage.read_text(file))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--weights {file} is not JSON ({e})") from e


def _data_config_dict(values: Any, config: vit.ViTConfig, file: storage.Location) -> dict[str, Any] | None:
    """The training DataConfig dict that ``file`` holds as ``values``; None where it holds none, or holds
    the model's input description in its place (an export made outside training: `vit.weights`'s
    fields alone). A record that does not read as a DataConfig (a field unknown here, from a newer
    vitray or an edit; a value out of range) is a one-line ValueError naming the file and the field:
    embedding with the default crop in its place would give other embeddings, with no word."""
    if values is None or (isinstance(values, dict) and set(values) <= set(model_input(config))):
        return None
    if not isinstance(values, dict):
        raise ValueError(
            f"{file}: its preprocessing is a {type(values).__name__}, not a JSON object of settings"
        )
    try:
        DataConfig.from_dict(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: its preprocessing does not read: {e}") from e
    return values


def _check_named(config: vit.ViTConfig, named: vit.ViTConfig, path: str) -> None:
    """One line when the weights' shapes are not those of the variant named with --model."""
    have, want = config.architecture(), named.architecture()
    if have != want:
        like = next((v.name for v in vit.VARIANTS.values() if v.architecture() == have), None)
        changed = [f for f in have if have[f] != want[f]]
        diff = ", ".join(f"{f} {have[f]}" for f in changed)
        hint = f"pass --model {like}" if like else "drop --model to use the weights' own config"
        raise ValueError(
            f"--weights {path} hold a ViT with {diff}{f' (a {like})' if like else ''}, not {named.name} "
            f"({', '.join(f'{f} {want[f]}' for f in changed)}); {hint}, or other weights"
        )


# --- loading ---------------------------------------------------------------------------------------


def _load_converted(
    where: storage.Location, kind: str, named: vit.ViTConfig | None, path: str
) -> tuple[dict[str, torch.Tensor], vit.ViTConfig, str]:
    """timm / torchvision / transformers weights -> (vitray state dict, config, source format)."""
    overrides: dict[str, Any] = {}
    normalization: dict[str, Any] = {}  # mean/std where the folder records them
    base = None
    if not where.url.endswith(FILE_SUFFIXES):  # a transformers or timm model directory
        folder_config = _read_json(where.join(CONFIG_FILE))
        names = storage.list_files(where)
        file = where.join(next(n for n in HF_WEIGHT_FILES if n in names))
        raw = _read_tensors(file)
        if kind == "timm":
            overrides, normalization = _timm_folder(folder_config)
        else:
            try:
                base = vit.config_from_hf(folder_config)
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"--weights {path}: its {CONFIG_FILE} is not a transformers ViT config ({e!r})"
                ) from e
            overrides = {"num_heads": base.num_heads, "norm_eps": base.norm_eps}
            if HF_PREPROCESSOR in names:
                processor = _read_json(where.join(HF_PREPROCESSOR))
                normalization = _normalization(processor, "image_mean", "image_std")
    else:
        raw = _read_tensors(where)
        if kind == "file":
            kind = _guess_source(raw, path)
    if kind == "vitray":  # a bare vitray state dict file, without its config.json
        converted = raw
    else:
        try:
            converted = vit.convert_state_dict(raw, kind, **normalization)
        except ValueError as e:
            raise ValueError(f"--weights {path} as {kind} weights: {e}") from e
    try:
        inferred = vit.config_from_state_dict(converted, None if kind == "vitray" else kind, **overrides)
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--weights {path}: {e}") from e
    if base is not None:  # the sizes the transformers config.json claims must be the weights' own
        claimed = base.replace(
            **{f: getattr(inferred, f) for f in ("head", "num_classes", "representation_size")}
        )
        check_shapes({k: v.shape for k, v in converted.items()}, claimed, f"--weights {path}")
    if named is not None:
        _check_named(inferred, named, path)
        inferred = inferred.replace(name=named.name, num_heads=named.num_heads)
    elif "num_heads" not in overrides and inferred.name == "vit_custom":
        raise ValueError(
            f"--weights {path} hold a ViT of embed_dim {inferred.embed_dim}, depth {inferred.depth}, which is "
            "no known variant, so its number of heads is unknown; pass --model with a variant of those shapes"
        )
    return converted, inferred, kind


def _timm_folder(folder_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config overrides, mean/std) from timm's folder config.json: its heads, pooling and normalization."""
    args = folder_config.get("model_args") if isinstance(folder_config.get("model_args"), dict) else {}
    overrides: dict[str, Any] = {}
    if isinstance(args.get("num_heads"), int):
        overrides["num_heads"] = args["num_heads"]
    if args.get("global_pool", folder_config.get("global_pool")) == "avg":
        overrides["pool"] = "gap"  # the mean of the patch tokens (a norm after it would be fc_norm: refused)
    pretrained = folder_config.get("pretrained_cfg")
    return overrides, _normalization(pretrained if isinstance(pretrained, dict) else {}, "mean", "std")


def _normalization(values: Any, mean_key: str, std_key: str) -> dict[str, Any]:
    """``{"mean": ..., "std": ...}`` where ``values`` records both as lists of numbers, else {} (the
    source's defaults apply); the model's config checks their ranges."""
    if not isinstance(values, dict) or values.get("do_normalize") is False:
        return {}
    mean, std = values.get(mean_key), values.get(std_key)
    numbers = [
        v for v in (mean, std) if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)
    ]
    return {"mean": tuple(mean), "std": tuple(std)} if len(numbers) == 2 else {}


def _guess_source(state_dict: dict[str, torch.Tensor], path: str) -> str:
    keys = set(state_dict)
    if "patch_embed.mean" in keys:
        return "vitray"
    if "conv_proj.weight" in keys:
        return "torchvision"
    if any(k.removeprefix("vit.").startswith("embeddings.patch_embeddings") for k in keys):
        return "hf"
    if "patch_embed.proj.weight" in keys:
        return "timm"
    raise ValueError(
        f"--weights {path}: cannot tell whose ViT weights these are (keys like {sorted(keys)[:3]}); "
        "pass --weights-format timm, torchvision or hf"
    )


def _read_tensors(where: storage.Location) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors / .pth / .bin file; pickles only through ``weights_only=True``."""
    file = where.url
    fs, fs_path = where.fs()
    data = fs.cat_file(fs_path)
    if file.endswith(".safetensors"):
        from safetensors.torch import load

        read_header(io.BytesIO(data), len(data), f"--weights {file}")  # one-line errors for a damaged header
        try:
            return load(data)
        except Exception as e:
            raise ValueError(f"--weights {file} is not a readable safetensors file: {e}") from e
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message goes on to suggest weights_only=False: only the object the file names is told.
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"it names {named[1]}" if named else "objects torch does not load as weights"
        raise ValueError(
            f"--weights {file} holds more than tensors ({what}); it is not loaded, since unpickling runs "
            "code: save a plain state dict (torch.save(model.state_dict())) or .safetensors"
        ) from e
    except Exception as e:
        raise ValueError(f"--weights {file} is not a readable torch file: {type(e).__name__}: {e}") from e
    # Common wrappers of training scripts: {"model": sd}, {"state_dict": sd}, {"model_state_dict": sd}.
    for wrapper in ("model", "state_dict", "model_state_dict", "module"):
        if isinstance(loaded, dict) and isinstance(loaded.get(wrapper), dict):
            loaded = loaded[wrapper]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"--weights {file} is not a state dict (a dict of tensors)")
    return loaded
