"""The worker loop in one process (a world of one, gloo), without Ray: a local session stands in for
Ray Train and a fake stream of patch rows for the Ray Data pipeline, so a whole run takes seconds.

Arithmetic: 4 shards x 9 samples, one of them corrupt -> 32 good samples an epoch; micro-batch 4,
batch 8 -> exactly 4 steps an epoch, so step 4 is an epoch edge.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline import dcp
from pipeline.data.config import shard_order
from pipeline.data.dataset import rebatch
from pipeline.data.masking import mask_batch
from pipeline.data.shards import shard_id
from pipeline.train import loop
from pipeline.train.checkpointing import lease, saver
from pipeline.train.config import TrainConfig
from pipeline.train.input import dataplan
from pipeline.train.state import TrainState
from pipeline.train.step.model import model_config
from pipeline.train.step.train_step import StepStats, TrainStep
from tests.configs import tiny_config
from tests.native_rows import as_native
from tests.train.test_audit import audited, sized

SHARDS = [f"mem://shard-{i}" for i in range(4)]
SAMPLES_PER_SHARD = 9
FAKE_KEYS = sized(
    dict.fromkeys(SHARDS, SAMPLES_PER_SHARD)
)  # the keys of the shards `fake_micro_batches` reads
# What a run measures rather than computes (mfu: images/s over the GPU's peak; None on CPU; time and
# goodput: the row's wall-clock time and the account of the run's time then).
TIMINGS = (
    "images_per_s", "images_per_s_per_worker", "data_wait_share", "memory_gib", "checkpoint_stall_s", "gc_s",
    "run_images_per_s", "rank_step_s", "mfu", "time", "goodput",
)  # fmt: skip


def config(out: Path, **changes) -> TrainConfig:
    """The tiny config, 8 steps of 2 micro-batches, writing under ``out``."""
    return tiny_config(
        out=str(out), micro_batch_size=4, max_steps=8, log_every=2, checkpoint_every=4
    ).replace(**changes)


def fake_micro_batches(shards, data_config, *, epoch, rank, size, bad_samples, data_cpus, root=None):
    """`pipeline.data.dataset.micro_batches` without Ray: each shard's rows are a pure function of
    (shard, epoch), and the shard's first sample is corrupt; native-aspect rows where the config asks."""
    mcfg_patches = (data_config.image_size // data_config.patch_size) ** 2
    patch_dim = data_config.patch_size**2 * 3

    def rows():
        for url in map(shard_id, shards):  # rows name their shard without a query string, as real rows do
            g = np.random.default_rng([int(url.rsplit("-", 1)[1]), epoch])
            n = SAMPLES_PER_SHARD
            batch = {
                "key": np.array([f"{url}/{i}" for i in range(n)]),
                "url": np.array([url] * n),
                "patches": g.integers(0, 256, (n, mcfg_patches, patch_dim), dtype=np.uint8),
                "label": g.integers(0, 4, n),
                "error": np.array(["truncated image: test"] + [""] * (n - 1), dtype=object),
            }
            if data_config.native:  # native-aspect images (`tests.native_rows`), masked for MAE there
                batch = as_native(batch, data_config, epoch)
            elif data_config.mask_ratio is not None:  # MAE: the data stage's mask, as the real pipeline
                batch = mask_batch(batch, config=data_config, epoch=epoch)
            yield bad_samples.filter(batch)

    yield from rebatch(rows(), size)


class LocalSession:
    """Ray Train's part, without Ray: every rank's checkpoint files are merged into one directory under
    the run directory, and the latest complete one is resumed from."""

    node_id = "local"

    def __init__(self, device: torch.device, run_dir: Path, rank: int = 0, world: int = 1):
        self.device, self.run_dir, self.rank, self.world = device, run_dir, rank, world
        self.reports: list[dict] = []

    @contextlib.contextmanager
    def resume_from(self):
        latest = dcp.latest_complete(self.run_dir) if self.run_dir.exists() else None
        yield None if latest is None else (Path(latest.local_path), latest.url)

    def report(self, metrics, checkpoint_dir=None, name="", written=None):
        self.reports.append(metrics)
        if written is not None:  # an asynchronous save: its files are whole once DCP has written them
            written.result()
        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, self.run_dir / name, dirs_exist_ok=True)


@pytest.fixture
def fake_data(monkeypatch):
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)


def patch_nan_loss(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """The loss of those (0-based) optimizer steps becomes NaN."""
    current = {}
    real_passes, real_loss = TrainStep.forward_backward, torch.nn.functional.cross_entropy

    def forward_backward(self, step, micro_batches, global_count, **kwargs):
        current["step"] = step
        return real_passes(self, step, micro_batches, global_count, **kwargs)

    def loss(logits, labels, **kwargs):
        value = real_loss(logits, labels, **kwargs)
        return value * float("nan") if current["step"] in steps else value

    monkeypatch.setattr(TrainStep, "forward_backward", forward_backward)
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", loss)


class Seen(loop.StepWatch):
    """What the loop's watch sees of every step, in order, across every run it watches: each step's
    input (`loop.TakenStep`) and, once its update is queued, its stats."""

    def __init__(self) -> None:
        self.steps: list[loop.TakenStep] = []
        self.stats: dict[int, StepStats] = {}

    def taken(self, step: loop.TakenStep) -> None:
        self.steps.append(step)

    def trained(self, step: int, stats: StepStats) -> None:
        self.stats[step] = stats

    @property
    def keys(self) -> list[list[str]]:
        """The keys of the samples each step trained on."""
        return [list(step.keys) for step in self.steps]

    def clear(self) -> list[list[str]]:
        """The keys so far (`keys`), forgotten here."""
        keys = self.keys
        self.steps.clear()
        self.stats.clear()
        return keys


def run(
    cfg: TrainConfig, device: torch.device, watch: loop.StepWatch | None = None
) -> tuple[dict, LocalSession]:
    session = LocalSession(device, Path(cfg.run.out))
    loop_config = {"train": cfg.to_dict(), "shards": SHARDS, "data_cpus_per_worker": 1.0}
    return loop.Trainer(loop_config, session, watch).train(), session


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def weights(cfg: TrainConfig, step: int) -> dict[str, torch.Tensor]:
    return dcp.load_model_state(str(Path(cfg.run.out) / dcp.checkpoint_name(step)), model_config(cfg))


def assert_same_weights(a: TrainConfig, b: TrainConfig, step: int) -> None:
    """Runs ``a`` and ``b`` saved the same model weights at ``step``, tensor by tensor."""
    wa, wb = weights(a, step), weights(b, step)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def straight_and_resumed(world, tmp_path_factory):
    """A straight 8-step run, and the same run stopped at step 4 (an epoch edge) and resumed; in both,
    step 1's loss is NaN (skipped), so a skipped-step count has to carry over the resume too."""
    root = tmp_path_factory.mktemp("loop")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dataplan, "micro_batches", fake_micro_batches)
        patch_nan_loss(mp, {1})
        straight = config(root / "straight")
        runs = {"straight": run(straight, world)}
        stopped = config(root / "stopped", stop_at_step=4)
        runs["stopped"] = run(stopped, world)
        runs["resumed"] = run(stopped.replace(stop_at_step=None), world)
    return straight, stopped, runs


def test_a_run_stopped_at_an_epoch_edge_and_resumed_ends_equal_to_a_straight_run(
    straight_and_resumed, tmp_path
):
    straight, stopped, runs = straight_and_resumed
    summary, session = runs["straight"]
    assert summary["error"] == "" and summary["metrics"]["step"] == 8
    assert [r["step"] for r in session.reports] == [2, 4, 6, 8]
    assert [r["epoch"] for r in session.reports] == [0, 0, 1, 1]
    first, _ = runs["stopped"]
    assert first["metrics"]["step"] == 4
    resumed, session = runs["resumed"]
    assert [r["step"] for r in session.reports] == [6, 8]
    assert_same_weights(straight, stopped, 8)
    assert resumed["metrics"]["loss"] == summary["metrics"]["loss"]


# 32 good samples: one micro-batch of 32 for a step of two; two micro-batches for a step of 40, one short.
@pytest.mark.parametrize("batch_size, micro_batch_size", [(64, 32), (40, 20)])
def test_too_little_data_for_one_step_stops_with_one_line(
    world, fake_data, tmp_path, batch_size, micro_batch_size
):
    cfg = config(tmp_path / "run", batch_size=batch_size, micro_batch_size=micro_batch_size)
    summary, _ = run(cfg, world)
    assert summary["error"].startswith(f"epoch 0 gave no full step: 4 shards hold fewer than {batch_size}")
    assert not (tmp_path / "run" / "final").exists()


def test_run_totals_continue_across_a_resume(straight_and_resumed):
    _, _, runs = straight_and_resumed
    (straight, session), (resumed, resumed_session) = runs["straight"], runs["resumed"]
    # 2 epochs x 4 shards x 9 samples, one corrupt per shard; the resumed run read only epoch 1.
    assert straight["bad_samples"]["total"] == 72 and straight["bad_samples"]["bad"] == 8
    assert resumed["bad_samples"] == straight["bad_samples"]
    # The resumed run's rows are the straight run's rows of steps 6 and 8, timings aside.
    assert untimed(resumed_session.reports) == untimed(session.reports[2:])
    assert resumed["metrics"]["skipped_steps"] == 1 and resumed["metrics"]["samples_seen"] == 72


def test_a_non_finite_loss_skips_its_step_and_the_run_goes_on(world, fake_data, monkeypatch, tmp_path):
    patch_nan_loss(monkeypatch, {2})  # the third step, inside the window logged at step 4
    cfg = config(tmp_path / "run")
    summary, session = run(cfg, world)
    assert summary["error"] == ""
    assert [r["skipped_steps"] for r in session.reports] == [0, 1, 1, 1]
    assert all(np.isfinite(r["loss"]) for r in session.reports)  # the skipped step's loss left out
    assert all(torch.isfinite(v).all() for v in weights(cfg, 4).values())


def test_too_many_skipped_steps_in_a_row_stop_the_run_without_saving_nan(
    world, fake_data, monkeypatch, tmp_path
):
    patch_nan_loss(monkeypatch, set(range(2, 100)))
    cfg = config(tmp_path / "run", max_skipped_steps=3)
    summary, session = run(cfg, world)
    # Steps 3-6 are skipped; the count is read at step 6's log line (--log-every 2), which stops the run.
    assert summary["error"].startswith("4 steps in a row (up to step 6) had a non-finite loss")
    assert "--max-skipped-steps 3" in summary["error"] and "\n" not in summary["error"]
    assert [r["step"] for r in session.reports] == [2, 4]
    # Step 4's checkpoint came after two skipped steps: it holds step 2's weights, all finite.
    assert all(torch.isfinite(v).all() for v in weights(cfg, 4).values())
    assert not (tmp_path / "run" / "final").exists()


def test_weights_that_are_not_finite_are_never_checkpointed(world, fake_data, monkeypatch, tmp_path):
    real_update = TrainStep.update

    def poisoning_update(self, gradients):
        stats = real_update(self, gradients)
        if gradients.step == 2:  # an update that went wrong without a non-finite gradient
            with torch.no_grad():
                next(self.model.parameters()).to_local()[0] = float("inf")
        return stats

    monkeypatch.setattr(TrainStep, "update", poisoning_update)
    summary, _ = run(config(tmp_path / "run"), world)
    assert summary["error"].startswith("the weights hold NaN or inf at step 4 and were not saved")
    assert not (tmp_path / "run" / dcp.checkpoint_name(4)).exists()


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_checkpoint_is_saved_between_the_next_steps_backward_and_its_update(
    world, fake_data, monkeypatch, tmp_path, asynchronous
):
    """A checkpoint every 2 of 8 steps, 4 an epoch: checkpoints 2 and 6 are saved between the two calls
    of steps 3 and 7, their gradients in and their updates not made (the device runs that step's forward
    and backward while the host saves); 4, at the epoch's edge, before the next epoch's first step; 8, the
    last step's, at once. Each row is written before its save. What the checkpoints hold is each step's
    own state (the resume tests: the same weights as a straight run)."""
    events: list = []
    real_passes, real_update, real_start = TrainStep.forward_backward, TrainStep.update, saver.Saver.start

    def forward_backward(self, step, micro_batches, global_count, **kwargs):
        if not getattr(self, "watched", False):
            self.optimizer.register_step_pre_hook(lambda *_: events.append("update"))
            self.watched = True
        events.append(("step", step + 1))
        return real_passes(self, step, micro_batches, global_count, **kwargs)

    def update(self, gradients):
        stats = real_update(self, gradients)
        events.append("returned")
        return stats

    def start(self, metrics, train_state, config, **kwargs):
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        grads = all(p.grad is not None for p in self.model.parameters())
        events.append(("save", train_state["step"], json.loads(rows[-1])["step"], grads))
        return real_start(self, metrics, train_state, config, **kwargs)

    monkeypatch.setattr(TrainStep, "forward_backward", forward_backward)
    monkeypatch.setattr(TrainStep, "update", update)
    monkeypatch.setattr(saver.Saver, "start", start)
    summary, _ = run(config(tmp_path / "run", checkpoint_every=2, async_checkpoint=asynchronous), world)
    assert summary["error"] == ""
    inside = lambda n: [("step", n + 1), ("save", n, n, True), "update", "returned"]  # noqa: E731
    plain = lambda n: [("step", n), "update", "returned"]  # noqa: E731
    assert events == [
        *plain(1), *plain(2), *inside(2), *plain(4), ("save", 4, 4, False),
        *plain(5), *plain(6), *inside(6), *plain(8), ("save", 8, 8, False),
    ]  # fmt: skip


def test_workers_stop_writing_once_another_run_has_taken_the_run_directory_over(
    world, fake_data, monkeypatch, tmp_path
):
    # The workers of a killed driver trained ~8 more steps into --out while a rerun resumed there.
    cfg = config(tmp_path / "run")
    held = lease.acquire(cfg.run_dir)
    real_update = TrainStep.update

    def update_then_taken_over(self, gradients):
        stats = real_update(self, gradients)
        if gradients.step == 2:  # a rerun takes --out over (its driver is this live process)
            record = {**held.record(), "run": "rerun"}
            (tmp_path / "run" / lease.LEASE).write_text(json.dumps(record))
        return stats

    monkeypatch.setattr(TrainStep, "update", update_then_taken_over)
    session = LocalSession(world, Path(cfg.run.out))
    loop_config = {"train": cfg.to_dict(), "shards": SHARDS, "data_cpus_per_worker": 1.0, "lease": held.run}
    summary = loop.Trainer(loop_config, session).train()
    assert summary["error"].startswith(f"the lease on {tmp_path / 'run'} was taken over by run rerun (pid ")
    assert summary["error"].endswith("this run stops and writes nothing more there")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2]  # step 4's row, checkpoint and final/ never written
    assert not (tmp_path / "run" / dcp.checkpoint_name(4)).exists()
    assert not (tmp_path / "run" / "final").exists()


def test_train_state_reads_checkpoints_written_before_its_newer_fields():
    old = {"step": 8, "epoch": 1, "shards_started": ["a"], "seed": 3, "from_the_future": 1}
    state = TrainState.from_dict(old)
    assert (state.step, state.epoch, state.seed) == (8, 1, 3)
    assert state.skipped_steps == 0 and state.bad_samples == [] and state.epoch_position == {}
    assert TrainState.from_dict(state.to_dict()) == state


@pytest.mark.parametrize("stop_at", [2, 7])  # half-way through epoch 0; one step before epoch 1 ends
def test_a_run_stopped_mid_epoch_and_resumed_trains_on_the_samples_of_a_straight_run(
    world, fake_data, monkeypatch, tmp_path, stop_at
):
    seen = Seen()
    straight = config(tmp_path / "straight", prefetch_steps=2)
    summary, _ = run(straight, world, seen)
    straight_keys = seen.clear()
    assert (
        len(straight_keys) == 8 and len({k for step in straight_keys for k in step}) == 32
    )  # 4 steps an epoch

    stopped = config(tmp_path / "stopped", prefetch_steps=2, stop_at_step=stop_at)
    run(stopped, world, seen)
    state = json.loads((tmp_path / "stopped" / dcp.checkpoint_name(stop_at) / "train_state.json").read_text())
    position = {"world": 1, "micro_batch_size": 4, "micro_batches": 2 * (stop_at % 4)}
    assert {k: v for k, v in state["epoch_position"].items() if k != "stream"} == position
    resumed, _ = run(stopped.replace(stop_at_step=None), world, seen)
    assert seen.keys == straight_keys  # every sample of both epochs exactly once, in the same order
    assert resumed["bad_samples"] == summary["bad_samples"]  # the re-read part not counted twice
    assert_same_weights(straight, stopped, 8)
    report = audited(tmp_path / "stopped", SHARDS, FAKE_KEYS)  # the run's ledger says so too
    assert report.ok and report.lines[0] == "epoch 0: finished, 36 samples (4 bad): every one once", (
        report.format()
    )


def test_a_resume_at_another_micro_batch_size_starts_the_epoch_again_and_says_so(
    world, fake_data, monkeypatch, tmp_path, capsys
):
    seen = Seen()
    stopped = config(tmp_path / "run", stop_at_step=2)
    run(stopped, world, seen)
    summary, _ = run(stopped.replace(stop_at_step=None, micro_batch_size=2), world, seen)
    assert (
        "taken with 1 workers x micro-batch 4, so this epoch's data starts again" in capsys.readouterr().out
    )
    assert seen.keys[2] == seen.keys[0]  # step 3 trains on what step 1 did: the epoch began again
    # After the stop, epoch 0 whole (steps 3-6: 4 shards, 4 bad) and half of epoch 1 (steps 7-8: 2
    # shards, 2 bad): the 2 shards read before the stop are not counted a second time.
    assert (summary["bad_samples"]["bad"], summary["bad_samples"]["total"]) == (6, 54), summary["bad_samples"]
    # A run that exits 0 having trained samples twice: its audit names the shards read twice in epoch 0.
    report = audited(tmp_path / "run", SHARDS, FAKE_KEYS)
    first_two = sorted(shard_order(SHARDS, stopped.run.seed, 0)[:2])  # what steps 1 and 2 read
    assert [f.text() for f in report.findings] == [
        f"epoch 0: shard {url}: 17 counted (1 bad) of 9: 8 repeated" for url in first_two
    ]


def test_input_built_ahead_on_a_thread_trains_exactly_like_input_built_by_the_step(
    world, fake_data, tmp_path
):
    inline = config(tmp_path / "inline", max_steps=6, prefetch_steps=0)
    ahead = config(tmp_path / "ahead", max_steps=6, prefetch_steps=3)
    (a, a_session), (b, b_session) = run(inline, world), run(ahead, world)
    assert untimed(a_session.reports) == untimed(b_session.reports)  # losses, accuracy, grad norms
    assert a["bad_samples"] == b["bad_samples"]
    assert_same_weights(inline, ahead, 6)


def test_an_mae_run_stopped_mid_epoch_and_resumed_ends_equal_to_a_straight_run(world, fake_data, tmp_path):
    mae = {
        "objective": "mae",
        "label_key": None,
        "decoder_dim": 32,
        "decoder_depth": 1,
        "decoder_num_heads": 4,
    }
    straight = config(tmp_path / "straight", **mae)
    _, session = run(straight, world)
    stopped = config(tmp_path / "stopped", stop_at_step=6, **mae)
    run(stopped, world)
    resumed, resumed_session = run(stopped.replace(stop_at_step=None), world)
    assert resumed["metrics"]["step"] == 8 and resumed["metrics"]["accuracy"] is None
    # The rows after the resume are the straight run's: reconstruction losses and gradient norms.
    assert untimed(resumed_session.reports) == untimed(session.reports[3:])
    assert all(r["loss"] > 0 and r["accuracy"] is None for r in session.reports)
    a, b = (load_file(Path(c.run.out) / "final" / "weights.safetensors") for c in (straight, stopped))
    assert a.keys() == b.keys() and not any(name.startswith("decoder") for name in a)  # the encoder alone
    for name in a:
        assert torch.equal(a[name], b[name]), name


class _Exploit:
    """Unpickling it runs ``touch <sentinel>``: the sentinel's absence proves nothing ran."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_a_crafted_checkpoint_stops_the_resume_in_one_line_and_runs_nothing(
    world, fake_data, monkeypatch, tmp_path
):
    """The worker's entry point reads the run's latest checkpoint without trusting it: a crafted
    ``.metadata`` becomes the run's one-line error, returned (not raised: Ray Train would restart the
    workers into the same refusal), and the command in it never runs."""
    stopped = config(tmp_path / "run", stop_at_step=2, checkpoint_every=2)
    run(stopped, world)
    latest = tmp_path / "run" / dcp.checkpoint_name(2)
    sentinel = tmp_path / "pwned"
    (latest / dcp.METADATA).write_bytes(pickle.dumps(_Exploit(sentinel)))

    monkeypatch.setattr(loop, "RaySession", lambda run_dir: LocalSession(world, tmp_path / "run"))
    loop_config = {
        "train": stopped.replace(stop_at_step=None).to_dict(),
        "shards": SHARDS,
        "data_cpus_per_worker": 1.0,
    }
    summary = loop.train_loop_per_worker(loop_config)
    assert "refusing to unpickle it; remove that checkpoint" in summary["error"]
    assert "\n" not in summary["error"] and not sentinel.exists()
    assert not (tmp_path / "run" / dcp.checkpoint_name(4)).exists()


def test_a_compiled_run_with_activation_checkpointing_trains_like_an_eager_one(world, fake_data, tmp_path):
    """The production order on the worker (activation checkpointing -> per-block inductor compile ->
    FSDP2) through the whole loop: the same losses, accuracies and gradient norms as eager, within
    float32 reordering on CPU. On CUDA the step computes in bf16 (FSDP's param_dtype), where the compiled
    graph's fused kernels round at other places than eager's (a gradient norm 0.08% apart at step 2 on
    an H200): 2% on the scalars, and on the weights what 4 AdamW steps can move a weight at most
    (about lr each) twice over."""
    eager = config(tmp_path / "eager", max_steps=4, log_every=1)
    fast = config(tmp_path / "fast", max_steps=4, log_every=1, compile=True, activation_checkpointing=True)
    from torch._dynamo.utils import counters

    counters.clear()
    (_, a), (_, b) = run(eager, world), run(fast, world)
    assert counters["stats"]["unique_graphs"] >= 1  # compiled, not fallen back to eager
    assert [r["step"] for r in b.reports] == [1, 2, 3, 4]
    bf16 = world.type == "cuda"
    rel, weight_tol = (2e-2, 2 * 4 * eager.optim.lr) if bf16 else (1e-4, 1e-5)
    for x, y in zip(a.reports, b.reports, strict=True):
        for field in ("loss", "grad_norm", "accuracy"):
            assert y[field] == pytest.approx(x[field], rel=rel, abs=1e-6), (x["step"], field)
    wa, wb = weights(eager, 4), weights(fast, 4)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=rel, atol=weight_tol, msg=name)


def test_the_next_epochs_input_starts_while_the_last_steps_of_this_one_train(world, monkeypatch, tmp_path):
    """A new epoch's pipeline takes a while to its first input (1-1.5 s on a GPU node): it is started
    once this rank's stream has run dry, and the run trains what it trained without the head start."""
    events = []

    def micro_batches(*args, epoch, **kwargs):
        events.append(("stream", epoch))  # as the stream is opened
        return fake_micro_batches(*args, epoch=epoch, **kwargs)

    class Steps(Seen):
        def taken(self, step):
            events.append(("step", step.epoch, step.step))
            super().taken(step)

    monkeypatch.setattr(dataplan, "micro_batches", micro_batches)
    seen = Steps()
    ahead = config(tmp_path / "ahead", prefetch_steps=2, max_steps=12, checkpoint_every=12)
    run(ahead, world, seen)
    streams = [events.index(e) for e in events if e[0] == "stream"]
    last_steps = [
        max(i for i, e in enumerate(events) if e[0] == "step" and e[1] == epoch) for epoch in (0, 1)
    ]
    # 4 steps an epoch, 3 epochs; the fourth epoch's input, started ahead of the run's end, is closed
    assert [events[i][1] for i in streams] == [0, 1, 2, 3]
    assert streams[1] < last_steps[0] and streams[2] < last_steps[1]  # before each epoch's last step
    ahead_keys = seen.clear()
    run(ahead.replace(out=str(tmp_path / "plain"), prefetch_steps=0), world, seen)  # no thread: no head start
    assert seen.keys == ahead_keys and len(ahead_keys) == 12
