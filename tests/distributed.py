"""Ranks as processes, for the tests that shard a model: `spawn(worker, *args)` runs `worker(rank, *args)`
in `world_size` fresh processes that share one process group on 127.0.0.1 (gloo; NCCL for the GPU tests).

Every rank leaves the same way: its worker's objects (FSDP2 state holds the group's pending work) are
collected, a barrier waits until every rank is past its last collective, and only then is the group
destroyed, so no rank closes its connections while another still reads from them.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], *args, world_size: int = 2, backend: str = "gloo") -> None:
    """Run `worker(rank, *args)` on every rank; an assertion failing on any rank fails the caller."""
    port = free_port()
    mp.spawn(_rank, args=(worker, args, port, world_size, backend), nprocs=world_size, join=True)


def _rank(rank: int, worker: Callable[..., None], args: tuple, port: int, world_size: int, backend: str):
    # The environment too, for code under test that reads it (DeviceMesh, init_distributed).
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
    # A collective that one rank never joins fails the others within the timeout instead of hanging.
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    try:
        worker(rank, *args)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
