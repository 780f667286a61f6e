"""A local Ray's workers run at the niceness of the process that started it (`pipeline.cli.LOCAL_RAY_ENV`)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.usefixtures("ray_session")


def test_local_ray_workers_are_not_reniced():
    import ray

    @ray.remote(num_cpus=1)
    def niceness() -> int:
        return os.nice(0)

    @ray.remote(num_cpus=1)
    class Worker:
        def niceness(self) -> int:
            return os.nice(0)

    # Ray's default (15 above the raylet) left a training worker a few percent of a core beside
    # any ordinary process: the same work ran 10x slower beside two busy loops.
    assert ray.get(niceness.remote()) == os.nice(0)
    assert ray.get(Worker.remote().niceness.remote()) == os.nice(0)
