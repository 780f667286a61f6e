"""``--num-workers MIN-MAX``, an elastic group, without Ray: the flag's two forms, the global batch checked
at every size before any cluster work, the counts that must hold for the largest group, what Ray Train is
given, and the log line of a group resumed at another size (the multi-node run: tests/system/
test_multinode.py)."""

from __future__ import annotations

import argparse

import pytest

from pipeline.train import driver
from pipeline.train.checkpointing.checkpoint import resize_line
from pipeline.train.config import TrainConfig
from pipeline.train.sections import worker_count
from pipeline.train.state import TrainState
from tests.configs import tiny_config
from tests.job_scripts import load_job


def test_a_number_is_a_fixed_group_and_min_max_an_elastic_one():
    assert worker_count("8") == 8
    assert worker_count("2-8") == (2, 8)
    assert worker_count("4-4") == 4  # MIN = MAX: the fixed group it is
    for bad in ("two", "2-", "2-8-9", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not N or MIN-MAX"):
            worker_count(bad)


def test_the_range_travels_through_the_command_line_and_the_saved_config(tmp_path, capsys):
    pretrain = load_job("pretrain")
    args = ["--preset", "tiny", "--data", "x", "--out", str(tmp_path / "run"), "--print-config"]
    assert pretrain.main([*args, "--num-workers", "1-4", "--batch-size", "384"]) == 0  # 32 x lcm(1..4)
    printed = capsys.readouterr().out
    config = TrainConfig.from_dict(__import__("json").loads(printed))
    assert config.cluster.num_workers == (1, 4)
    assert (config.cluster.min_workers, config.cluster.max_workers) == (1, 4)
    assert pretrain.main([*args, "--num-workers", "3", "--batch-size", "96"]) == 0  # a number stays a number
    assert '"num_workers": 3' in capsys.readouterr().out


def test_a_batch_that_some_size_of_the_range_cannot_split_is_refused_with_the_sizes_that_work():
    # Micro-batch 8 over 2, 3 or 4 workers: 48 splits over 2 and 3, not over 4.
    config = tiny_config(num_workers=(2, 4), micro_batch_size=8, batch_size=48)
    with pytest.raises(ValueError) as refused:
        config.validate()
    message = str(refused.value)
    assert "\n" not in message
    assert "--batch-size 48 with --micro-batch-size 8 does not split over 4 worker(s)" in message
    assert "(it does over 2, 3)" in message
    assert "pick a multiple of 96 (e.g. 96, 192), or narrow the range" in message  # 8 x lcm(2, 3, 4)
    config.replace(batch_size=96).validate()  # the size it names works at every size
    assert [config.replace(batch_size=96).accumulation(n) for n in (2, 3, 4)] == [6, 4, 3]
    # A wide range: the sizes listed in short, and no batch of astronomical size suggested.
    wide = tiny_config(num_workers=(64, 128), micro_batch_size=32, batch_size=4096)
    with pytest.raises(ValueError) as refused:
        wide.validate()
    message = str(refused.value)
    assert "does not split over 65, 66, 67, 68, 69, 70, ... (63 in all) worker(s)" in message, message
    assert "(it does over 64, 128); " in message and "pick a multiple" not in message
    assert message.endswith("narrow the range to sizes that split it")
    # A fixed group keeps its message.
    with pytest.raises(ValueError, match="is not a multiple of --micro-batch-size x --num-workers = 32"):
        tiny_config(num_workers=4, micro_batch_size=8, batch_size=48).validate()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_workers": (3, 2)}, "--num-workers 3-2 must be N or MIN-MAX with 1 <= MIN <= MAX"),
        ({"num_workers": (0, 2)}, "--num-workers 0-2 must be N or MIN-MAX"),
        ({"num_workers": 0}, "--num-workers must be from 1 to 65,536, got 0"),
        (
            {"num_workers": (2, 4), "batch_size": 96, "shard_group_size": 2},
            "--shard-group-size 2 does not divide --num-workers 2-4 at every size",
        ),
    ],
)
def test_a_range_that_cannot_run_is_one_line(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        tiny_config(micro_batch_size=8, **changes).validate()


def test_counts_that_must_hold_for_every_size_take_the_largest(monkeypatch):
    config = tiny_config(num_workers=(1, 3), batch_size=48)
    assert driver.local_cpus_needed(config) == 3 + 2 * 3
    # Fewer shards than the largest group: refused before any cluster work.
    monkeypatch.setattr(driver, "expand_shards", lambda location: ["a.tar", "b.tar"])
    monkeypatch.setattr(driver, "check_shards", lambda shards, data: None)
    monkeypatch.setattr(driver, "check_out", lambda config: None)
    monkeypatch.setattr(driver, "check_resumable", lambda config: None)
    with pytest.raises(ValueError, match=r"^2 shard\(s\) for 3 workers: every worker needs at least one"):
        driver.prepare_data(config)
    assert driver.prepare_data(config.replace(num_workers=(1, 2), batch_size=16))[0] == ["a.tar", "b.tar"]


def test_ray_train_gets_the_range_and_the_check_interval_only_for_an_elastic_run(monkeypatch):
    monkeypatch.setenv(driver.RESIZE_CHECK_ENV, "2.5")
    assert driver.resize_check(tiny_config(num_workers=(1, 3), batch_size=24)) == {
        "elastic_resize_monitor_interval_s": 2.5
    }
    assert driver.resize_check(tiny_config(num_workers=3, batch_size=24)) == {}
    monkeypatch.delenv(driver.RESIZE_CHECK_ENV)
    assert driver.resize_check(tiny_config(num_workers=(1, 3), batch_size=24)) == {}


def test_a_resize_is_one_line_from_the_checkpoints_size_to_the_new_one():
    config = tiny_config(num_workers=(1, 3), batch_size=48, micro_batch_size=8)
    assert resize_line(config, 3, 2, 12) == (
        "workers: from 3 to 2 (1 lost: a node left or a worker died); resuming at step 12, the batch kept "
        "at 48 = 2 x 8 x 3 accumulation (was x 2)"
    )
    assert resize_line(config, 2, 3, 14).startswith("workers: from 2 to 3 (room for 1 more: nodes joined)")
    fixed = tiny_config(num_workers=4, batch_size=64, micro_batch_size=8)
    assert "(--num-workers changed)" in resize_line(fixed, 2, 4, 5)
    # The size that saved a checkpoint: its position's layout, else its one count per rank.
    assert TrainState(epoch_position={"world": 3}).world == 3
    assert TrainState(bad_samples=[{}, {}]).world == 2
    assert TrainState().world is None
