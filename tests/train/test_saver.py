"""Asynchronous checkpoints (`pipeline.train.checkpointing.saver`) in one process, without Ray: they hold what the
synchronous ones hold, the stall of each lands in the log line and `metrics.jsonl`, a save waits for the
one before it, the host buffers of the copy are reused from one save to the next, and a preemption
stops the run only once the save in flight is in storage.

The loop runs on the fake data of `tests.train.test_loop` (8 steps, checkpoints at 4 and 8).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from pipeline import dcp
from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.train.checkpointing.saver import Checkpointer, FiniteCheck, KeptStager, Saver
from pipeline.train.driver import read_metrics
from pipeline.train.input.cursor import EpochCursor
from pipeline.train.state import Rank, TrainState
from pipeline.train.step.model import build_model
from pipeline.train.step.objective import objective_for
from pipeline.train.step.train_step import TrainStep
from tests.train.test_loop import SHARDS, LocalSession, config, fake_micro_batches, run

CHECKPOINT_FILES = (dcp.TRAIN_STATE, dcp.CONFIG, "__0_0.distcp")


def slow_copy(mp: pytest.MonkeyPatch, seconds: float) -> None:
    """Every asynchronous save's copy starts ``seconds`` late on the stager's thread: a step that did
    not wait for it before its update would write into what the copy takes."""
    stage = KeptStager._stage

    def late(self, state_dict, **kwargs):
        time.sleep(seconds)
        return stage(self, state_dict, **kwargs)

    mp.setattr(KeptStager, "_stage", late)


@pytest.fixture(scope="module")
def sync_and_async(world, tmp_path_factory):
    """The same 8-step run saved synchronously and asynchronously; the asynchronous one uploads beside
    training (`BackgroundSession`) with each copy 0.3 s late, so training goes on while it is taken."""
    from pipeline.train import loop
    from pipeline.train.input import dataplan

    root = tmp_path_factory.mktemp("saver")
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dataplan, "micro_batches", fake_micro_batches)
        slow_copy(mp, 0.3)
        for mode in (False, True):
            cfg = config(root / f"async-{mode}", async_checkpoint=mode)
            if not mode:
                runs[mode] = (cfg, *run(cfg, world))
                continue
            session = BackgroundSession(world, Path(cfg.run.out))
            loop_config = {"train": cfg.to_dict(), "shards": SHARDS, "data_cpus_per_worker": 1.0}
            runs[mode] = (cfg, loop.Trainer(loop_config, session).train(), session)
    return runs


def full_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model, optimizer), read back in one process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.safe_reader(str(directory)).read_metadata()
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        torch_dcp.load(state, storage_reader=dcp.safe_reader(str(directory)), no_dist=True)
    return state


def test_asynchronous_and_synchronous_saves_write_the_same_checkpoints(sync_and_async):
    (sync_cfg, sync_summary, _), (async_cfg, async_summary, _) = sync_and_async[False], sync_and_async[True]
    assert sync_summary["error"] == async_summary["error"] == ""
    for step in (4, 8):
        a, b = (Path(c.run.out) / dcp.checkpoint_name(step) for c in (sync_cfg, async_cfg))
        assert dcp.is_complete(b)
        for name in CHECKPOINT_FILES:  # byte for byte: state, config and every tensor as saved
            if name == dcp.CONFIG:
                saved = [json.loads((d / name).read_text()) for d in (a, b)]
                for c in saved:  # the runs differ in this setting and in --out alone
                    c["train"]["run"].pop("async_checkpoint"), c["train"]["run"].pop("out")
                assert saved[0] == saved[1]
            else:
                assert (a / name).read_bytes() == (b / name).read_bytes(), (step, name)
        sa, sb = full_state(a), full_state(b)
        assert sa.keys() == sb.keys() and any(k.startswith("optim.") for k in sa)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (step, key)
    final = [Path(c.run.out) / "final" / "weights.safetensors" for c in (sync_cfg, async_cfg)]
    assert final[0].read_bytes() == final[1].read_bytes()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_stall_of_each_checkpoint_is_in_its_log_line_and_metrics_row(sync_and_async, asynchronous):
    cfg, _, session = sync_and_async[asynchronous]
    rows = read_metrics(cfg.run.out)
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    stalls = {r["step"]: r.get("checkpoint_stall_s") for r in rows}
    assert stalls[2] is None and stalls[6] is None  # rows without a checkpoint have none
    assert all(isinstance(stalls[s], float) and 0 < stalls[s] < 60 for s in (4, 8)), stalls
    assert [r.get("checkpoint_stall_s") for r in session.reports] == [None] * 4  # Ray Train's copy: before


def test_the_log_line_says_what_a_checkpoint_stalled(world, tmp_path, capsys, monkeypatch):
    from pipeline.train.input import dataplan

    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    run(config(tmp_path / "run", max_steps=4), world)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and "checkpoint stall" not in lines[0]
    assert " | checkpoint stall " in lines[1] and lines[1].split("checkpoint stall ")[1].split()[1] == "s"


class HeldSession:
    """A session whose uploads finish when the test says so (`release`), each after its write, as
    Ray Train's upload thread waits for the write (the saver removes the directory once uploaded)."""

    def __init__(self):
        self.uploads: list[Future] = []
        self.writes: list[Future] = []
        self.checkpoints: list[str] = []  # the directory of each save, until its upload is released

    def report(self, metrics, checkpoint_dir=None, name="", written=None):
        assert written is not None and checkpoint_dir is not None
        self.uploads.append(Future())
        self.writes.append(written)
        self.checkpoints.append(checkpoint_dir)
        return self.uploads[-1]

    def release(self, i: int, error: BaseException | None = None) -> None:
        self.writes[i].result(timeout=60)
        if error is None:
            self.uploads[i].set_result(None)
        else:
            self.uploads[i].set_exception(error)


@pytest.fixture
def parts(world, tmp_path):
    cfg = config(tmp_path / "run")
    model = build_model(cfg, world)
    optimizer = TrainStep(model, cfg, world, objective_for(cfg)).optimizer
    for p in model.parameters():  # one update, so that the optimizer holds its moments
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


def test_a_save_waits_for_the_one_in_flight_and_reuses_its_host_buffers(parts):
    model, optimizer = parts
    session = HeldSession()
    saver = Saver(session, model, optimizer, None, asynchronous=True)
    saver.start({}, {"step": 4}, {})
    saver.staged()  # the copy taken (on the stager's thread)
    cached = dict(saver.stager._state_dict_stager._cached_storage_mapping.items())  # torch's buffer cache
    moments = sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    assert moments > 2 * sum(p.numel() for p in model.parameters())  # exp_avg, exp_avg_sq (and step)
    assert len(cached) > 3 * len(list(model.parameters())) and len(session.uploads) == 1
    second = threading.Thread(target=saver.start, args=({}, {"step": 8}, {}))
    second.start()
    second.join(timeout=3)
    assert second.is_alive() and len(session.uploads) == 1  # waiting for the first save's upload
    session.release(0)
    second.join(timeout=60)
    assert not second.is_alive() and len(session.uploads) == 2
    saver.staged()
    again = dict(saver.stager._state_dict_stager._cached_storage_mapping.items())
    assert again.keys() == cached.keys()
    assert all(again[k] is cached[k] for k in cached)  # the same host buffers, refilled
    session.release(1, OSError("the store said no"))
    with pytest.raises(OSError, match="the store said no"):  # a failed upload fails the run's end
        saver.close()


def test_the_copy_is_taken_beside_the_next_step_which_waits_for_it_before_its_update(parts, monkeypatch):
    """`start` returns before the state is copied (the stager's thread copies it while the next step's
    forward and backward run); `staged`, which the step calls before its update, returns once the copy
    is taken, so the checkpoint holds its own step's weights whatever that update writes."""
    model, optimizer = parts
    copy_may_start = threading.Event()
    stage = KeptStager._stage

    def held(self, state_dict, **kwargs):
        copy_may_start.wait(60)
        return stage(self, state_dict, **kwargs)

    monkeypatch.setattr(KeptStager, "_stage", held)
    session = HeldSession()
    saver = Saver(session, model, optimizer, None, asynchronous=True)
    own = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        started = threading.Thread(target=saver.start, args=({}, {"step": 4}, {}))
        started.start()
        started.join(timeout=5)
        assert not started.is_alive()  # returned with the copy not yet taken
        waiting = threading.Thread(target=saver.staged)
        waiting.start()
        waiting.join(timeout=1)
        assert waiting.is_alive()  # the next update waits here
    finally:
        copy_may_start.set()
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    with torch.no_grad():  # the next step's update, once `staged` returned
        for p in model.parameters():
            p.add_(1.0)
    session.writes[0].result(timeout=60)
    saved = full_state(Path(session.checkpoints[0]))  # before its upload, after which it is removed
    session.release(0)
    for name, value in own.items():
        own_value = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(saved[f"model.{name}"], own_value.cpu())  # read back on the CPU
    saver.close()


def test_the_host_buffers_outlive_dcp_closing_the_stager_after_each_save(parts, monkeypatch):
    """torch 2.11's async_save closes the stager it is given once the save is staged; the next save
    must still stage, into the same buffers (on the GPU the second save failed with a KeyError)."""
    model, optimizer = parts
    async_save = torch_dcp.async_save

    def closing_async_save(*args, async_stager, **kwargs):
        try:
            return async_save(*args, async_stager=async_stager, **kwargs)
        finally:
            async_stager.close()

    monkeypatch.setattr(torch_dcp, "async_save", closing_async_save)
    session = HeldSession()
    saver = Saver(session, model, optimizer, None, asynchronous=True)
    saver.start({}, {"step": 4}, {})
    saver.staged()
    cached = dict(saver.stager._state_dict_stager._cached_storage_mapping.items())
    session.release(0)
    saver.start({}, {"step": 8}, {})
    saver.staged()
    again = saver.stager._state_dict_stager._cached_storage_mapping
    assert len(session.uploads) == 2 and cached and all(again[k] is cached[k] for k in cached)
    session.release(1)
    stager = saver.stager
    saver.close()
    assert saver.stager is None and not stager._state_dict_stager._cached_storage_mapping  # released


class BackgroundSession(LocalSession):
    """Uploads beside training, as Ray Train's upload thread does: waits for the write, then copies."""

    def report(self, metrics, checkpoint_dir=None, name="", written=None):
        if written is None:
            return super().report(metrics, checkpoint_dir, name)
        self.reports.append(metrics)
        uploaded = Future()

        def upload():
            written.result()
            time.sleep(1)  # a slow store
            shutil.copytree(checkpoint_dir, self.run_dir / name, dirs_exist_ok=True)
            uploaded.set_result(None)

        threading.Thread(target=upload, daemon=True).start()
        return uploaded


def test_a_preemption_at_a_checkpoint_step_stops_only_once_that_save_is_in_storage(
    world, monkeypatch, tmp_path
):
    from pipeline.train import loop
    from pipeline.train.checkpointing import preemption
    from pipeline.train.input import dataplan

    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    monkeypatch.setenv(preemption.TEST_HOOK, "4")  # a notice at step 4, whose save is then in flight
    cfg = config(tmp_path / "run")
    session = BackgroundSession(world, Path(cfg.run.out))
    loop_config = {"train": cfg.to_dict(), "shards": SHARDS, "data_cpus_per_worker": 1.0}
    with pytest.raises(preemption.Preempted, match=f"{dcp.checkpoint_name(4)} holds this step already"):
        loop.Trainer(loop_config, session).train()
    assert dcp.is_complete(Path(cfg.run.out) / dcp.checkpoint_name(4))  # what the restart resumes from


def test_the_saver_stager_stages_every_save_after_torch_closes_its_copier():
    """torch 2.11 closes a `DefaultStager`'s copier inside every stage, and its `async_save` closes the
    stager once staged: a closed copier has lost the table it copies with, and a run's second
    asynchronous checkpoint failed with ``KeyError: <class 'type'>`` (seen on an H100). The saver's
    stager keeps copying into the same buffers until `release`."""
    off = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
    )
    stager = KeptStager(off)
    state = {"w": torch.arange(4.0), "step": 1, "nested": {"b": torch.ones(2)}}
    first = stager.stage(state)
    stager._state_dict_stager.close()  # what torch 2.11's DefaultStager._stage does after each copy
    stager.close()  # what its async_save does once the save is staged
    state["w"] += 1
    state["step"] = 2
    second = stager.stage(state)
    assert second["w"].tolist() == [1.0, 2.0, 3.0, 4.0] and second["step"] == 2
    assert second["nested"]["b"].tolist() == [1.0, 1.0]
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same host buffer, refilled
    stager.release()


@pytest.mark.parametrize(
    ("value", "finite"), [(1.0, True), (1e30, True), (float("inf"), False), (float("nan"), False)]
)
def test_the_finite_check_refuses_nan_and_inf_and_passes_large_finite_weights(world, control, value, finite):
    """Element by element: 1e30 is finite (its square, a norm's, would not be)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(world)
    with torch.no_grad():
        model[1].weight[0, 1] = value
    assert FiniteCheck(model, TrainState().where()).agreed(control) is finite


def test_a_checkpoint_saves_only_the_state_it_took_and_refuses_one_moved_since(parts, world, control):
    """`Checkpointer.take` fixes the step, epoch and position its save writes; the skipped steps, counted
    once the device has run the step, may still grow. A save after the step counter or the cursor moved
    (a loop that deferred it too far) is refused before anything is written."""
    model, optimizer = parts
    session = HeldSession()
    saver = Saver(session, model, optimizer, None, asynchronous=True)
    me = Rank(rank=0, world=1, device=world, group=control, accum=1)
    checkpointer = Checkpointer(saver, me, model, {})
    cursor = EpochCursor.start(0, 1, 8, "stream", DataConfig())

    def taken_at(step: int) -> tuple[TrainState, FiniteCheck]:
        state = TrainState(step=step)
        cursor.took(1, BadSamples.from_config(DataConfig()))
        return state, checkpointer.take(state, cursor)

    state, check = taken_at(4)
    state.skipped_steps += 1  # the step's skipped count, known once the device has run it
    checkpointer.save(state, check, {"step": 4})
    assert len(session.uploads) == 1
    session.release(0)
    state, check = taken_at(8)
    state.step += 1
    with pytest.raises(RuntimeError, match="taken at step 8 would save the state of step 9"):
        checkpointer.save(state, check, {"step": 9})
    state, check = taken_at(12)
    cursor.took(1, BadSamples.from_config(DataConfig()))
    cursor.save_into(state, control)  # the next step's place written into the taken state
    with pytest.raises(RuntimeError, match="taken at step 12"):
        checkpointer.save(state, check, {"step": 12})
    assert len(session.uploads) == 1
    saver.close()


def test_a_later_stage_refills_the_first_ones_buffers_and_a_state_laid_out_otherwise_is_staged_anew():
    """The second stage copies each tensor into the buffer the first made (the same staged tensor, its
    own values, not an alias of the source) and copies the other values; other shapes or keys: DCP
    stages them anew."""
    stager = KeptStager(StagingOptions(False, False, False, False))  # pinned, shared, async, non-blocking
    first = stager.stage({"w": torch.ones(3), "step": 1, "groups": [{"lr": 0.1}]})
    source = {"w": torch.full((3,), 2.0), "step": 2, "groups": [{"lr": 0.2}]}
    second = stager.stage(source)
    assert stager.refills == 1 and second["w"] is first["w"]
    source["w"].add_(1.0)  # the next update, after the stage
    assert second["w"].tolist() == [2.0, 2.0, 2.0] and (second["step"], second["groups"]) == (
        2,
        [{"lr": 0.2}],
    )
    for other in ({"w": torch.ones(4), "step": 3, "groups": [{"lr": 0.3}]},
                  {"w": torch.ones(4), "step": 4, "groups": [{"lr": 0.3}], "ema": torch.zeros(2)}):  # fmt: skip
        staged = stager.stage(other)
        assert stager.refills == 1 and torch.equal(staged["w"], other["w"]) and staged["w"] is not other["w"]
    stager.release()


def test_a_run_makes_the_staging_buffers_after_its_first_step_and_each_checkpoint_refills_them(
    world, monkeypatch, tmp_path
):
    """DCP builds the staged state once, after the step that made the optimizer's state, outside any
    checkpoint's window; the four checkpoints of an 8-step run (every 2) each refill it."""
    from pipeline.train.input import dataplan

    built, refills, steps = [], [], []
    real_stage, real_release, real_update = DefaultStager._stage, KeptStager.release, TrainStep.update

    def build(self, state_dict, **kwargs):
        built.append(len(steps))
        return real_stage(self, state_dict, **kwargs)

    def release(self):
        refills.append(self.refills)
        real_release(self)

    def update(self, gradients):
        steps.append(1)
        return real_update(self, gradients)

    monkeypatch.setattr(DefaultStager, "_stage", build)
    monkeypatch.setattr(KeptStager, "release", release)
    monkeypatch.setattr(TrainStep, "update", update)
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    summary, _ = run(config(tmp_path / "run", checkpoint_every=2, async_checkpoint=True), world)
    assert summary["error"] == "" and built == [1] and refills == [4]
