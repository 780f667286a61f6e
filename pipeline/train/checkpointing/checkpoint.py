"""Training checkpoints: sharded, resumable at any world size, complete or ignored.

Design notes
------------
- Format: `torch.distributed.checkpoint` (DCP). Every rank writes only its own shards
  (`__<rank>_0.distcp`); rank 0 also writes `.metadata` (the global layout, last) plus
  `train_state.json` and `config.json`. Under Ray Train each rank writes into a local temporary
  directory and hands it to `ray.train.report(checkpoint=...)`, which merges the ranks' files into
  one directory of the run's storage (local, s3://, gs://) and registers it only once every rank
  has uploaded. Outside Ray the same functions write straight to a shared directory. The worker loop
  saves through `pipeline.train.checkpointing.saver`, which by default hands `prepare`'s state to DCP's asynchronous
  save (training waits for the copy to host memory alone) and lets the write and upload run beside it.
- Completeness: a directory counts only once `.metadata`, `train_state.json`, `config.json` and every
  shard file the metadata names are there whole (`pipeline.dcp.is_complete`); `latest_complete` skips
  anything else (a crash mid-save or mid-upload, or a rank's upload that never arrived, leaves an
  ignorable directory).
- Resharding: model and optimizer state go through `get_state_dict`/`set_state_dict`, keyed by
  parameter name (wrapper prefixes of activation checkpointing and compile stripped), so DCP can
  re-slice them for any world size on load. Load at world size N what was saved at M.
- What else is saved: the step, the data position (epoch, and the micro-batches each rank has taken
  from its stream this epoch: `pipeline.train.loop` resumes at the next sample), and every rank's RNG
  state (restored when the world size matches; otherwise each rank reseeds from (seed, step, rank)).
  The learning-rate schedule is a pure function of the step, so it needs no state of its own.
- The EMA of the weights (`pipeline.train.step.ema`, with ``--ema-decay``) is saved beside the model as
  ``ema.<parameter name>``, DTensors of the parameters' layout, so it reshards alike. A checkpoint without
  it resumes with the EMA started from its weights; a run without EMA never reads it.
- The final export gathers one full tensor at a time onto rank 0's CPU (`cpu_offload`), so no
  accelerator ever holds the whole unsharded model; the EMA's export (``final_ema/``) alike.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

import vit
from pipeline import storage
from pipeline.dcp import CONFIG, TRAIN_STATE, CheckpointRefusedError, plain_data_planner, safe_reader
from pipeline.train.observe.metrics import log_line
from pipeline.train.sections import OptimConfig
from pipeline.train.step.ema import PREFIX as EMA_PREFIX
from pipeline.train.step.ema import WeightEMA
from vit.weights import WEIGHTS_FILE

if TYPE_CHECKING:
    from pipeline.train.config import TrainConfig


def _rng_state() -> dict[str, str]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in state.items()}


def _set_rng_state(state: dict[str, str]) -> None:
    decoded = {
        k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8) for k, v in state.items()
    }
    torch.set_rng_state(decoded["cpu"])
    if "cuda" in decoded and torch.cuda.is_available():
        torch.cuda.set_rng_state(decoded["cuda"])


def save(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    config: dict[str, Any],
    ema: WeightEMA | None = None,
) -> None:
    """Collective: every rank writes its shards of model and optimizer state (and of the EMA of the
    weights, when the run keeps one) into `directory`.

    `train_state` (step, data position ...) and `config` are the same on every rank; rank 0
    writes them. RNG states of all ranks are gathered into `train_state.json`.
    """
    dcp.save(prepare(directory, model, optimizer, train_state, config, ema), checkpoint_id=str(directory))


def prepare(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    config: dict[str, Any],
    ema: WeightEMA | None = None,
) -> dict[str, Any]:
    """Collective: what `save` does before DCP writes: every rank's RNG gathered, rank 0's
    `train_state.json` and `config.json` written into `directory`; returns the state dict for DCP
    (model, optimizer, EMA: views of the live tensors). `pipeline.train.checkpointing.saver` hands it to DCP's
    asynchronous save instead."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, _rng_state())
    if dist.get_rank() == 0:
        (directory / TRAIN_STATE).write_text(json.dumps({**train_state, "rng": rng}, indent=1))
        (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return state_dict(model, optimizer, ema)


def state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: WeightEMA | None = None
) -> dict[str, Any]:
    """The state dict DCP saves: model, optimizer and EMA, views of the live tensors (each rank's shards)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if ema is not None:
        state[EMA_PREFIX] = ema.state_dict()
    return state


def check_compatible(
    directory: str | Path,
    model_config: vit.ViTConfig,
    objective: dict[str, Any] | None = None,
    optim: OptimConfig | None = None,
) -> None:
    """Raise a one-line error when a checkpoint was made for another model, or (with ``objective``,
    `pipeline.train.step.objective.Objective.checkpoint_meta`) another objective or MAE decoder, or holds
    (with ``optim``, the run's section) the state of another optimizer or of other parameter groups
    (layer decay 1 or not: two groups, or one per layer). Other optimizer settings may change: the
    run's own apply (`load`). The error is a `CheckpointRefusedError`: workers refuse alike, and a
    restart would only refuse again."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise CheckpointRefusedError(
            f"{directory} is not a vitray checkpoint (no {CONFIG}); pass a checkpoint_* directory"
        )
    saved_all = json.loads(path.read_text())
    check_saved_config(saved_all, path)
    saved = saved_all.get("model_config", {})
    mine = model_config.to_dict()
    keys = (*vit.ARCHITECTURE_FIELDS, "num_heads", "num_classes")
    diff = {k: (saved.get(k), mine.get(k)) for k in keys if saved.get(k) != mine.get(k)}
    if diff:
        described = ", ".join(f"{k} {a} (checkpoint) vs {b} (this run)" for k, (a, b) in diff.items())
        raise CheckpointRefusedError(
            f"checkpoint {directory} is for another model: {described}; use its --model or a fresh --out"
        )
    for key, value in (objective or {}).items():
        # Checkpoints from before objectives were recorded are supervised.
        have = saved_all.get(key, "supervised" if key == "objective" else None)
        if have != value:
            raise CheckpointRefusedError(
                f"checkpoint {directory} was written with {key} {have}, this run has {value}; resume with "
                "the checkpoint's settings (--objective, --mask-ratio, --decoder-*) or use a fresh --out"
            )
    if optim is None:
        return
    optimizer, layer_decay = optim.optimizer, optim.layer_decay
    train = saved_all.get("train") or {}
    saved_optim = train.get("optim") or train  # sections, or a version 1 flat config
    have = saved_optim.get("optimizer")
    if have is not None and have != optimizer:
        raise CheckpointRefusedError(
            f"checkpoint {directory} holds the state of optimizer {have}, this run has --optimizer "
            f"{optimizer}; resume with --optimizer {have}, or use a fresh --out"
        )
    saved_decay = saved_optim.get("layer_decay", 1.0)
    if (saved_decay == 1) != (layer_decay == 1):
        raise CheckpointRefusedError(
            f"checkpoint {directory} holds optimizer state of --layer-decay {saved_decay:g}, this run has "
            f"{layer_decay:g} ({'one parameter group per layer' if layer_decay != 1 else 'no per-layer groups'}"
            f"); resume with --layer-decay {saved_decay:g}, or use a fresh --out"
        )


def check_saved_config(saved: dict[str, Any], path: Path | str) -> None:
    """A one-line `CheckpointRefusedError` naming ``path`` and the field when the run's settings saved in a
    checkpoint's config.json do not read here (a newer vitray's version, a field unknown here): resuming
    would drop or misread them with no word."""
    from pipeline.data.config import DataConfig
    from pipeline.train.config import TrainConfig

    for section, cls in (("train", TrainConfig), ("data", DataConfig)):
        if section not in saved:
            continue
        try:
            if not isinstance(saved[section], dict):
                raise ValueError(f"it is a {type(saved[section]).__name__}, not a JSON object of settings")
            cls.from_dict(saved[section])
        except (TypeError, ValueError) as e:
            raise CheckpointRefusedError(
                f"{path}: its {section} settings do not read: {e}; resume with the vitray that wrote it, or "
                "use a fresh --out"
            ) from e


def load(
    directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: WeightEMA | None = None
) -> dict[str, Any]:
    """Collective: load model and optimizer state into the sharded model; returns train_state.

    ``ema``: restored too when the checkpoint holds one (``ema.restored``), else started afresh from
    the loaded weights; a checkpoint's EMA that the run does not keep is not read.

    Works at any world size. Restores this rank's RNG when the world size matches the saver's.
    Nothing in the checkpoint is executed: ``.metadata`` goes through `pipeline.dcp.MetadataUnpickler`
    and the optimizer's plain values through ``weights_only`` loads; what either refuses raises a
    one-line `CheckpointRefusedError`. (The model alone, in one process, is `pipeline.dcp.load_model_state`.)
    """
    directory = Path(directory)
    reader = safe_reader(str(directory))
    try:  # on every rank, before the collective load: each refuses alike, none waits on the others
        metadata = reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointRefusedError(
            f"checkpoint {directory}: {e}; remove that checkpoint directory to resume from an earlier one"
        ) from e
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    saved_ema = any(name.startswith(f"{EMA_PREFIX}.") for name in metadata.state_dict_metadata)
    if ema is not None and saved_ema:
        state[EMA_PREFIX] = ema.state_dict()
    try:
        dcp.load(state, storage_reader=reader, planner=plain_data_planner())
    except CheckpointException as e:  # DCP gathers every rank's failure; a refusal stays one line
        for failure in e.failures.values():
            refused = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(refused, CheckpointRefusedError):
                raise CheckpointRefusedError(f"checkpoint {directory}: {refused}") from e
        raise
    # The groups' settings (weight decay, betas, lr scales, kernels) are this run's, as its command line
    # gives them; only the moments and step counts are the checkpoint's. (The lr is set every step.)
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    if ema is not None and EMA_PREFIX in state:
        ema.load_state_dict(state[EMA_PREFIX])
    elif ema is not None:
        ema.reset()
    train_state = json.loads((directory / TRAIN_STATE).read_text())
    rng = train_state.pop("rng", None)
    if rng and len(rng) == dist.get_world_size():
        _set_rng_state(rng[dist.get_rank()])
    else:
        seed = train_state.get("seed", 0)
        torch.manual_seed((seed * 1_000_003 + train_state["step"]) * 1_009 + dist.get_rank())
    return train_state


def export_final(
    directory: str | Path,
    model: nn.Module,
    model_config: vit.ViTConfig,
    extra: dict[str, Any],
    exported: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ema: WeightEMA | None = None,
) -> Path | None:
    """Collective: write `weights.safetensors` + `config.json` for the embedding job (rank 0 writes).

    Full tensors are gathered one at a time to rank 0's CPU; returns the directory on rank 0.
    ``exported`` picks what of the full state dict is exported (an MAE's encoder); default: all of it.
    ``ema``: export the EMA of the weights instead of the weights (the model's buffers alike).
    """
    if ema is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(model, options=options)
    else:
        state_dict = _gathered_to_rank0(ema.model_state_dict(get_model_state_dict(model)))
    if dist.get_rank() != 0:
        return None
    if exported is not None:
        state_dict = exported(state_dict)
    directory = Path(directory)
    os.makedirs(directory, exist_ok=True)
    vit.save_pretrained(directory, state_dict, model_config, extra=extra)
    return directory


def export_run(
    out: storage.Location,
    model: nn.Module,
    model_config: vit.ViTConfig,
    extra: dict[str, Any],
    exported: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ema: WeightEMA | None = None,
) -> None:
    """Collective: `export_final` into the run directory ``out``: ``final/``, and with ``ema`` its
    export ``final_ema/`` too, whose config.json's ``ema`` gives its decay and cadence. A run without EMA
    removes a ``final_ema/`` that an earlier part of the run left: it would sit beside newer weights."""
    exports = {"final": (extra, None)}
    if ema is not None:
        ema_extra = {**extra, "ema": {"decay": ema.decay, "every": ema.every}}
        if "training" in extra:  # its model card's evaluation accuracy is the EMA's
            ema_extra["training"] = {
                **extra["training"],
                "eval_accuracy": extra["training"].get("eval_ema_accuracy"),
            }
        exports["final_ema"] = (ema_extra, ema)
    for name, (meta, averaged) in exports.items():
        export_into(out.join(name), model, model_config, meta, exported, averaged)
    stale = out.join("final_ema")
    if ema is None and dist.get_rank() == 0 and storage.list_files(stale):
        for file in (CONFIG, WEIGHTS_FILE):  # config.json first: then it is no export
            storage.remove(stale.join(file))
        log_line(f"removed {stale}: it is older than final/, and this run keeps no EMA (--ema-decay)")


def export_into(
    where: storage.Location,
    model: nn.Module,
    model_config: vit.ViTConfig,
    extra: dict[str, Any],
    exported: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ema: WeightEMA | None = None,
) -> None:
    """Collective: `export_final` into ``where`` (rank 0 uploads it, config.json last, and logs it)."""
    with tempfile.TemporaryDirectory(prefix="vitray-final-") as tmp:
        if export_final(tmp, model, model_config, extra, exported, ema) is not None:
            storage.upload_dir(tmp, where, commit_last=CONFIG)
            log_line(f"exported {where}")


def _gathered_to_rank0(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A sharded state dict as full CPU tensors on rank 0 ({} elsewhere), one tensor gathered at a time:
    what ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` does for the model itself."""
    full = {}
    for name, value in state_dict.items():
        value = value.full_tensor() if isinstance(value, DTensor) else value  # collective
        if dist.get_rank() == 0:
            full[name] = value.detach().to("cpu", copy=True)
    return full


def resize_line(config: TrainConfig, saved: int, world: int, step: int) -> str:
    """The log line of a group resumed at another size than its checkpoint's: from how many workers to
    how many, why, the step it resumes at, and the accumulation that keeps the global batch. Ray Train
    tells a new group no reason; the sizes do: an elastic group smaller than its checkpoint's lost workers
    (a node left, or a process died), a larger one found room that nodes brought."""
    if isinstance(config.cluster.num_workers, int):
        why = "--num-workers changed"
    elif world < saved:
        why = f"{saved - world} lost: a node left or a worker died"
    else:
        why = f"room for {world - saved} more: nodes joined"
    micro, batch, before = config.optim.micro_batch_size, config.optim.batch_size, config.accumulation(saved)
    return (
        f"workers: from {saved} to {world} ({why}); resuming at step {step}, the batch kept at {batch} = "
        f"{world} x {micro} x {config.accumulation(world)} accumulation"
        + (f" (was x {before})" if before else "")
    )
