"""Fine-tuning: a pretrained ViT under a new head, at a new resolution, evaluated on held-out shards.

    --weights -> `pipeline.model_source.load_model_source` (an export, a run dir, a checkpoint, timm/HF ...)
              -> `resolve_pretrained` (driver): the run's model is the weights' own, head "finetune"
              -> `pretrained_state` (every worker): head dropped, position embeddings resampled in 2D
                 to the new grid ([CLS] kept) -> `load_pretrained` into the FSDP2 model; the new
                 head keeps its zero initialization (the paper's, Sec. 3.2), or with --head-init probe
                 `probe_head_in_run` starts it from a linear probe of the training images' features
                 (LP-FT: a head that already fits them, so early gradients do not distort the features)
    a resume loads the head from its checkpoint: the probe is fit once, when the run starts
    --eval-data -> `evaluate`: each rank its slice of the shards, evaluation crop, top-1 accuracy
                   (`evaluate_in_run`: at the training loop's evaluation steps)

All ranks must join every FSDP2 forward (each all-gathers parameters), so evaluation agrees batch by
batch, as the training loop does step by step: a rank out of batches runs a forward over one idle
sample until no rank has any left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import vit
from pipeline.data import native
from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.linear_probe import LinearProbe, fit_linear_probe
from pipeline.train.config import TrainConfig
from pipeline.train.observe.metrics import log_line
from pipeline.train.state import Rank, agree_on_error

# Fields of the pretrained model that fine-tuning changes; every other field is the weights' own. The
# regularization fields are the fine-tuning run's own settings (--drop-path-rate, --dropout).
# --head-init probe fits on at most this many training images: enough for a probe of a few hundred
# classes, a few minutes of forwards on CPU and seconds on GPUs.
PROBE_IMAGES = 10_000

NEW_FIELDS = ("image_size", "num_classes", "head", "representation_size", *vit.REGULARIZATION_FIELDS)


def resolve_pretrained(config: TrainConfig) -> TrainConfig:
    """The run's model made the weights' own: variant, shapes, pooling and normalization from
    ``config.arch.weights``, with the new image size, class count and a fine-tuning head.

    Reads the weights once on the driver, so wrong weights stop the job in one line before any
    cluster work (`pipeline.model_source.load_model_source`'s errors).
    """
    from pipeline.model_source import load_model_source

    if not config.arch.weights:
        raise ValueError("fine-tuning needs --weights: a pretraining export, run directory or checkpoint")
    source = load_model_source(config.location(config.arch.weights)).config
    base = source.name if source.name in vit.VARIANTS else "vit_b16"  # any: every field is overridden
    reference = vit.VARIANTS[base].to_dict()
    kept = {k: v for k, v in source.to_dict().items() if k not in NEW_FIELDS and reference.get(k) != v}
    return config.replace(model=base, model_overrides={**kept, "head": "finetune"})


def pretrained_state(config: TrainConfig, model_config: vit.ViTConfig) -> dict[str, torch.Tensor]:
    """The pretrained weights as the fine-tuning model takes them: float32 on CPU, no ``head.*``,
    ``pos_embed`` ``(1+N, D)`` resampled bicubically to ``model_config``'s grid with [CLS] kept."""
    from pipeline.model_source import load_model_source

    state = load_model_source(config.location(config.arch.weights)).state_dict
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    pos = state["pos_embed"]
    if pos.dim() == 3:  # (1, T, D) in some converted weights
        pos = pos[0]
    state["pos_embed"] = vit.resample_pos_embed(pos, model_config.grid_size)
    return state


def load_pretrained(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Collective: every rank passes the same full state dict; each keeps its own shards of it.
    Parameters it lacks (the new head) keep their initialization; any other gap is an error."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    missing = {k for k in model.state_dict() if not k.startswith("head.")} - set(state)
    if missing:
        raise ValueError(f"the pretrained weights lack {sorted(missing)[:3]}; are they a ViT of this shape?")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


class HeadInitError(ValueError):
    """``--head-init probe`` could not fit its probe (one line, the same on every rank): a restart would
    fail alike."""


@torch.no_grad()
def fit_probe_head(
    model: nn.Module,
    batches: Iterator[dict[str, np.ndarray]],
    idle: tuple[torch.Tensor, ...],
    device: torch.device,
    group: dist.ProcessGroup | None,
    num_classes: int,
) -> tuple[LinearProbe, int, float]:
    """Collective, LP-FT's first half (Kumar et al. 2022): every rank runs the model over its
    ``batches`` and keeps the head's input (the pooled features ``(B, D)``); rank 0 fits
    `pipeline.linear_probe.fit_linear_probe` on all ranks' rows and sends it to every rank, and each loads
    it into ``head.fc`` (a class the rows never show gets zero weights and the lowest fitted bias).
    The model's logits are then the probe's. Returns ``(probe, images, the probe's accuracy on them)``
    on every rank; raises `HeadInitError` on every rank when no probe can be fit.
    """
    training = model.training
    model.eval()
    captured: list[torch.Tensor] = []
    hook = model.head.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    features, labels = [], []
    try:
        for _, y in _forward_batches(model, batches, idle, device, group, "--head-init probe data"):
            features.append(captured[-1].float().cpu().numpy())  # (B, D)
            labels.append(y.cpu().numpy())
            captured.clear()
    except RuntimeError as e:
        raise HeadInitError(str(e)) from None
    finally:
        hook.remove()
        model.train(training)
    rows = (np.concatenate(features), np.concatenate(labels)) if labels else None
    gathered: list[Any] = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else []
    dist.gather_object(rows, gathered if dist.get_rank() == 0 else None, dst=0, group=group)
    fitted: list[Any] = [None]
    if dist.get_rank() == 0:
        fitted[0] = _fit_rows([r for r in gathered if r is not None], num_classes)
    dist.broadcast_object_list(fitted, src=0, group=group)
    if isinstance(fitted[0], str):
        raise HeadInitError(fitted[0])
    probe, images, accuracy = fitted[0]
    index = torch.as_tensor(probe.classes, dtype=torch.long)
    weight = torch.zeros(num_classes, probe.weight.shape[1])
    bias = torch.full((num_classes,), float(probe.bias.min()))
    weight[index] = torch.from_numpy(probe.weight).float()
    bias[index] = torch.from_numpy(probe.bias).float()
    for param, full in ((model.head.fc.weight, weight), (model.head.fc.bias, bias)):
        full = full.to(param.device, param.dtype)
        if isinstance(param, DTensor):  # sharded by FSDP2: each rank keeps its shard of the same tensor
            full = distribute_tensor(full, param.device_mesh, param.placements)
        param.copy_(full)
    return probe, images, accuracy


def _fit_rows(rows: list[tuple[np.ndarray, np.ndarray]], num_classes: int) -> tuple[Any, ...] | str:
    """Rank 0's part of `fit_probe_head`: ``(probe, images, accuracy)``, or the one line of why not."""
    if not rows:
        return "--head-init probe read no training image to fit on; check --data, or use --head-init zero"
    x, y = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
    if y.min() < 0 or y.max() >= num_classes:
        return f"--head-init probe: a label is outside [0, {num_classes}); pass the task's --num-classes"
    try:
        probe = fit_linear_probe(x, y)
    except ValueError as e:
        return f"--head-init probe: {e}; use --head-init zero, or shards that mix the classes"
    return probe, len(y), float(np.mean(probe.predict(x) == y))


def probe_head_in_run(
    model: nn.Module,
    shards: list[str],
    config: TrainConfig,
    patch_size: int,
    me: Rank,
    idle: tuple[torch.Tensor, ...],
    *,
    data_cpus: float,
) -> None:
    """Collective: `fit_probe_head` over the run's first training images, up to `PROBE_IMAGES` (each rank
    the first of its slice of ``shards``), with the evaluation crop at the run's image size; rank 0 logs it."""
    start = time.perf_counter()
    eval_config = eval_data_config(config, patch_size)
    batches = eval_batches(shards[me.rank :: me.world], eval_config, config.optim.micro_batch_size, data_cpus)
    limit = -(-PROBE_IMAGES // me.world)
    probe, images, accuracy = fit_probe_head(
        model, _first(batches, limit), idle, me.device, me.group, config.arch.num_classes
    )
    if me.rank == 0:
        note = "" if probe.converged else " (L-BFGS stopped before converging)"
        log_line(
            f"head: a linear probe fit on {images} training images at {config.data.image_size} px (eval crop) "
            f"in {time.perf_counter() - start:.0f} s, {100 * accuracy:.1f}% on them{note}"
        )


def _first(batches: Iterator[dict[str, Any]], limit: int) -> Iterator[dict[str, Any]]:
    """The batches' first ``limit`` samples, the last batch cut short."""
    for batch in batches:
        if limit <= 0:
            return
        n = len(batch["label"])
        yield batch if n <= limit else {k: v[:limit] for k, v in batch.items()}
        limit -= n


def eval_data_config(config: TrainConfig, patch_size: int) -> DataConfig:
    """The model's evaluation transform (`DataConfig.for_eval`) over the run's data settings, labels
    required. Bad samples are counted and skipped, never fatal: one rank failing alone would leave the others
    waiting in a forward."""
    return DataConfig.for_eval(
        config.data_for(patch_size),
        image_size=config.data.image_size,
        patch_size=patch_size,
        max_bad_fraction=1.0,
    )


def eval_batches(
    shards: list[str], config: DataConfig, size: int, data_cpus: float
) -> Iterator[dict[str, Any]]:
    """This rank's evaluation batches (up to ``size`` good samples each), none without shards."""
    if not shards:
        return
    from pipeline.data.dataset import build_dataset, for_one_rank, iter_batches

    dataset = for_one_rank(build_dataset(shards, config, train=False), data_cpus)
    bad = BadSamples.from_config(config)
    for batch in iter_batches(dataset, size, config, epoch=0, shuffle=False, bad_samples=bad):
        if len(batch["label"]):
            yield batch


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterator[dict[str, np.ndarray]],
    idle: tuple[torch.Tensor, ...],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> tuple[float, int]:
    """Collective: (top-1 accuracy, samples) over every rank's ``batches``; ``idle`` is the model's inputs
    (patches ``(b, N, K)``; native: and coords, mask, grid) a rank without batches runs so that every
    forward has all ranks.

    Per batch, the ranks agree (on ``group``, a CPU group) whether any still has one and whether any
    failed; a data error on any rank ends the evaluation on all with that rank's message. The model
    runs in eval mode (no dropout, no stochastic depth) and is handed back in the mode it came in.
    """
    training = model.training
    model.eval()
    try:
        return _evaluate(model, batches, idle, device, group)
    finally:
        model.train(training)


def evaluate_in_run(
    model: nn.Module,
    shards: list[str],
    config: TrainConfig,
    patch_size: int,
    me: Rank,
    idle: tuple[torch.Tensor, ...],
    *,
    step: int,
    data_cpus: float,
    weights: str = "",
) -> tuple[float, float]:
    """Collective: the training loop's evaluation at ``step``: (top-1 accuracy over the evaluation
    ``shards``, each rank its slice, with the evaluation crop; its seconds, which are not training time).
    Rank 0 logs it, ``weights`` naming what was scored where it is not the model's own ("EMA").
    A data error on any rank raises RuntimeError with that rank's line on every rank."""
    start = time.perf_counter()
    eval_config = eval_data_config(config, patch_size)
    batches = eval_batches(shards[me.rank :: me.world], eval_config, config.optim.micro_batch_size, data_cpus)
    accuracy, seen = evaluate(model, batches, idle, me.device, me.group)
    seconds = time.perf_counter() - start
    if me.rank == 0:
        what = f" of the {weights} weights" if weights else ""
        log_line(f"step {step}: eval accuracy{what} {100 * accuracy:.2f}% on {seen} images ({seconds:.0f} s)")
    return accuracy, seconds


def _evaluate(
    model: nn.Module,
    batches: Iterator[dict[str, np.ndarray]],
    idle: tuple[torch.Tensor, ...],
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> tuple[float, int]:
    hits = torch.zeros((), dtype=torch.long, device=device)
    count = 0
    for logits, labels in _forward_batches(model, batches, idle, device, group, "evaluation data"):
        hits += (logits.argmax(-1) == labels).sum()
        count += labels.numel()
    totals = torch.tensor([float(hits.item()), float(count)], dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    correct, seen = totals.tolist()
    return (correct / seen if seen else float("nan")), int(seen)


def _forward_batches(
    model: nn.Module,
    batches: Iterator[dict[str, np.ndarray]],
    idle: tuple[torch.Tensor, ...],
    device: torch.device,
    group: dist.ProcessGroup | None,
    what: str,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Collective, consumed whole on every rank: ``(logits, labels)`` of this rank's batches, a forward
    over ``idle`` while other ranks still have some; a data error on any rank raises RuntimeError
    ``"<what>: <error>"`` on all."""
    error = ""
    while True:
        batch = None
        if not error:
            try:
                batch = next(batches, None)
            except Exception as e:
                error = f"{what}: {type(e).__name__}: {e}"
        error, (have,) = agree_on_error(error, group, counts=(batch is not None,))
        if error:
            raise RuntimeError(error)
        if have == 0:
            return
        if batch is None:
            model(*idle)
            continue
        # Ray hands out read-only arrays, which torch must not wrap: copied where they are.
        columns = native.INPUTS if "grid" in batch else ("patches",)  # native: patches, coords, mask, grid
        inputs = [torch.from_numpy(np.require(batch[c], requirements=("C", "W"))).to(device) for c in columns]
        labels = torch.from_numpy(np.require(batch["label"], requirements=("C", "W"))).to(device)
        yield model(*inputs), labels
