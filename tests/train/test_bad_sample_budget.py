"""Training over corrupt samples, on 2 ranks without Ray: each worker holds its own bad-sample budget,
a run that passes it ends in one line, and the counts of a run that stays within it reach the log line,
`metrics.jsonl` and the summary.

Two processes (gloo) run the worker loop (`pipeline.train.loop.Trainer`) with a local session standing
in for Ray Train and in-memory shards standing in for the read tasks: the rows go through the real
`micro_batches` (bad-sample filter, budget checks, rebatching), only `build_dataset` is replaced.

Arithmetic: 2 shards x 16 samples, micro-batch 4, batch 8 (one micro-batch per rank per step).
- Within budget (0.2): one shard's first 2 samples are corrupt -> that rank has 14 good samples, 3 full
  micro-batches, so each epoch is 3 steps and its first step's input has read both shards whole.
  Logged at steps 3 and 6: 32 and 64 samples read, 2 and 4 bad (12.5% of that rank's, within 20%).
- A lost shard (no sample at all): the run stops in one line naming it, none being allowed.
- Over budget (0.6): one shard's first 10 samples are corrupt. That rank's share is 10 of 16 (62.5%);
  over both ranks it would be 10 of 32 (31%), within the budget. The run stops when that rank's pass
  ends, after the one step its 6 good samples make.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLES_PER_SHARD = 16
CORRUPT = {"mem://mixed": 2, "mem://corrupt": 10}  # shard -> its first N samples are corrupt
RUNS = {
    "within": (["mem://clean-a", "mem://mixed"], 0.2),
    "over": (["mem://clean-b", "mem://corrupt"], 0.6),
    "lost": (["mem://clean-c", "mem://lost"], 0.2),  # a shard that gives no sample: none allowed
}


class InMemoryDataset:
    """What `micro_batches` uses of a Ray dataset: its context and `iter_batches` (one batch per shard)."""

    def __init__(self, shards: list[str], image_size: int, patch_size: int):
        self.shards, self.image_size, self.patch_size = shards, image_size, patch_size
        self.context = types.SimpleNamespace(execution_options=types.SimpleNamespace())

    def iter_batches(self, **_):
        import numpy as np

        n, patches = SAMPLES_PER_SHARD, (self.image_size // self.patch_size) ** 2
        for url in self.shards:
            if url == "mem://lost":  # what `read_shard` gives for a shard of zeros
                yield {
                    "key": np.array([""]),
                    "url": np.array([url]),
                    "patches": np.zeros((1, patches, self.patch_size**2 * 3), dtype=np.uint8),
                    "label": np.array([-1]),
                    "error": np.array(["lost shard: the tar holds no samples"], dtype=object),
                }
                continue
            bad = CORRUPT.get(url, 0)
            g = np.random.default_rng(len(url))
            yield {
                "key": np.array([f"{url}/{i}" for i in range(n)]),
                "url": np.array([url] * n),
                "patches": g.integers(0, 256, (n, patches, self.patch_size**2 * 3), dtype=np.uint8),
                "label": g.integers(0, 4, n),
                "error": np.array(["undecodable image: test"] * bad + [""] * (n - bad), dtype=object),
            }


def worker(root: str) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): both runs, summaries to a JSON file."""
    from pipeline.data import dataset
    from pipeline.train import loop
    from pipeline.train.config import TrainConfig
    from pipeline.train.step.model import init_distributed
    from tests.train.test_loop import LocalSession

    dataset.build_dataset = lambda shards, config, **_: InMemoryDataset(
        shards, config.image_size, config.patch_size
    )
    rank, world, device = init_distributed()
    summaries = {}
    for name, (shards, budget) in RUNS.items():
        out = Path(root) / name
        config = TrainConfig().replace(
            model="vit_tiny_test", image_size=32, num_classes=4, shards="unused", out=str(out),
            batch_size=8, micro_batch_size=4, num_workers=world, use_gpu=False, warmup_steps=1,
            max_steps=6, log_every=3, checkpoint_every=6, max_bad_fraction=budget,
        )  # fmt: skip
        loop_config = {"train": config.to_dict(), "shards": shards, "data_cpus_per_worker": 1.0}
        summaries[name] = loop.Trainer(loop_config, LocalSession(device, out, rank, world)).train()
    Path(root, f"rank{rank}.json").write_text(json.dumps(summaries))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the runs' root, rank 0's summaries of both runs, rank 0's console)."""
    root = tmp_path_factory.mktemp("budget")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"from tests.train.test_bad_sample_budget import worker; worker({str(root)!r})"
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True,
            )
        )  # fmt: skip
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:  # a rank that died leaves the other waiting in a collective
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return root, json.loads((root / "rank0.json").read_text()), outputs[0]


def test_counts_of_a_run_within_its_budget_reach_the_log_metrics_and_summary(runs):
    from pipeline.train.config import TrainConfig
    from pipeline.train.driver import format_summary

    root, summaries, console = runs
    summary = summaries["within"]
    assert summary["error"] == "" and summary["metrics"]["step"] == 6
    assert (root / "within" / "final" / "weights.safetensors").is_file()
    rows = [json.loads(line) for line in (root / "within" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["samples_seen"], r["bad_samples"]) for r in rows] == [(3, 32, 2), (6, 64, 4)]
    logged = [line for line in console.splitlines() if line.startswith("step ")][:2]
    assert [line.split(" | ")[0] for line in logged] == ["step 3/6 (50%)", "step 6/6 (100%)"]
    assert ["bad samples 2" in logged[0], "bad samples 4" in logged[1]] == [True, True]
    # The summary merges both ranks' counts, and the driver prints them.
    bad = summary["bad_samples"]
    assert (bad["total"], bad["bad"], bad["by_reason"]) == (64, 4, {"undecodable image": 4})
    assert {e["key"] for e in bad["examples"]} == {"mem://mixed/0", "mem://mixed/1"}
    printed = format_summary(summary, TrainConfig().replace(shards="unused", out=str(root / "within")))
    assert "samples read: 64, skipped as bad: 4 (4 undecodable image)" in printed


def test_one_worker_over_its_own_budget_stops_the_run_in_one_line(runs, capsys):
    from pipeline import cli
    from pipeline.train.driver import TrainingError

    root, summaries, _ = runs
    summary = summaries["over"]
    error = summary["error"]
    # The corrupt shard's rank: 10 of its 16 samples, though the run's share is 10 of 32.
    assert error.startswith("10 of 16 samples are bad (62.5% > max_bad_fraction 60.0%): 10 undecodable image")
    assert "first: mem://corrupt key 'mem://corrupt/0'" in error and "\n" not in error
    assert (summary["bad_samples"]["total"], summary["bad_samples"]["bad"]) == (32, 10)
    assert not (root / "over" / "final").exists()

    def fit():  # what `driver.fit` raises for such a summary, and how a job shows it
        raise TrainingError(error)

    assert cli.run_job(fit, failures=(TrainingError,)) == cli.EXIT_RUN_FAILED
    assert capsys.readouterr().err == f"error: {error}\n"


def test_a_lost_shard_stops_the_run_in_one_line_naming_it_and_counts_no_bad_sample(runs):
    _, summaries, _ = runs
    summary = summaries["lost"]
    assert summary["error"] == (
        "1 shard(s) gave no readable sample (max_lost_shards 0): mem://lost (the tar holds no samples); "
        "replace or remove them, or raise max_lost_shards"
    )
    assert summary["bad_samples"]["bad"] == 0 and summary["bad_samples"]["lost_shards"] == {
        "mem://lost": "the tar holds no samples"
    }
