"""Sources mixed by weight in the worker loop (one process, gloo, no Ray; the fake streams of
`tests.train.test_loop`): the draw's shares, per-source counts in metrics rows, an exact resume.

Arithmetic: source ``big`` is 4 shards x 9 samples, ``small`` 2 shards x 6, each shard's first sample
corrupt: 32 and 10 good samples. Micro-batch 4, batch 8. At weights 0.7 / 0.3 an epoch (``cycle``: every
source once, ``small`` cycled meanwhile) is about 46 samples, 6 steps; ``end`` stops it when ``small``
runs out, at about 33 samples.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from pipeline import dcp
from pipeline.data.dataset import rebatch
from pipeline.data.shards import ShardError, shard_id
from pipeline.train import driver, loop
from pipeline.train.input import dataplan
from pipeline.train.observe.metrics import format_line
from pipeline.train.presets import PRESETS
from tests.train.test_loop import LocalSession, Seen, assert_same_weights, config

SOURCES = [
    {"name": "big", "weight": 0.7, "shards": [f"mem://big/shard-{i}" for i in range(4)]},
    {"name": "small", "weight": 0.3, "shards": [f"mem://small/shard-{i}" for i in range(2)]},
]
SIZES = {"big": 9, "small": 6}


def fake_micro_batches(shards, data_config, *, epoch, rank, size, bad_samples, data_cpus, root=None):
    """`pipeline.data.dataset.micro_batches` without Ray: a shard's rows are a pure function of (shard,
    epoch); its first sample is corrupt."""
    patches = (data_config.image_size // data_config.patch_size) ** 2
    patch_dim = data_config.patch_size**2 * 3

    def rows():
        for url in map(shard_id, shards):  # rows name their shard without a query string, as real rows do
            n = SIZES[url.split("/")[2]]
            g = np.random.default_rng([zlib.crc32(url.encode()), epoch % 2**32])
            batch = {
                "key": np.array([f"{url}/{i}" for i in range(n)]),
                "url": np.array([url] * n),
                "patches": g.integers(0, 256, (n, patches, patch_dim), dtype=np.uint8),
                "label": g.integers(0, 4, n),
                "error": np.array(["truncated image: test"] + [""] * (n - 1), dtype=object),
            }
            yield bad_samples.filter(batch)

    yield from rebatch(rows(), size)


@pytest.fixture
def mixed_data(monkeypatch):
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)


def run(cfg, device, mix=SOURCES, watch=None):
    session = LocalSession(device, Path(cfg.run.out))
    shards = [url for s in mix for url in s["shards"]]
    loop_config = {"train": cfg.to_dict(), "shards": shards, "sources": mix, "data_cpus_per_worker": 1.0}
    return loop.Trainer(loop_config, session, watch).train(), session


def source_of(key: str) -> str:
    return key.split("/")[2]


@pytest.mark.parametrize("stop_at", [3, 7])  # mid-epoch 0; mid-epoch 1
def test_a_mixed_run_stopped_and_resumed_trains_on_the_samples_of_a_straight_run(
    world, mixed_data, monkeypatch, tmp_path, stop_at
):
    seen = Seen()
    straight = config(tmp_path / "straight", max_steps=10)
    summary, session = run(straight, world, watch=seen)
    straight_keys = seen.clear()
    assert len(straight_keys) == 10

    stopped = config(tmp_path / "stopped", max_steps=10, stop_at_step=stop_at)
    run(stopped, world, watch=seen)
    resumed, resumed_session = run(stopped.replace(stop_at_step=None), world, watch=seen)
    assert seen.keys == straight_keys  # the same samples, step by step, in the same places
    assert resumed["bad_samples"] == summary["bad_samples"]  # per source too: the re-read not counted twice
    assert summary["bad_samples"]["sources"]["small"]["bad"] > 0
    assert resumed_session.reports[-1]["sources"] == session.reports[-1]["sources"]
    assert_same_weights(straight, stopped, 10)


def test_metrics_rows_and_the_log_line_say_where_the_run_is_in_each_source(
    world, mixed_data, monkeypatch, tmp_path
):
    seen = Seen()
    cfg = config(tmp_path / "run", max_steps=12)
    run(cfg, world, watch=seen)
    trained = [k for keys in seen.keys for k in keys]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]["sources"]
    assert set(last) == {"big", "small"}
    assert last["big"]["weight"] == pytest.approx(0.7) and last["small"]["weight"] == pytest.approx(0.3)
    for name in ("big", "small"):  # samples taken: those trained (an epoch's last step is short)
        assert last[name]["samples"] == sum(source_of(k) == name for k in trained)
    assert last["small"]["share"] == pytest.approx(0.3, abs=0.12)
    # 12 steps of 8 cross an epoch; small is cycled within one (its second pass).
    assert rows[-1]["epoch"] == 1 and any(row["sources"]["small"]["pass"] == 2 for row in rows)
    assert last["small"]["bad"] >= 2 and rows[-1]["bad_samples"] == last["big"]["bad"] + last["small"]["bad"]
    line = format_line(rows[-1], 12, 0.0, 0)
    assert "big " in line and "/70% pass" in line and "small " in line


def test_with_cycle_the_small_source_repeats_within_an_epoch_with_end_it_ends_the_epoch(
    world, mixed_data, monkeypatch, tmp_path
):
    epochs: dict[str, list[tuple[int, list[str]]]] = {}
    for mode in ("cycle", "end"):
        seen = Seen()
        run(config(tmp_path / mode, max_steps=8, source_exhausted=mode), world, watch=seen)
        epochs[mode] = [(step.epoch, list(step.keys)) for step in seen.steps]
    for mode, steps in epochs.items():
        first = [k for epoch, keys in steps if epoch == 0 for k in keys]
        small = [k for k in first if source_of(k) == "small"]
        big = [k for k in first if source_of(k) == "big"]
        if mode == "cycle":  # every big sample once; small ones twice or more
            assert len(big) == len(set(big)) == 32 and len(small) > len(set(small)) == 10
        else:  # no sample twice; small whole, big not
            assert len(first) == len(set(first)) and len(set(small)) == 10 and len(big) < 32


def test_a_resume_with_other_weights_starts_the_epoch_again_and_says_so(
    world, mixed_data, monkeypatch, tmp_path, capsys
):
    stopped = config(tmp_path / "run", stop_at_step=2)
    run(stopped, world)
    other = [dict(SOURCES[0], weight=0.5), dict(SOURCES[1], weight=0.5)]
    run(stopped.replace(stop_at_step=None), world, mix=other)
    assert "it was taken with other source weights" in capsys.readouterr().out
    assert dcp.latest_complete(tmp_path / "run") is not None


def test_the_driver_expands_and_checks_each_source_before_any_cluster_work(synthetic_shards, tmp_path):
    urls = synthetic_shards.urls
    base = PRESETS["tiny"]().replace(out=str(tmp_path / "run"), num_workers=2)
    spec = f"a={urls[0]},{urls[1]}:0.7,b={urls[2]},{urls[3]}:0.3"
    shards, mix = driver.prepare_data(base.replace(data=spec))
    assert shards == urls and [(s["name"], s["weight"], s["shards"]) for s in mix] == [
        ("a", 0.7, urls[:2]),
        ("b", 0.3, urls[2:]),
    ]
    assert driver.prepare_data(base.replace(data=synthetic_shards.dir)) == (urls, None)  # one plain source
    with pytest.raises(ValueError, match=r"^2 shard\(s\) of source a for 4 workers: every worker needs"):
        driver.prepare_data(base.replace(data=spec, num_workers=4, micro_batch_size=16))
    with pytest.raises(ShardError, match=r"^source b: shard not found: .*/b .*; check the path"):
        driver.prepare_data(base.replace(data=f"a={synthetic_shards.dir}:1,b={tmp_path / 'b/'}:1"))
    with pytest.raises(ValueError, match=r"weight 0\.0 must be a positive number"):
        driver.prepare_data(base.replace(data=f"a={synthetic_shards.dir}:0"))


def test_the_driver_refuses_sources_that_share_shards_naming_them(synthetic_shards):
    # The same shards in two sources trained their samples twice an epoch, with the same crops.
    urls = synthetic_shards.urls
    base = PRESETS["tiny"]().replace(out="unused", num_workers=2)
    spec = f"a={synthetic_shards.dir}:0.5,b={urls[1]},{urls[3]}:0.5"  # b's shards are also a's
    with pytest.raises(ValueError) as error:
        driver.prepare_data(base.replace(data=spec))
    assert str(error.value) == (
        f"sources a and b both read 2 shard(s) ({urls[1]}, {urls[3]}): their samples would train twice an "
        "epoch; give each shard to one source (a larger weight trains a source more often)"
    )


def test_the_next_epochs_mixed_input_starts_ahead_and_trains_what_input_built_in_step_trains(
    world, mixed_data, monkeypatch, tmp_path
):
    seen, started = Seen(), []
    real = dataplan.MixedSources.epoch_input

    def epoch_input(plan, epoch, cursor, *, ahead):
        last = seen.steps[-1] if seen.steps else None
        started.append((epoch, ahead is not None, last and (last.epoch, last.step)))
        return real(plan, epoch, cursor, ahead=ahead)

    monkeypatch.setattr(dataplan.MixedSources, "epoch_input", epoch_input)
    run(config(tmp_path / "ahead", max_steps=12, prefetch_steps=3), world, watch=seen)
    # epoch 1's input started from epoch 0's final counts, while epoch 0's last steps trained
    epoch_1 = next(when for epoch, ahead, when in started if epoch == 1)
    assert (1, True) in [(epoch, ahead) for epoch, ahead, _ in started]
    assert epoch_1[0] == 0 and epoch_1[1] < max(s.step for s in seen.steps if s.epoch == 0)
    ahead = seen.clear()
    run(config(tmp_path / "inline", max_steps=12, prefetch_steps=0), world, watch=seen)
    assert seen.keys == ahead
    assert_same_weights(
        config(tmp_path / "ahead", max_steps=12), config(tmp_path / "inline", max_steps=12), 12
    )


def test_the_deal_type_says_what_the_cursor_deals():
    """`dataplan.Deal` stands for `EpochCursor.deal`: the same parameters, defaults and return type."""
    import inspect

    from pipeline.train.input.cursor import EpochCursor

    deal = inspect.signature(EpochCursor.deal)
    typed = inspect.signature(dataplan.Deal.__call__)
    assert list(deal.parameters.values())[1:] == list(typed.parameters.values())[1:]
    assert deal.return_annotation == typed.return_annotation
