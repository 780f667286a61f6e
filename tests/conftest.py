"""Shared fixtures: one local Ray for the whole session, markers, and the tiny synthetic shard set.

Tests form a pyramid: most need neither Ray nor these fixtures; the Ray ones share `ray_session`,
which declares more logical CPUs than the machine has, so that Ray Data read tasks and Ray Train
workers never wait on each other for CPU slots on a 2-core machine.
"""

from __future__ import annotations

import os

import pytest

from pipeline.cli import apply_local_ray_env

# Logical CPUs for the shared local Ray: training workers (1 each) plus Ray Data tasks must all fit.
RAY_NUM_CPUS = 8

# Before any Ray starts, so the shared Ray, the `ray start` head and the jobs run as subprocesses
# all inherit it.
apply_local_ray_env()


_DECLARED_LIBRARIES: list = []  # kept for the session


def import_torchvision_without_its_compiled_ops() -> None:
    """Import torchvision (and so timm) beside torch's CPU build.

    The registry's torchvision wheels are built against CUDA torch: beside the CPU build their compiled
    ops (nms, roi_align, ...) fail to load, and the import then stops at the fake kernels it registers
    for ``torchvision::nms`` and ``qnms`` ("operator torchvision::nms does not exist"). The models the
    tests convert (ViT, ResNet) use none of those ops, so when that is the only failure, the two
    operators are declared and the import goes on: every model is the library's own code.
    """
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
        import torch

        declared = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            declared.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _DECLARED_LIBRARIES.append(declared)  # a Library's definitions live as long as it does
        import torchvision  # noqa: F401


import_torchvision_without_its_compiled_ops()


# pytest-timeout's limit (pyproject.toml) fits the fast tests; an end-to-end test waits on its own
# subprocesses for up to 720 s, so it gets a limit above that, or its own timeouts could never fire.
SLOW_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance shared by every test that needs Ray (started on first use)."""
    import ray

    # Ray Data's progress bars are noise in test logs.
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=RAY_NUM_CPUS,
            include_dashboard=False,
            object_store_memory=2 * 1024**3,
            log_to_driver=False,
        )
    from pipeline.console import Console

    # The console a job sets up once it joins Ray (`cli.connect_ray`, which the job tests replace with
    # this Ray): Ray Data's progress bars off, its logger at WARNING; the job's stderr is its own lines.
    Console().after_init()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def synthetic_shards(tmp_path_factory):
    """A tiny labeled shard set: 4 shards x 12 samples of 64x64 JPEGs, 4 classes (no Ray needed).

    Returns a `pipeline.data.writing.ShardSet`: ``.dir``, ``.urls`` (sorted shard paths), ``.keys``,
    ``.labels`` (key -> int), ``.num_classes``, ``.image_size``, ``.brace_url``.
    """
    from pipeline.data.synthetic import write_synthetic_shards

    out = tmp_path_factory.mktemp("synthetic_shards")
    return write_synthetic_shards(out, 48, samples_per_shard=12, image_size=64, num_classes=4, seed=0)


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory) -> str:
    """A saved `vit_tiny_test` with 4 classes and the weights it was made with, no preprocessing record:
    what a job test hands to ``--weights`` where the values do not matter. Shared; never write into it."""
    import vit

    model = vit.create_model("vit_tiny_test", num_classes=4)
    path = tmp_path_factory.mktemp("tiny_export")
    vit.save_pretrained(path, model.state_dict(), model.config)
    return str(path)


@pytest.fixture(scope="session")
def tiny_export_32px(tmp_path_factory) -> str:
    """`tiny_export` made from seed 0, with the preprocessing record training saves beside the weights
    (32 px images, 8 px patches). Shared; never write into it."""
    import torch

    import vit
    from pipeline.data.config import DataConfig

    with torch.random.fork_rng():  # the same weights every time; the tests' random state left alone
        torch.manual_seed(0)
        model = vit.create_model("vit_tiny_test", num_classes=4)
    path = tmp_path_factory.mktemp("tiny_export_32px")
    data = DataConfig(image_size=32, patch_size=8)
    vit.save_pretrained(path, model.state_dict(), model.config, extra={"preprocessing": data.to_dict()})
    return str(path)
