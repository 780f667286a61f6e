"""Metrics sinks: TensorBoard event files and a W&B run hold what metrics.jsonl holds (no Ray, no network)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pipeline.train.config import TrainConfig
from pipeline.train.observe.metrics import MetricsLog
from pipeline.train.observe.sinks import TENSORBOARD_DIR, SinkedLog, attach, run_id, scalars


def row(step: int) -> dict:
    """A metrics.jsonl row as the worker loop writes it (mfu is None on CPU)."""
    return {
        "step": step,
        "epoch": step // 20,
        "loss": 2.5 - step / 100,
        "accuracy": step / 100,
        "lr": 1e-3 * step / 40,
        "grad_norm": 1.25,
        "images_per_s": 300.0 + step,
        "images_per_s_per_worker": 150.0 + step / 2,
        "mfu": None,
        "data_wait_share": 0.25,
        "samples_seen": 64 * step,
        "bad_samples": 0,
        "memory_gib": 0.5,
        "time": 1.8e9 + step,
        "goodput": {"productive_share": 0.5, "lost_s": 2.0 + step, "attempt": 0},
    }


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from every event file under ``logdir``: TFRecord framing (length,
    its CRC, payload, its CRC) around `Event` protos, read with tensorboardX's own proto classes."""
    from tensorboardX.proto.event_pb2 import Event

    found: dict[str, dict[int, float]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event files in {logdir}"
    for path in files:
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found


def test_scalars_take_every_number_but_the_step_and_time_and_name_a_fields_own():
    values = scalars(row(20))
    assert "train/step" not in values and "train/mfu" not in values  # the x-axis; no value on CPU
    assert "train/time" not in values  # a wall-clock time is no metric
    expected = {k for k, v in row(20).items() if k not in ("step", "time") and isinstance(v, float | int)}
    nested = {f"train/goodput/{k}" for k in row(20)["goodput"]}
    assert set(values) == {f"train/{k}" for k in expected} | nested
    assert values["train/goodput/lost_s"] == 22.0
    assert values["train/lr"] == pytest.approx(5e-4) and values["train/images_per_s"] == 320.0


def test_tensorboard_event_files_hold_every_logged_scalar(tmp_path):
    config = TrainConfig().replace(shards="x", out=str(tmp_path / "run"), max_steps=40, tensorboard=True)
    log = attach(MetricsLog(config.run.out), config)
    assert isinstance(log, SinkedLog)
    for step in (10, 20, 30, 40):
        log.append(row(step), flush=step % 20 == 0)
    assert [r["step"] for r in log.rows] == [10, 20, 30, 40]  # metrics.jsonl is still written

    found = read_scalars(tmp_path / "run" / TENSORBOARD_DIR)
    assert set(found) == set(scalars(row(10)))
    for step in (10, 20, 30, 40):
        for tag, value in scalars(row(step)).items():
            assert found[tag][step] == pytest.approx(value, rel=1e-6), (tag, step)


def test_a_probe_landing_after_the_last_row_reaches_its_row_and_tensorboard_at_its_step(tmp_path):
    config = TrainConfig().replace(
        shards="x",
        out=str(tmp_path / "run"),
        max_steps=40,
        tensorboard=True,
        probe_data="a",
        probe_eval_data="b",
    )
    log = attach(MetricsLog(config.run.out), config)
    for step in (20, 40):
        log.append(row(step), flush=True)
    # The last checkpoint's probe lands after its row: a probed run's sinks stay open for it until `close`.
    assert log.amend(40, {"probe_accuracy": 0.75, "knn_accuracy": 0.5, "probe_error": None})
    assert not log.amend(30, {"probe_accuracy": 0.5})  # no row at that step: nothing written
    log.close()
    stored = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert stored[1] == {**row(40), "probe_accuracy": 0.75, "knn_accuracy": 0.5, "probe_error": None}
    found = read_scalars(tmp_path / "run" / TENSORBOARD_DIR)
    assert found["train/probe_accuracy"] == {40: 0.75} and found["train/knn_accuracy"] == {40: 0.5}


def test_no_sink_asked_for_leaves_the_log_as_it_is(tmp_path):
    log = MetricsLog(str(tmp_path / "run"))
    assert attach(log, TrainConfig().replace(shards="x", out=str(tmp_path / "run"))) is log


def test_wandb_offline_run_records_the_scalars(tmp_path, monkeypatch, capsys):
    import wandb  # noqa: F401  (the wandb extra: `make test` installs it)

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # the sink's own dir must win
    out = tmp_path / "run"
    config = TrainConfig().replace(shards="x", out=str(out), max_steps=20, wandb="vitray-test")
    log = attach(MetricsLog(config.run.out), config)
    for step in (10, 20):  # the last step closes the run
        log.append(row(step), flush=False)

    runs = list((out / "wandb").glob(f"offline-run-*-{run_id(str(out))}"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    line = f"W&B run {run_id(str(out))}: offline in {runs[0]} (upload it with `wandb sync`)"
    assert line in capsys.readouterr().out.splitlines()
    records = next(runs[0].glob("*.wandb")).read_bytes()
    for tag in scalars(row(10)):
        assert tag.encode() in records, tag


def test_wandb_without_the_package_is_a_one_line_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"--wandb needs the wandb package: pip install"):
        TrainConfig().replace(shards="x", out="y", wandb="p").validate()
