"""Recorded runs the worker loop must keep reproducing (one process, gloo, no Ray; the fake streams of
`tests.train.test_loop` and `tests.train.test_sources`), in ``golden.json`` beside this file:

- ``losses``: the tiny preset's first 30 losses (one worker taking the preset's whole batch, a fixed
  stream of 8 shards x 40 samples, 10 classes: 5 steps an epoch), compared within `LOSS_RTOL`, so that a
  silent change of the numerics (an init, a mask, a schedule, a refactor of the loop) fails here;
- ``plain`` and ``mixed``: the keys each step of a plain ``--data`` run and of a run mixing two sources
  trained on, a sketch of their final weights (`sketch`, compared within `WEIGHTS_RTOL`), and the
  `TrainState` of a checkpoint taken mid-epoch. A run resumed from that recorded state (the form older
  checkpoints hold) must go on with the same keys at the same steps, and end with weights equal bit for
  bit to those of a straight run on the same machine.

The keys are exact on any machine. Weights are not: CPU kernels round differently
from one processor to the next (vector width, fused multiply-adds, the threads a reduction is split
over), so trained weights recorded on one machine are compared within a tolerance, and bitwise equality
is asked only between two runs on the same machine.

The keys and the resume are checked with each ``--data-process`` (``data_process``, tests/train/conftest.py):
the pipeline inline, and in a feeder process.

Record them again (only on purpose, when the numerics are meant to change) with
``python -m tests.train.test_golden`` and say why in the commit.
"""

from __future__ import annotations

import functools
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
from pipeline.train.input.cursor import same_stream, stream_fingerprint
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
# The final weights: the distance between the weights trained here and the recorded ones, over the
# recorded weights' norm (the whole model, every tensor flattened in name order), at most this. How it was
# chosen: the same runs on one Intel Xeon with AVX-512 under 1 and 2 threads, ATen's default kernels
# instead of its AVX-512 ones (ATEN_CPU_CAPABILITY=default), MKL's reproducible mode (MKL_CBWR=COMPATIBLE)
# and MKL and oneDNN held to SSE4 end 1.3e-6 to 2.9e-6 apart (relative), the largest element 4.3e-5 apart;
# a real change of the numerics moves them much further: the learning rate 1% higher 1.7e-4, one warmup
# step more 3.2e-3. 2e-5 sits between (7x the drift, 8x below a 1% change of the learning rate); a change
# smaller than that (the weight decay 1% higher: 4.6e-6) is the losses' to catch, not this.
WEIGHTS_RTOL = 2e-5
SKETCH_PROJECTIONS = 64  # the distance estimated from 64 random projections: within about 20%
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


def final_weights(cfg: TrainConfig) -> np.ndarray:
    """The model tensors of the run's last checkpoint, flattened in name order (float64)."""
    out = Path(cfg.run.out) / dcp.checkpoint_name(cfg.optim.max_steps)
    state = dcp.load_model_state(str(out), model_config(cfg))
    return np.concatenate([state[name].double().numpy().ravel() for name in sorted(state)])


def sketch(weights: np.ndarray) -> dict[str, Any]:
    """What ``golden.json`` keeps of a run's final weights: their norm and their projections onto
    `SKETCH_PROJECTIONS` fixed random vectors of +-1 (numpy's seeded generator: the same on every
    machine). Two sketches give the distance between the weights they were taken of (`distance`)."""
    rng = np.random.default_rng(0)
    signs = [rng.integers(0, 2, weights.size).astype(np.float64) * 2 - 1 for _ in range(SKETCH_PROJECTIONS)]
    return {"norm": float(np.linalg.norm(weights)), "projections": [float(s @ weights) for s in signs]}


def distance(now: dict[str, Any], recorded: dict[str, Any]) -> float:
    """The distance between two sketches' weights over the recorded weights' norm: for weights d apart,
    a projection on +-1 entries differs by a number of mean square |d|^2 (the Johnson-Lindenstrauss
    estimate)."""
    apart = np.subtract(now["projections"], recorded["projections"])
    return float(np.sqrt(np.mean(apart**2)) / recorded["norm"])


def loss_config(out: Path) -> TrainConfig:
    """The tiny preset on one worker (its whole batch: 64 = 2 x 32), a loss every step."""
    return PRESETS["tiny"]().replace(
        out=str(out), shards="unused", num_workers=1, max_steps=LOSS_STEPS, log_every=1,
        checkpoint_every=1000, shuffle_buffer=0,
    )  # fmt: skip


def data_of(kind: str, query: str = "") -> dict[str, Any]:
    """A run's shards (and sources); ``query``: each shard's URL signed with it (``?sig=...``)."""
    if kind == "plain":
        return {"shards": [url + query for url in test_loop.SHARDS]}
    mix = [{**s, "shards": [url + query for url in s["shards"]]} for s in test_sources.SOURCES]
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
    """The keys per step, the final weights and the state of the checkpoint at `MIDWAY`."""
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of(kind))
        seen = Seen()
        cfg = keys_config(kind, out).replace(data_process=data_process)
        run(cfg, device, data_of(kind), seen)
    state = json.loads((out / dcp.checkpoint_name(MIDWAY[kind]) / "train_state.json").read_text())
    return {"keys": seen.keys, "weights": final_weights(cfg), "midway_state": state}


@functools.cache
def straight_run(kind: str, data_process: str, device: torch.device, root: Path) -> dict[str, Any]:
    """`keys_run_now` once per kind and data process in this test session (the resume tests compare
    their weights with it, bit for bit)."""
    return keys_run_now(kind, device, root / f"straight-{kind}-{data_process}", data_process)


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def straight(world, tmp_path_factory):
    """`straight_run` of a kind and data process, under this module's temporary directory."""
    root = tmp_path_factory.mktemp("straight")
    return lambda kind, data_process: straight_run(kind, data_process, world, root)


def test_the_tiny_presets_first_30_losses_are_the_recorded_ones(world, golden, tmp_path):
    losses = losses_now(world, tmp_path / "run")
    assert len(losses) == LOSS_STEPS
    assert losses == pytest.approx(golden["losses"], rel=LOSS_RTOL)
    assert losses[-1] < losses[0]  # the recording is of a run that learns


@pytest.mark.parametrize("kind", ["plain", "mixed"])
def test_a_run_trains_the_recorded_keys_per_step_and_ends_within_reach_of_the_recorded_weights(
    golden, kind, data_process, straight
):
    now = straight(kind, data_process)
    assert now["keys"] == golden[kind]["keys"]
    apart = distance(sketch(now["weights"]), golden[kind]["weights"])
    assert apart <= WEIGHTS_RTOL, f"final weights {apart:.1e} of their norm from the recorded ones"


def test_a_one_percent_change_of_the_learning_rate_moves_the_weights_past_the_tolerance(
    world, golden, tmp_path
):
    """The tolerance is no blanket: the smallest change of the numerics it was chosen against fails it."""
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of("plain"))
        cfg = keys_config("plain", tmp_path / "run")
        run(cfg.replace(lr=cfg.optim.lr * 1.01), world, data_of("plain"))
    assert distance(sketch(final_weights(cfg)), golden["plain"]["weights"]) > 4 * WEIGHTS_RTOL


def resume_recorded(
    kind: str, device: torch.device, out: Path, data_process: str, signed: tuple[str, str] = ("", "")
) -> tuple[list[list[str]], np.ndarray]:
    """The checkpoint taken mid-epoch, its `TrainState` replaced by the recorded one (what the loop wrote
    when it was recorded), resumed: the keys of the steps after it, and the final weights. ``signed``: the
    query strings of the shards' URLs before the checkpoint and after it."""
    midway, recorded = MIDWAY[kind], json.loads(GOLDEN.read_text())[kind]
    cfg = keys_config(kind, out).replace(stop_at_step=midway, data_process=data_process)
    with pytest.MonkeyPatch.context() as mp:
        use_stream(mp, stream_of(kind))
        run(cfg, device, data_of(kind, signed[0]))
        written = json.loads((out / dcp.checkpoint_name(midway) / "train_state.json").read_text())
        # The stream fingerprint is of the shard names and the seed: its hash of the whole stream is the
        # recorded one (named parts follow it now; the recorded form, without them, still resumes exactly).
        stream = written["epoch_position"]["stream"]
        assert stream.split()[0] == recorded["midway_state"]["epoch_position"]["stream"]
        (out / dcp.checkpoint_name(midway) / "train_state.json").write_text(
            json.dumps(recorded["midway_state"])
        )
        seen = Seen()
        run(cfg.replace(stop_at_step=None), device, data_of(kind, signed[1]), seen)
    return seen.keys, final_weights(cfg)


@pytest.mark.parametrize("kind", ["plain", "mixed"])
def test_a_checkpoint_in_the_recorded_form_resumes_with_the_recorded_keys_and_the_straight_runs_weights(
    world, golden, tmp_path, kind, data_process, straight
):
    """Resumed at the sample: the recorded keys of the steps after the checkpoint, and the weights of a
    straight run here, bit for bit."""
    taken, weights = resume_recorded(kind, world, tmp_path / "run", data_process)
    assert taken == golden[kind]["keys"][MIDWAY[kind] :]
    assert np.array_equal(weights, straight(kind, data_process)["weights"])


@pytest.mark.parametrize("kind", ["plain", "mixed"])
def test_the_recorded_checkpoint_resumes_at_the_sample_with_its_shards_signed_again(
    world, golden, tmp_path, kind, straight
):
    """Shards read through signed URLs are named without the signature: a run taken with one signature,
    resumed from the recorded state with another (the first expired), trains the recorded keys on and
    ends with a straight run's weights."""
    taken, weights = resume_recorded(
        kind, world, tmp_path / "run", "inline", signed=("?se=2030&sig=first", "?se=2031&sig=second")
    )
    assert taken == golden[kind]["keys"][MIDWAY[kind] :]
    assert np.array_equal(weights, straight(kind, "inline")["weights"])


def test_the_recorded_checkpoint_is_of_the_shards_by_name_and_of_no_other_shards(golden):
    """What the recorded checkpoint resumes at the sample: its shards, signed or not; other shards (a
    renamed one, one more) start the epoch again, as they always did."""
    recorded = golden["plain"]["midway_state"]["epoch_position"]["stream"]
    data = keys_config("plain", Path("unused")).data

    def stream(shards: list[str]) -> str:
        return stream_fingerprint(shards, data.seed, data.shuffle_buffer)

    assert same_stream(recorded, stream(test_loop.SHARDS))
    assert same_stream(recorded, stream([f"{url}?sv=2024&sig=abc%2Fdef" for url in test_loop.SHARDS]))
    assert same_stream(recorded, stream([f"mem://user:pw@{url[6:]}" for url in test_loop.SHARDS]))
    assert not same_stream(recorded, stream([*test_loop.SHARDS[:3], "mem://shard-9"]))
    assert not same_stream(recorded, stream([*test_loop.SHARDS, "mem://shard-4"]))


def record(root: Path) -> None:
    """Writes `GOLDEN` from the loop as it is now."""
    from pipeline.train.step.model import init_distributed

    _, _, device = init_distributed()
    golden = {"losses": losses_now(device, root / "losses")}
    for kind in ("plain", "mixed"):
        now = keys_run_now(kind, device, root / kind)
        golden[kind] = {
            "keys": now["keys"],
            "weights": sketch(now["weights"]),
            "midway_state": now["midway_state"],
        }
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        record(Path(tmp))
