"""Mixed sources over two ranks (processes, FSDP2 over gloo, the fake streams of `tests.train.test_sources`):
each rank draws its own places and reads its own slice of each source; a run stopped mid-epoch and resumed
trains on the keys of a straight run, rank by rank and step by step, and ends with its weights and counts.

Arithmetic: per rank, ``big`` is 2 shards (16 good samples) and ``small`` 1 shard (5 good); micro-batch 4,
batch 16 (2 micro-batches a rank step): an epoch (cycle) is about 23 samples a rank, 3 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.configs import tiny_config
from tests.distributed import spawn
from tests.train.test_loop import LocalSession, assert_same_weights
from tests.train.test_sources import SOURCES, fake_micro_batches, source_of

STEPS, STOP = 8, 5  # the stop falls mid-way through the second epoch


def config(out: Path, **changes):
    return tiny_config(
        out=str(out), num_workers=2, batch_size=16, micro_batch_size=4, max_steps=STEPS, log_every=1,
        checkpoint_every=100, prefetch_steps=2,
    ).replace(**changes)  # fmt: skip


def _runs(rank: int, root: str) -> None:
    """A straight run, then the same run stopped at `STOP` and resumed; rank 0 writes every step's keys
    of each rank, the summaries and the last metrics rows to ``root``/runs.json."""
    from pipeline.train import loop
    from pipeline.train.input import dataplan

    dataplan.micro_batches = fake_micro_batches  # this process is the test's own
    steps: list[list[str]] = []

    class Keys(loop.StepWatch):
        def taken(self, step):
            steps.append(list(step.keys))

    def run(cfg) -> tuple[dict, list, dict]:
        session = LocalSession(torch.device("cpu"), Path(cfg.run.out), rank, 2)
        shards = [url for s in SOURCES for url in s["shards"]]
        loop_config = {
            "train": cfg.to_dict(),
            "shards": shards,
            "sources": SOURCES,
            "data_cpus_per_worker": 1.0,
        }
        summary = loop.Trainer(loop_config, session, Keys()).train()
        dist.barrier()  # every rank's checkpoint files are in place before a resume reads them
        ranks: list = [None, None]
        dist.all_gather_object(ranks, list(steps))
        steps.clear()
        rows = [list(pair) for pair in zip(*ranks, strict=True)]
        return summary, rows, (session.reports or [{}])[-1]

    out = Path(root)
    straight, straight_steps, straight_row = run(config(out / "straight"))
    stopped = config(out / "stopped", stop_at_step=STOP)
    _, first, _ = run(stopped)
    resumed, second, resumed_row = run(stopped.replace(stop_at_step=None))
    if rank == 0:
        keep = ("bad_samples", "error")
        record = {
            "straight": straight_steps,
            "stopped": first + second,
            "summaries": [{k: s[k] for k in keep} for s in (straight, resumed)],
            "rows": [straight_row.get("sources"), resumed_row.get("sources")],
        }
        (out / "runs.json").write_text(json.dumps(record))


def test_a_mixed_run_over_two_ranks_stopped_and_resumed_trains_on_the_keys_of_a_straight_run(tmp_path):
    spawn(_runs, str(tmp_path))
    record = json.loads((tmp_path / "runs.json").read_text())
    straight = record["straight"]
    assert len(straight) == STEPS
    assert record["stopped"] == straight  # rank by rank, step by step, place by place
    first = [source_of(k) for keys in straight[0] for k in keys]
    assert set(first) == {"big", "small"}
    # In the first step the ranks read disjoint slices of each source's shards.
    first_shards = [{k.rsplit("/", 1)[0] for k in straight[0][rank]} for rank in (0, 1)]
    assert not first_shards[0] & first_shards[1]
    a, b = record["summaries"]
    assert a["error"] == b["error"] == "" and a["bad_samples"] == b["bad_samples"]
    assert record["rows"][0] == record["rows"][1] and set(record["rows"][0]) == {"big", "small"}
    assert_same_weights(config(tmp_path / "straight"), config(tmp_path / "stopped"), STEPS)
