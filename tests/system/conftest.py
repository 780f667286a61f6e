"""The system tests' one straight run: `jobs/pretrain.py`'s own config run uninterrupted on the tests'
shared Ray, which the preemption, asynchronous-kill and fault tests each compare their interrupted runs
with (bit for bit), in place of a straight run each.

Arithmetic: 4 shards x 16 samples, 2 workers x micro-batch 8, batch 16 -> 4 steps an epoch; 12 steps, a
checkpoint every 4 (each on an epoch edge, saved synchronously), a row every 2. How often a run logs and
checkpoints, and whether its saves are asynchronous, change no weight: an interrupted run may log and
checkpoint at its own pace and still end with these weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.data.writing import ShardSet

SYSTEM = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is marked `system`. `make test` runs the ones also marked `slow` (each starts its own
    jobs, Rays or clusters) one at a time, after the rest of the suite (in two processes)."""
    for item in items:
        if SYSTEM in item.path.parents:
            item.add_marker(pytest.mark.system)


# The flags every compared run shares: whatever a test adds may change when it logs and checkpoints, never
# what it trains.
TRAINING = [
    "--cpu", "--num-classes", "4", "--batch-size", "16", "--micro-batch-size", "8", "--max-steps", "12",
    "--warmup-steps", "2", "--shuffle-buffer", "16",
]  # fmt: skip
STRAIGHT = [*TRAINING, "--checkpoint-every", "4", "--log-every", "2", "--keep-checkpoints", "5",
            "--no-async-checkpoint"]  # fmt: skip


@dataclass(frozen=True)
class StraightRun:
    """The shards (shared: never write into them) and the straight run's directory under them."""

    shards: ShardSet
    out: Path


@pytest.fixture(scope="session")
def straight_run(ray_session, tmp_path_factory) -> StraightRun:
    """`jobs/pretrain.py --data <shards> --out <out> <STRAIGHT>`, run once for the session."""
    from pipeline.data.synthetic import write_synthetic_shards
    from pipeline.train import presets
    from pipeline.train.driver import fit

    root = tmp_path_factory.mktemp("straight")
    shards = write_synthetic_shards(root / "shards", 64, samples_per_shard=16, image_size=32, num_classes=4)
    out = root / "straight"
    args = ["--data", ",".join(shards.urls), "--out", str(out), *STRAIGHT]
    fit(presets.resolve(presets.pretrain_parser().parse_args(args)), shards.urls)
    return StraightRun(shards, out)
