"""Ranks as processes, for the tests that shard a model: `spawn(worker, *args)` runs `worker(rank, *args)`
in `world_size` fresh processes that share one process group on 127.0.0.1 (gloo; NCCL for the GPU tests).

The processes are forked from one server process per test session that has imported torch, Ray Train
and the pipeline once (`multiprocessing`'s forkserver with `PRELOAD`): a rank starts in a fraction of a
second instead of importing them again (seconds of CPU each, for every rank of every test). A rank gets
the environment of the test that spawned it, not the server's, and no state beyond those imports: the
server never runs a torch operation (no thread pool, no CUDA context) before it forks. Ranks that join a
Ray cluster start as fresh interpreters (`spawn`'s ``joins_ray``).

Every rank leaves the same way: its worker's objects (FSDP2 state holds the group's pending work) are
collected, a barrier waits until every rank is past its last collective, and only then is the group
destroyed, so no rank closes its connections while another still reads from them.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=120)

# What every rank imports anyway, imported once in the fork server.
PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "pytest",
    "vit",
    "ray.train",
    "pipeline.train.loop",
    "tests.distributed",
]
multiprocessing.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket is held open until all are bound, so the system cannot
    hand out one port twice (closed one at a time, two calls returned the same port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def spawn(
    worker: Callable[..., None], *args, world_size: int = 2, backend: str = "gloo", joins_ray: bool = False
) -> None:
    """Run `worker(rank, *args)` on every rank; an assertion failing on any rank fails the caller. What
    the ranks print reaches this process's stdout and stderr once they have ended (rank by rank), where
    pytest captures it as a test's own. Ranks that join a Ray cluster (``joins_ray``) start as fresh
    interpreters: Ray's core worker does not start reliably in a process forked from one that imported
    Ray (its plasma client failed to start in one run of the suite)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as printed:
        try:
            mp.start_processes(
                _rank, args=(worker, args, port, world_size, backend, dict(os.environ), printed),
                nprocs=world_size, join=True, start_method="spawn" if joins_ray else "forkserver",
            )  # fmt: skip
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for rank in range(world_size):
                for fd in (1, 2):
                    path = Path(printed) / f"{rank}.{fd}"
                    if path.is_file():
                        os.write(fd, path.read_bytes())


def _rank(
    rank: int,
    worker: Callable[..., None],
    args: tuple,
    port: int,
    world_size: int,
    backend: str,
    env: dict[str, str],
    printed: str,
):
    # The fork server's environment and standard streams are those of the test that started it: this
    # rank takes those of the test that spawned it.
    os.environ.clear()
    os.environ.update(env)
    for fd in (1, 2):
        out = os.open(Path(printed) / f"{rank}.{fd}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
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
