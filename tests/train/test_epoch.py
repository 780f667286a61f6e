"""An epoch is every good sample once: two ranks (processes, FSDP2 over gloo) run the worker loop
in-process over 4 uneven shards, so one rank's stream runs dry steps before the other's. The epoch
goes on until both have, the dry rank joining the last steps with a short micro-batch and then with
nothing; a run stopped in that padded tail and resumed trains what a straight run trains.

Arithmetic: shards of 3, 6, 25 and 7 samples, the first of shards 0 and 2 corrupt: 39 good samples
an epoch; micro-batch 4, 2 ranks, batch 16 (2 micro-batches a rank step). Whichever two shards a rank
reads in an epoch's shard order, one rank's stream holds 26 to 31 samples (4 steps, the last short)
and the other's 8 to 13 (1 or 2 steps): every epoch takes 4 steps, the last 2 or 3 with an idle rank.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipeline.data.dataset import rebatch
from tests.configs import tiny_config
from tests.distributed import spawn
from tests.train.test_loop import LocalSession, assert_same_weights

SIZES = {f"mem://shard-{i}": n for i, n in enumerate((3, 6, 25, 7))}
CORRUPT = {"mem://shard-0/0", "mem://shard-2/0"}
GOOD = sorted(f"{url}/{i}" for url, n in SIZES.items() for i in range(n) if f"{url}/{i}" not in CORRUPT)
RANK_STEP = 8  # samples of one rank's full step: 2 micro-batches of 4


def uneven_micro_batches(shards, data_config, *, epoch, rank, size, bad_samples, data_cpus, root=None):
    """`pipeline.data.dataset.micro_batches` without Ray, over shards of `SIZES`: the rows are a pure
    function of (shard, epoch), bad rows are counted and removed, and the real `rebatch` cuts them."""
    patches = (data_config.image_size // data_config.patch_size) ** 2
    patch_dim = data_config.patch_size**2 * 3

    def rows():
        for url in shards:
            n = SIZES[url]
            g = np.random.default_rng([int(url.rsplit("-", 1)[1]), epoch])
            keys = [f"{url}/{i}" for i in range(n)]
            yield bad_samples.filter(
                {
                    "key": np.array(keys),
                    "url": np.array([url] * n),
                    "patches": g.integers(0, 256, (n, patches, patch_dim), dtype=np.uint8),
                    "label": g.integers(0, 4, n),
                    "error": np.array(["truncated image: test" if k in CORRUPT else "" for k in keys]),
                }
            )

    yield from rebatch(rows(), size)


def config(out: Path, **changes):
    # Mixup and CutMix draw on every micro-batch, the short ones too.
    return tiny_config(
        out=str(out), num_workers=2, batch_size=16, micro_batch_size=4, max_steps=11, log_every=1,
        checkpoint_every=100, prefetch_steps=2, mixup_alpha=0.8, cutmix_alpha=1.0,
    ).replace(**changes)  # fmt: skip


def _runs(rank: int, root: str) -> None:
    """A straight run, then the same run stopped at a step where a rank trained on nothing and resumed;
    rank 0 writes every step's (epoch, keys of each rank) and the summaries to ``root``/runs.json."""
    from pipeline.train import loop
    from pipeline.train.input import dataplan

    dataplan.micro_batches = uneven_micro_batches  # this process is the test's own
    steps: list[tuple[int, list[str]]] = []

    class Steps(loop.StepWatch):
        def taken(self, step):
            steps.append((step.epoch, list(step.keys)))

    def run(cfg) -> tuple[dict, list]:
        session = LocalSession(torch.device("cpu"), Path(cfg.run.out), rank, 2)
        loop_config = {"train": cfg.to_dict(), "shards": list(SIZES), "data_cpus_per_worker": 1.0}
        summary = loop.Trainer(loop_config, session, Steps()).train()
        dist.barrier()  # every rank's checkpoint files are in place before a resume reads them
        mine = list(steps)
        steps.clear()
        ranks: list = [None, None]
        dist.all_gather_object(ranks, mine)
        # One row per step: its epoch and the keys each rank trained on.
        return summary, [(r0[0], [r0[1], r1[1]]) for r0, r1 in zip(*ranks, strict=True)]

    out = Path(root)
    straight, straight_steps = run(config(out / "straight"))
    record = {"straight": straight_steps, "stop": None, "summaries": [_summary(straight)]}
    # The first step at which a rank trains on nothing, with more steps of its epoch after it.
    stop = next(
        (
            s + 1
            for s, (epoch, keys) in enumerate(straight_steps[:-1])
            if min(map(len, keys)) == 0 and straight_steps[s + 1][0] == epoch
        ),
        None,
    )
    if stop is not None:
        stopped = config(out / "stopped", stop_at_step=stop)
        _, first = run(stopped)
        resumed, second = run(stopped.replace(stop_at_step=None))
        record |= {"stop": stop, "stopped": first + second}
        record["summaries"].append(_summary(resumed))
    if rank == 0:
        (out / "runs.json").write_text(json.dumps(record))


def _summary(summary: dict) -> dict:
    return {k: summary[k] for k in ("bad_samples", "error")} | {"step": summary["metrics"]["step"]}


@pytest.mark.slow  # two ranks, three short runs: about 30 s of CPU
def test_every_good_sample_is_trained_once_an_epoch_and_a_resume_in_the_padded_tail_is_exact(tmp_path):
    spawn(_runs, str(tmp_path))
    record = json.loads((tmp_path / "runs.json").read_text())
    straight = record["straight"]
    assert len(straight) == 11
    epochs = collections.defaultdict(list)
    for epoch, keys in straight:
        epochs[epoch] += keys[0] + keys[1]
    complete = sorted(epochs)[:-1]  # the last epoch may have been cut by --max-steps
    assert len(complete) >= 2, sorted(epochs)
    for epoch in complete:
        # The multiset of keys: every good sample once, no corrupt one, none twice.
        assert collections.Counter(epochs[epoch]) == collections.Counter(GOOD), epoch
    # The epochs end in a tail of short steps: a rank short of a full step, then with nothing.
    sizes = [[len(k) for k in keys] for _, keys in straight]
    assert any(0 < min(s) < RANK_STEP for s in sizes) and any(min(s) == 0 < max(s) for s in sizes)

    # Stopped at a step where one rank trained on nothing, and resumed: the same keys, step by step
    # and rank by rank, the same bad-sample counts (the re-read not counted twice), the same weights.
    stop = record["stop"]
    assert stop is not None, "no step at which a rank idles with more steps of its epoch to come"
    assert min(map(len, straight[stop - 1][1])) == 0 and straight[stop][0] == straight[stop - 1][0]
    assert record["stopped"] == straight
    summary, resumed = record["summaries"]
    assert summary["error"] == resumed["error"] == "" and summary["step"] == resumed["step"] == 11
    assert resumed["bad_samples"] == summary["bad_samples"]
    assert_same_weights(config(tmp_path / "straight"), config(tmp_path / "stopped"), 11)
