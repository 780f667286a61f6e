"""The training tests' one-process world: a process group of one rank (gloo on CPU), for the tests of
a module that need one."""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from pipeline.train.state import control_group
from pipeline.train.step.model import init_distributed


@pytest.fixture(scope="module")
def world():
    """This process as rank 0 of a world of 1; its device. Torn down after the module's tests."""
    rank, size, device = init_distributed()
    assert (rank, size) == (0, 1)
    yield device
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def control(world):
    """That world's CPU group for the loop's agreements (`control_group`, as the loop's `Rank` holds it):
    None on CPU, where the world itself is gloo; a gloo group beside NCCL on CUDA, where a collective over
    CPU tensors in the default group fails ("No backend type associated with device type cpu")."""
    return control_group()


@pytest.fixture(autouse=True)
def collector_as_it_was():
    """A run's first log window turns Python's collector off and freezes the heap
    (`pipeline.train.observe.metrics.MetricsWindow`): for a worker process, which ends with its run. A run in
    this process gives them back after each test."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


@pytest.fixture(params=["inline", "feeder"])
def data_process(request) -> str:
    """Where a run's pipeline runs (``--data-process``), for the tests of exact resume run with both: a
    feeder is an actor of the tests' shared local Ray (`pipeline.train.input.feeder`)."""
    if request.param == "feeder":
        request.getfixturevalue("ray_session")
    return request.param
