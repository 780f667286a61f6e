"""The model of a training run: its config, the process group, and the sharded model built on meta.

Everything here runs under Ray Train workers, under `torchrun`, or in one plain process. Order of
setup, fixed: model on meta -> activation checkpointing -> per-block compile -> FSDP2 -> materialize
-> init.
"""

from __future__ import annotations

import os
import socket
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import vit
from pipeline.data.config import sample_seed
from pipeline.train.config import TrainConfig
from vit.parallelize import hsdp_mesh, parallelize


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or start) the process group; returns (rank, world_size, device).

    Ray Train and torchrun set it up through the environment; a lone process gets a world of one,
    so FSDP2 and the step below run unchanged.
    """
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


# An MAE's encoder has no classifier, and its embedding is the mean of its patch tokens: the loss
# reaches [CLS] only through the decoder (see `vit.create_mae`).
MAE_ENCODER = {"num_classes": 0, "head": "finetune", "pool": "gap"}


def model_config(config: TrainConfig) -> vit.ViTConfig:
    """The ViTConfig a training config resolves to (validates name and sizes): the whole model, or
    for MAE its encoder, which is what the run exports."""
    if config.task.objective == "mae":
        base = {"image_size": config.data.image_size, **MAE_ENCODER}
    else:
        base = {"image_size": config.data.image_size, "num_classes": config.arch.num_classes}
    base.update({name: getattr(config.arch, name) for name in vit.REGULARIZATION_FIELDS})
    resolved = vit.get_config(config.arch.model, **{**base, **config.arch.model_overrides})
    if config.data.native and resolved.backbone_layers is not None:
        raise ValueError(
            f"--patches native needs a plain ViT, and {resolved.name} is a hybrid whose ResNet reads a "
            "whole square image: use --patches square, or a model without a ResNet stem"
        )
    return resolved


def mae_config(config: TrainConfig) -> vit.MAEConfig:
    """The decoder and loss of an MAE run (`vit.MAEConfig`)."""
    return vit.MAEConfig(
        decoder_dim=config.task.decoder_dim,
        decoder_depth=config.task.decoder_depth,
        decoder_num_heads=config.task.decoder_num_heads,
        norm_pix_loss=config.task.norm_pix_loss,
    )


def create_module(config: TrainConfig) -> nn.Module:
    """The module a run trains, on the current default device: a ViT, or for MAE a
    `vit.MaskedAutoencoder` whose ``encoder`` is that ViT."""
    if config.task.objective == "mae":
        return vit.MaskedAutoencoder(model_config(config), mae_config(config))
    return vit.VisionTransformer(model_config(config))


def shard_group_size(config: TrainConfig) -> int:
    """Ranks per FSDP shard group (collective): `config.cluster.shard_group_size`, else the ranks of one host
    when every host holds the same number of consecutive ranks (Ray Train and torchrun number the
    workers of a node consecutively), else every rank (plain FSDP over one dimension)."""
    world = dist.get_world_size()
    if config.cluster.shard_group_size is not None:
        return config.cluster.shard_group_size
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    group = hosts.count(hosts[0])
    runs = [hosts[i : i + group] for i in range(0, world, group)]
    if world % group or any(len(set(run)) != 1 for run in runs) or len({run[0] for run in runs}) != len(runs):
        return world
    return group


def build_model(config: TrainConfig, device: torch.device, mesh: DeviceMesh | None = None) -> nn.Module:
    """Model on meta -> float8 Linears (--fp8) -> AC -> compile -> FSDP2 (HSDP over nodes) -> materialized
    on `device` -> initialized.

    Without a `mesh`: shard within groups of `shard_group_size` ranks and replicate across groups.
    """
    if mesh is None:
        mesh = hsdp_mesh(device.type, dist.get_world_size(), shard_group_size(config))
    with torch.device("meta"):
        model = create_module(config)
    if config.speed.fp8:
        from pipeline.train.step import fp8

        # Emulated on CPU: only tests get there, as the config refuses --fp8 with --cpu.
        if device.type == "cuda":
            fp8.check_device(device)
        fp8.convert_to_float8(model, emulate=device.type != "cuda")
    # bf16 compute with fp32 gradient reduction on GPU; plain fp32 on CPU, where bf16 is slow.
    parallelize(
        model,
        mesh,
        activation_checkpointing=config.speed.activation_checkpointing,
        compile=config.speed.compile,
        ac_mode=config.speed.ac_mode,
        compile_scope=config.speed.compile_scope,
        param_dtype=torch.bfloat16 if device.type == "cuda" else None,
        reduce_dtype=torch.float32,
    )
    model.to_empty(device=device)
    # On CUDA, DTensor tracks RNG offsets, so a seeded draw gives each rank its slice of one full
    # tensor. On CPU it does not: every rank would draw the same numbers for its own shard, i.e.
    # identical halves of every weight (symmetric neurons), so there each shard seeds differently:
    # by its place in the shard dimension, which replicas of it (HSDP) share.
    shard = mesh.get_local_rank(mesh.ndim - 1)
    torch.manual_seed(config.run.seed if device.type == "cuda" else config.run.seed + shard)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.init_weights()
    # What training draws from torch's RNG (dropout, stochastic depth) comes from a stream of each
    # rank's own, so ranks do not drop the same blocks of their i-th samples; a checkpoint restores it.
    torch.manual_seed(sample_seed(config.run.seed, 0, "torch-rng", f"rank-{dist.get_rank()}"))
    return model
