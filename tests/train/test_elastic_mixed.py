"""Mixed sources resumed at another world size, by sample (`pipeline.train.input.source_position`): the worker
loop in-process, ranks as processes (gloo), over `tests.train.test_elastic`'s stand-in for the Ray Data
pipeline, whose keys name the pass they were read in (``@`` and the epoch number of the pass).

Arithmetic: ``big`` (weight 0.7) is 8 shards of 16 to 20 samples (144, 2 corrupt), ``small`` (0.3) 4
shards of 5 to 7 (24, 1 corrupt). Batch 24 of micro-batches of 2. With 4 workers a worker's part is
about 36 big and 6 small samples: ``big`` runs out after about 51 places and ``small`` after about 20.
So with ``cycle`` ``big`` ends the epoch (about 9 steps) and ``small`` is cycled through two passes or
more meanwhile; with ``end`` ``small`` ends it (3 to 4 steps). The stops fall inside epoch 0: with ``cycle``
after ``small``'s first pass is over on some workers, with ``end`` before any worker ran out.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from pipeline import dcp
from pipeline.data.mixture import pass_epoch
from pipeline.train.state import TrainState
from tests.distributed import spawn
from tests.train.test_elastic import _run, bad_at_epoch_ends, config, epochs
from tests.train.test_loop import LocalSession

BIG = {f"mem://big/shard-{i}": n for i, n in enumerate((18, 16, 20, 17, 19, 16, 20, 18))}
SMALL = {f"mem://small/shard-{i}": n for i, n in enumerate((6, 5, 7, 6))}
MIX = [
    {"name": "big", "weight": 0.7, "shards": list(BIG)},
    {"name": "small", "weight": 0.3, "shards": list(SMALL)},
]
CORRUPT = {"mem://big/shard-1/3", "mem://big/shard-6/19", "mem://small/shard-2/6"}  # one last of its shard
GOOD = {
    name: sorted(f"{url}/{i}" for url, n in sizes.items() for i in range(n) if f"{url}/{i}" not in CORRUPT)
    for name, sizes in (("big", BIG), ("small", SMALL))
}
DATA = (MIX, {**BIG, **SMALL}, CORRUPT)
PASSES = {pass_epoch(epoch, p): p for epoch in range(4) for p in range(40)}  # a pass's epoch number -> pass


def by_pass(keys: list[str]) -> dict[str, collections.Counter]:
    """Per source, how often each (sample, pass) was trained."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for key in keys:
        sample, tag = key.rsplit("@", 1)
        out[sample.split("/")[2]][(sample, PASSES[int(tag)])] += 1
    return out


def first_pass(counts: collections.Counter) -> list[str]:
    return sorted(sample for (sample, p), n in counts.items() for _ in range(n) if p == 0)


def runs(tmp_path, before: int, after: int, exhausted: str, stop: int) -> dict[str, dict]:
    """A straight run and one stopped at ``stop`` on ``before`` workers, resumed on ``after``."""
    mode = {"source_exhausted": exhausted, "max_steps": 12}
    stopped = {"dir": "stopped", "stop_at_step": stop, **mode}
    spawn(
        _run, before, str(tmp_path), [("straight", dict(mode)), ("stopped", stopped)], DATA, world_size=before
    )
    resumed = {"dir": "stopped", "num_workers": after, **mode}
    spawn(_run, after, str(tmp_path), [("resumed", resumed)], DATA, world_size=after)
    return {
        name: json.loads((tmp_path / f"{name}.json").read_text())
        for name in ("straight", "stopped", "resumed")
    }


@pytest.mark.slow  # fewer ranks cycling, more ranks ending: each mode and each direction once
@pytest.mark.parametrize(("before", "after", "exhausted", "stop"), [(4, 2, "cycle", 4), (2, 3, "end", 2)])
def test_mixed_sources_resumed_with_other_workers_train_each_sample_of_each_pass_once(
    tmp_path, capfd, before, after, exhausted, stop
):
    read = runs(tmp_path, before, after, exhausted, stop)
    assert [r["error"] for r in read.values()] == ["", "", ""]
    stopped, resumed = read["stopped"], read["resumed"]
    assert len(stopped["steps"]) == stop and {e for e, *_ in stopped["steps"]} == {0}
    assert "the workers share the samples this epoch had not consumed, each once" in capfd.readouterr().out
    saved = TrainState.from_dict(
        json.loads((tmp_path / "stopped" / dcp.checkpoint_name(stop) / "train_state.json").read_text())
    )
    position = saved.epoch_consumed["sources"]
    assert set(position) == {"big", "small"} and position["big"]["passes"]["0"]["partial"], position

    straight = {e: by_pass(keys) for e, keys in epochs(read["straight"]).items()}
    elastic = {e: by_pass(keys) for e, keys in epochs(stopped, resumed).items()}
    assert 0 in elastic and 1 in elastic  # epoch 0 is complete: the run went on into epoch 1
    epoch, reference = elastic[0], straight[0]
    # No sample of a source's pass trained twice in the epoch, at either layout.
    for counts in (*epoch.values(), *reference.values()):
        assert max(counts.values()) == 1, counts.most_common(3)
    bad = bad_at_epoch_ends(stopped, resumed, per_source=True)[0]
    if exhausted == "cycle":
        # ``big`` ends the epoch: its one pass trained as a straight run's, every good sample once.
        assert first_pass(epoch["big"]) == first_pass(reference["big"]) == GOOD["big"]
        assert {p for _, p in epoch["big"]} == {0}
        # ``small``: its first pass was complete before the stop; its second was begun by some workers,
        # and the rest of it was dealt to the new ones, none read again.
        assert first_pass(epoch["small"]) == first_pass(reference["small"]) == GOOD["small"]
        assert {p for _, p in epoch["small"]} >= {0, 1}
        assert bad["big"] == 2  # each corrupt sample of the defining pass counted once
    else:
        # ``small`` ends the epoch: every good sample of it once, as a straight run; ``big`` is not cycled.
        assert first_pass(epoch["small"]) == first_pass(reference["small"]) == GOOD["small"]
        assert {p for c in epoch.values() for _, p in c} == {0}
        assert set(first_pass(epoch["big"])) < set(GOOD["big"])
        assert bad["small"] == 1


def test_the_real_pipeline_goes_on_by_sample_with_mixed_sources(
    world, ray_session, synthetic_shards, monkeypatch, tmp_path, capfd
):
    """The same through Ray Data (read, decode, a shuffle buffer holding each source whole): ``big``, 3
    shards of 12 (weight 0.7), ``small``, 1 shard of 12 (0.3), ``end``; batch 8, stopped at step 2 with
    micro-batches of 4, resumed with micro-batches of 2. Epoch 0 trains no sample twice, and all of the
    source that ended it."""
    from pipeline.train import loop

    urls = synthetic_shards.urls
    mix = [
        {"name": "big", "weight": 0.7, "shards": urls[:3]},
        {"name": "small", "weight": 0.3, "shards": urls[3:]},
    ]
    steps: list = []

    class Steps(loop.StepWatch):
        def taken(self, step):
            steps.append((step.epoch, list(step.keys)))

    stopped = config(tmp_path, 1, batch_size=8, micro_batch_size=4, max_steps=8, stop_at_step=2)
    stopped = stopped.replace(source_exhausted="end")
    for cfg in (stopped, stopped.replace(stop_at_step=None, micro_batch_size=2)):
        session = LocalSession(world, Path(cfg.run.out))
        loop_config = {"train": cfg.to_dict(), "shards": urls, "sources": mix, "data_cpus_per_worker": 1.0}
        assert loop.Trainer(loop_config, session, Steps()).train()["error"] == ""
    saved = json.loads((tmp_path / dcp.checkpoint_name(2) / "train_state.json").read_text())
    assert set(saved["epoch_consumed"]["sources"]) == {"big", "small"}
    assert "the workers share the samples this epoch had not consumed, each once" in capfd.readouterr().out
    epoch = collections.Counter(k for e, keys in steps if e == 0 for k in keys)
    assert {e for e, _ in steps} == {0, 1} and max(epoch.values()) == 1
    big = {k for k in epoch if k in set(synthetic_shards.keys[:36])}  # written in order, 12 a shard
    assert len(big) == 36 or len(epoch) - len(big) == 12, (len(big), len(epoch))
