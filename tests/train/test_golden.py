"""Recorded runs the worker loop must keep reproducing (one process, gloo, no Ray; the fake streams of
`tests.train.test_loop` and `tests.train.test_sources`), in ``golden.json`` beside this file:

- ``losses``: the tiny preset's first 30 losses (one worker taking the preset's whole batch, a fixed
  stream of 8 shards x 40 samples, 10 classes: 5 steps an epoch), compared within `LOSS_RTOL`, so that a
  silent change of the numerics (an init, a mask, a schedule, a refactor of the loop) fails here;
- ``plain`` and ``mixed``: the keys each step of a plain ``--data`` run and of a run mixing two sources
  trained on, the sha256 of their final weights, and the `TrainState` of a checkpoint taken mid-epoch.
  A run resumed from that recorded state (the form older checkpoints hold) must go on with the same
  keys at the same steps and end with the same weights.

The keys and the resume are checked with each ``--data-process`` (``data_process``, tests/train/conftest.py):
the pipeline inline, and in a feeder process.

Record them again (only on purpose, when the numerics are meant to change) with
``python -m tests.train.test_golden`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import dcp
from pipeline.data.dataset import rebatch
from pipeline.train import loop
from pipeline.train.config import TrainConfig
from pipeline.train.input import dataplan
from pipeline.train.presets import PRESETS
from pipeline.train.step.model import model_config
from tests.train import test_loop, test_sources
from tests.train.test_loop import LocalSession, Seen

GOLDEN = Path(__file__).with_name("golden.json")
# Relative, per step: CPU kernels may round differently on another machine, far below what a change of
# the numerics moves (a step of the schedule, an init: percents).
LOSS_RTOL = 1e-3
LOSS_STEPS = 30
LOSS_SHARDS = [f"mem://golden/shard-{i}" for i in range(8)]
LOSS_SAMPLES = 40
MIDWAY = {"plain": 6, "mixed": 4}  # a checkpoint inside an epoch (plain: 4 steps an epoch; mixed: 6)


def golden_micro_batches(shards, data_config, *, epoch, rank, size, bad_samples, data_cpus, root=None):
    """A fixed stream without Ray: a shard's rows (patches, and labels of 10 classes) are a pure
    function of (shard, epoch); every tenth sample is corrupt."""
    patches = (data_config.image_size // data_config.patch_size) ** 2
    patch_dim = data_config.patch_size**2 * 3

    def rows():
        for url in shards:
            g = np.random.default_rng([int(url.rsplit("-", 1)[1]), epoch])
            n = LOSS_SAMPLES
            labels = g.integers(0, 10, n)
            # A learnable signal: the class sets the brightness of the first patch.
            pixels = g.integers(0, 128, (n, patches, patch_dim), dtype=np.uint8)
            pixels[:, 0, :] += (labels * 12).astype(np.uint8)[:, None]
            yield bad_samples.filter(
                {
                    "key": np.array([f"{url}/{i}" for i in range(n)]),
                    "url": np.array([url] * n),
                    "patches": pixels,
                    "label": labels,
                    "error": np.array(["truncated image: test" if i % 10 == 9 else "" for i in range(n)]),
                }
            )

    yield from rebatch(rows(), size)


def use_stream(mp: pytest.MonkeyPatch, stream: Any) -> None:
    """A fake stream in place of Ray Data's."""
    mp.setattr(dataplan, "micro_batches", stream)


def stream_of(kind: str) -> Any:
    return test_loop.fake_micro_batches if kind == "plain" else test_sources.fake_micro_batches


def run(
    cfg: TrainConfig, device: torch.device, data: dict[str, Any], watch: loop.StepWatch | None = None
) -> dict[str, Any]:
    loop_config = {"train": cfg.to_dict(), **data, "data_cpus_per_worker": 1.0}
    session = LocalSession(device, Path(cfg.run.out))
    summary = loop.Trainer(loop_config, session, watch).train()
    assert summary["error"] == ""
    return {"summary": summary, "reports": session.reports}


def weights_sha(cfg: TrainConfig, step: int) -> str:
    """sha256 over the checkpoint's model tensors at ``step``, by name."""
    state = dcp.load_model_state(str(Path(cfg.run.out) / dcp.checkpoint_name(step)), model_config(cfg))
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def loss_config(out: Path) -> TrainConfig:
    """The tiny preset on one worker (its whole batch: 64 = 2 x 32), a loss every step."""
    return PRESETS["tiny"]().replace(
        out=str(out), shards="unused", num_workers=1, max_steps=LOSS_STEPS, log_every=1,
        checkpoint_every=1000, shuffle_buffer=0,
    )  # fmt: skip


def data_of(kind: str) -> dict[str, Any]:
    if kind == "plain":
        return {"shards": test_loop.SHARDS}
    mix = test_sources.SOURCES
    return {"shards": [url for s in mix for url in s["shards"]], "sources": mix}


def keys_config(kind: str, out: Path) -> TrainConfig:
    """`tests.train.test_loop.config`: 8 steps (plain) or 10 (mixed) of two micro-batches of 4."""
    steps = 8 if kind == "plain" else 10
    return test_loop.config(out, max_steps=steps, checkpoint_every=2, prefetch_steps=2)


def losses_now(device: torch.device, out: Path) -> list[float]:
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, golden_micro_batches)
        cfg = loss_config(out)
        reports = run(cfg, device, {"shards": LOSS_SHARDS})["reports"]
    return [row["loss"] for row in reports]


def keys_run_now(kind: str, device: torch.device, out: Path, data_process: str = "inline") -> dict[str, Any]:
    """The keys per step, the final weights' sha and the state of the checkpoint at `MIDWAY`."""
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of(kind))
        seen = Seen()
        cfg = keys_config(kind, out).replace(data_process=data_process)
        run(cfg, device, data_of(kind), seen)
    state = json.loads((out / dcp.checkpoint_name(MIDWAY[kind]) / "train_state.json").read_text())
    return {"keys": seen.keys, "weights_sha256": weights_sha(cfg, cfg.optim.max_steps), "midway_state": state}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def test_the_tiny_presets_first_30_losses_are_the_recorded_ones(world, golden, tmp_path):
    losses = losses_now(world, tmp_path / "run")
    assert len(losses) == LOSS_STEPS
    assert losses == pytest.approx(golden["losses"], rel=LOSS_RTOL)
    assert losses[-1] < losses[0]  # the recording is of a run that learns


@pytest.mark.parametrize("kind", ["plain", "mixed"])
def test_a_run_trains_the_recorded_keys_per_step_and_ends_with_the_recorded_weights(
    world, golden, tmp_path, kind, data_process
):
    now = keys_run_now(kind, world, tmp_path / "run", data_process)
    assert now["keys"] == golden[kind]["keys"]
    assert now["weights_sha256"] == golden[kind]["weights_sha256"]


@pytest.mark.parametrize("kind", ["plain", "mixed"])
def test_a_checkpoint_in_the_recorded_form_resumes_with_the_recorded_keys_and_weights(
    world, golden, tmp_path, kind, data_process
):
    """The checkpoint taken mid-epoch, its `TrainState` replaced by the recorded one (what the loop wrote
    when it was recorded), resumes at the sample: the recorded keys of the steps after it, the same weights."""
    midway, recorded = MIDWAY[kind], golden[kind]
    out = tmp_path / "run"
    cfg = keys_config(kind, out).replace(stop_at_step=midway, data_process=data_process)
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of(kind))
        run(cfg, world, data_of(kind))
        written = json.loads((out / dcp.checkpoint_name(midway) / "train_state.json").read_text())
        # The stream fingerprint is of the shard names and the seed: its hash of the whole stream is the
        # recorded one (named parts follow it now; the recorded form, without them, still resumes exactly).
        stream = written["epoch_position"]["stream"]
        assert stream.split()[0] == recorded["midway_state"]["epoch_position"]["stream"]
        (out / dcp.checkpoint_name(midway) / "train_state.json").write_text(
            json.dumps(recorded["midway_state"])
        )
        seen = Seen()
        run(cfg.replace(stop_at_step=None), world, data_of(kind), seen)
    assert seen.keys == recorded["keys"][midway:]
    assert weights_sha(cfg, cfg.optim.max_steps) == recorded["weights_sha256"]


def record(root: Path) -> None:
    """Writes `GOLDEN` from the loop as it is now."""
    from pipeline.train.step.model import init_distributed

    _, _, device = init_distributed()
    golden = {"losses": losses_now(device, root / "losses")}
    for kind in ("plain", "mixed"):
        golden[kind] = keys_run_now(kind, device, root / kind)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        record(Path(tmp))
