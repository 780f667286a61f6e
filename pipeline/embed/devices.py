"""Where an embedding run's model actors run: GPU or CPU, how many CPUs each, what a local Ray needs.

The device is decided before any cluster work where it can be (`choose_device`), else from the joined
cluster (`gpus_from_cluster`); device and precision are part of the output's identity
(`compute_identity`), so CPU fp32 and GPU bf16 rows never mix in one ``--out``.
"""

from __future__ import annotations

import math
import os

from pipeline.embed.config import EmbedConfig


def compute_identity(use_gpu: bool, decode: str = "cpu") -> dict[str, str]:
    """Device and precision of the embeddings (the actor runs bf16 autocast on CUDA, fp32 on CPU), and
    where images decoded when not on CPU (``--decode gpu``: other pixels within decoder tolerance). Part
    of the output's identity: rows computed differently never mix in one --out."""
    device = {"device": "cuda", "precision": "bf16"} if use_gpu else {"device": "cpu", "precision": "fp32"}
    return device if decode == "cpu" else {**device, "decode": decode}


def choose_device(config: EmbedConfig, *, gpu: bool, cpu: bool, local: bool) -> EmbedConfig | None:
    """Where the model runs, decided before any cluster work where it can be: ``gpu`` asks for GPUs
    (the actors request them, and an autoscaling cluster brings GPU nodes; a local run needs one
    here), ``cpu`` stays on CPU, and a local run without either uses this machine's GPUs if it has
    any. None: a joined cluster without either flag, decided by what it has (`gpus_from_cluster`)."""
    if gpu and cpu:
        raise ValueError("--gpu and --cpu ask for opposite things; pass one of them")
    if gpu and local and not _local_gpus():
        raise ValueError(
            "--gpu on a machine without a CUDA GPU: drop --gpu, or submit the job to a GPU cluster"
        )
    if gpu or cpu:
        return config.replace(use_gpu=gpu)
    return config.replace(use_gpu=_local_gpus() > 0) if local else None


def gpus_from_cluster(config: EmbedConfig) -> EmbedConfig:
    """A joined cluster and neither --gpu nor --cpu: GPUs where it has some now. After training, an
    autoscaling cluster has scaled its GPU nodes down, hence the note."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if not gpus:
        print(
            "note: the cluster has no GPU now, so the model runs on CPU; --gpu asks the autoscaler for GPUs"
        )
    return config.replace(use_gpu=gpus > 0)


def local_actor_cpus(config: EmbedConfig, *, given: bool, num_cpus: int | None) -> EmbedConfig:
    """On a local Ray whose model runs on CPU, unless ``--cpus-per-actor`` was ``given``: the actors'
    torch threads share this machine's cores (decoding fits between them: the model is most of the
    work); within a given ``--num-cpus``, one logical CPU stays for decoding."""
    if given or config.use_gpu:
        return config
    cores = num_cpus or os.cpu_count() or 1
    spare = 1 if num_cpus else 0
    return config.replace(cpus_per_actor=float(max(1, (cores - spare) // config.concurrency)))


def local_cpus_needed(config: EmbedConfig) -> float:
    """Logical CPUs a local Ray needs: every actor's, plus one slot for the decode tasks beside them."""
    return math.ceil(config.concurrency * config.cpus_per_actor) + 1


def describe_actors(config: EmbedConfig) -> None:
    """On the connected cluster: print where the actors run, and whether they wait for GPUs."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if config.use_gpu and gpus < config.concurrency:
        print(
            f"note: {gpus:.0f} GPU(s) in the cluster now for --concurrency {config.concurrency}; "
            "actors wait for a GPU (an autoscaler brings GPU nodes)"
        )
    device = "1 GPU, bf16" if config.use_gpu else f"{config.cpus_per_actor:g} CPUs, fp32"
    print(
        f"{config.concurrency} model actor(s), {device} each, batch {config.forward_batch_size()}", flush=True
    )


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()
