"""Checkpoint saves as the worker loop makes them: synchronous, or asynchronous beside training.

    saver = Saver(session, model, optimizer, ema, asynchronous=True)   # collective, once
    saver.start(metrics, train_state, config)                           # collective, at a checkpoint step
    saver.close()                                                       # at the end: the last save whole

`Checkpointer` is what the loop and the preemption check save with: a checkpoint of the run's state as
of its step in two moves, `take` as soon as the step is queued (every rank's cursor gathered, the weights'
finite flag queued behind the step, `FiniteCheck`: no wait for the device) and `save` (the flag agreed,
then `Saver.start`), which the loop makes inside the next step, its forward and backward queued
(`pipeline.train.loop`); `wait` for the save in flight, and `longest_seconds`, the longest a save took.

Design notes
------------
- Synchronous (``--no-async-checkpoint``): DCP writes every rank's shards into a temporary directory,
  Ray Train uploads it, and only then does training go on: the stall is the write plus the upload.
- Asynchronous (the default): DCP's `DefaultStager` copies the state into host memory (pinned on CUDA)
  on a thread of its own while the next step's forward and backward run; that step waits for the copy
  only before it writes anything the copy holds (the loop's `Checkpointer.staged` before the update: the
  learning rate, the weights, the optimizer state; the EMA follows the update). On CUDA the copy reads
  what the checkpoint's step wrote: a save starts once the host has seen the device run that step (the
  finite check's event, recorded behind the step and its EMA update; the steps queued after it only read
  the weights until their update). The stager's buffers are built after the attempt's first step
  (`Saver.warm`), and every save refills them (`KeptStager`), so the host memory is taken once per run,
  not once per save, and no checkpoint's window pays for building them (torch 2.11 empties a stager
  after each stage and in `async_save`, which failed the next save): one copy of the rank's shards of
  model, optimizer and EMA, held until the run ends (what asynchronous saves cost). DCP writes the copy from a
  background thread over a gloo group of its own: the training's collectives run on the default group
  meanwhile, and a process group serves one thread's collectives, in order. The upload follows the write
  in Ray Train's upload thread (`RaySession.report` with ``written``, `CheckpointUploadMode.ASYNC`).
- At most one save in flight: a save first waits until the one before is in storage. Every rank saves at
  the same steps and waits only for its own save's background work, which never waits on a training
  collective, so the wait is the same decision on every rank and cannot deadlock. `close` waits for the
  last one, before the export and the run's summary.
- Completeness is unchanged: Ray Train registers a checkpoint only once every rank's upload is in, and a
  directory counts only once `pipeline.dcp.is_complete`. A kill while a save is in flight leaves the
  checkpoint before it the latest complete one, which the next attempt resumes from.
- What is written is the state at the checkpoint's step, whatever the steps after it change meanwhile:
  the copy is complete before the next step's update.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from pipeline import compat, dcp
from pipeline.train.checkpointing import checkpoint
from pipeline.train.input.cursor import EpochCursor
from pipeline.train.observe.host_copy import HostCopy
from pipeline.train.state import Rank, TrainState, local_shard
from pipeline.train.step.ema import WeightEMA

# A test hook, unset in real runs: "STEP:SECONDS" holds the background write of checkpoint STEP for
# SECONDS on every rank, so that a test can kill a run while that save is in flight
# (tests/system/test_async_checkpoint.py). The synchronous path ignores it.
WRITE_DELAY_ENV = "VITRAY_TEST_CHECKPOINT_WRITE_DELAY"


class WeightsNotFinite(Exception):
    """The weights hold NaN or inf on some rank (every rank raises alike): nothing was saved."""


class FiniteCheck:
    """Whether a rank's shards of every parameter are finite (no NaN or inf), in two moves: made as soon
    as the step is queued, its flag in flight to the host behind that step (`HostCopy`: no wait for the
    device); `agreed`, later, waits for the device to have run that step only and agrees with every rank.
    ``taken``: where the run stood when it was made (`TrainState.where`), which its save must still be."""

    def __init__(self, model: nn.Module, taken: tuple[Any, ...]):
        finite = torch.stack([torch.isfinite(local_shard(p)).all() for p in model.parameters()])
        self.copy = HostCopy((~finite).sum().to(torch.float64).reshape(1))
        self.taken = taken

    def agreed(self, group: dist.ProcessGroup | None) -> bool:
        """Collective over the CPU ``group``: every rank's weights are finite. On return the device has
        run the step the check was made behind (its event), and no later work is waited for."""
        (not_finite,), _ = self.copy.wait()
        flag = torch.tensor([not_finite], dtype=torch.float64)
        dist.all_reduce(flag, group=group)
        return flag.item() == 0


class Checkpointer:
    """One rank's checkpoints of the run: `take` and `save`, `wait`, `longest_seconds`, `close`."""

    def __init__(self, saver: Saver, me: Rank, model: nn.Module, saved_config: dict[str, Any]):
        self.saver, self.me, self.model, self.saved_config = saver, me, model, saved_config

    def take(self, state: TrainState, cursor: EpochCursor) -> FiniteCheck:
        """Collective, as soon as the checkpoint's step is queued (its EMA update too): every rank's
        ``cursor`` into ``state``, and the weights' finite check behind the step; `save` with it, then or
        inside the next step before its update."""
        cursor.save_into(state, self.me.group)
        return FiniteCheck(self.model, state.where())

    def save(self, state: TrainState, check: FiniteCheck, metrics: dict[str, Any]) -> float:
        """Collective: every rank saves its shards of ``state``'s step (`take`) and hands them to Ray Train
        with ``metrics``; returns the seconds training waited. Weights that are not finite are never
        saved: `WeightsNotFinite`, and the latest checkpoint stays the one to resume from. ``state`` must
        stand where it stood at `take` (its step, epoch and position; a RuntimeError otherwise): only the
        skipped steps, counted once the device has run the step, may have grown since."""
        if state.where() != check.taken:  # the step, epoch or position moved since `take`: a loop's bug
            raise RuntimeError(
                f"a checkpoint taken at step {check.taken[0]} would save the state of step {state.step}; "
                "save it before the step counter or the cursor moves"
            )
        started = time.perf_counter()
        if not check.agreed(self.me.group):
            raise WeightsNotFinite(f"the weights hold NaN or inf at step {state.step}")
        self.saver.start(dict(metrics), state.to_dict(), self.saved_config, ready=True)
        return time.perf_counter() - started

    def wait(self) -> None:
        """Until the save in flight is written and in storage; raises its error."""
        self.saver.wait()

    def staged(self) -> None:
        """Until the save in flight holds its copy of the state (`Saver.staged`)."""
        self.saver.staged()

    def warm(self) -> None:
        """The host buffers of asynchronous saves made now (`Saver.warm`)."""
        self.saver.warm()

    @property
    def longest_seconds(self) -> float:
        """The longest any save of this attempt took, start to storage."""
        return self.saver.longest_seconds

    def close(self) -> None:
        """The last save written and in storage."""
        self.saver.close()


class Saver:
    """One rank's checkpoint saves, at most one in flight. ``session``: `pipeline.train.session.RaySession`
    or a stand-in with its `report`; ``asynchronous``: see the module's notes; ``probed``: every checkpoint
    is reported for the checkpoint probe (`pipeline.train.scoring.probe`)."""

    def __init__(
        self,
        session: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ema: WeightEMA | None,
        *,
        asynchronous: bool,
        probed: bool = False,
    ):
        self.session, self.model, self.optimizer, self.ema = session, model, optimizer, ema
        self.asynchronous = asynchronous
        # Only where asked: a stand-in session's `report` need not know the keyword.
        self.report_options = {"validation": True} if probed else {}
        self.cuda = next(model.parameters()).device.type == "cuda"  # a CPU run on a GPU machine: not
        # Collective: every rank makes the group at set-up, in the same order.
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.stager: KeptStager | None = None  # made by `warm` or the first save, kept for the buffers
        self.in_flight: list[Future] = []  # the save in flight: its write, then its upload
        self.staging: Future | None = None  # its copy of the state, until `staged` has seen it done
        self.directory: str | None = None  # its local files
        # The longest any save took from its start until in storage: what a save before a deadline
        # needs (`pipeline.train.checkpointing.preemption`).
        self.longest_seconds = 0.0

    def start(
        self,
        metrics: dict[str, Any],
        train_state: dict[str, Any],
        config: dict[str, Any],
        *,
        ready: bool = False,
    ) -> None:
        """Collective: wait for the save in flight, then save the state at ``train_state["step"]`` and hand
        it to the session with ``metrics``. Returns once the state is copied (asynchronous) or saved and
        uploaded (synchronous); raises what the save before this one raised. ``ready``: the host has seen
        the device run the state's step (an event's wait); else, on CUDA, the training stream is waited
        for here."""
        self.wait()
        started = time.perf_counter()
        step = train_state["step"]
        name = dcp.checkpoint_name(step)
        directory = tempfile.mkdtemp(prefix="vitray-ckpt-")
        try:
            parts = (self.model, self.optimizer, train_state, config, self.ema)
            if not self.asynchronous:
                checkpoint.save(directory, *parts)
                self.session.report(metrics, directory, name, **self.report_options)
                self._took(started)
                return
            if self.cuda and not ready:  # the copy's stream reads what the step's kernels wrote
                torch.cuda.current_stream().synchronize()
            response = torch_dcp.async_save(
                checkpoint.prepare(directory, *parts),
                storage_writer=_writer(directory, step),
                process_group=self.group,
                async_stager=self._stager(),
            )
            # A copy on the stager's thread gives its completion apart from the write's.
            written = getattr(response, "upload_completion", response)
            self.staging = getattr(response, "staging_completion", None)
            self.in_flight, self.directory = [written], directory
            uploaded = self.session.report(metrics, directory, name, written=written, **self.report_options)
        finally:
            if not self.in_flight:  # synchronous, or it failed before the write began
                shutil.rmtree(directory, ignore_errors=True)
        if uploaded is not None:  # a session that uploads beside training; else it waited for the write
            self.in_flight.append(uploaded)
            uploaded.add_done_callback(lambda _: shutil.rmtree(directory, ignore_errors=True))
        self.in_flight[-1].add_done_callback(lambda _: self._took(started))

    def warm(self) -> None:
        """Asynchronous saves: the stager's host buffers made now, by one stage of the state that is not
        saved, so that the run's first checkpoint refills them as every later one does (`KeptStager`)
        rather than building them inside a window of training. Every rank, once, after the step that
        made the optimizer's state (the first checkpoint's layout)."""
        if not self.asynchronous or self.stager is not None:
            return
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        staged = self._stager().stage(checkpoint.state_dict(self.model, self.optimizer, self.ema))
        if isinstance(staged, Future):
            staged.result()

    def _took(self, started: float) -> None:
        self.longest_seconds = max(self.longest_seconds, time.perf_counter() - started)

    def staged(self) -> None:
        """Until the save in flight holds its copy of the state: what a step waits for before it writes
        the learning rate, weights or optimizer state. Raises the copy's error."""
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.result()

    def wait(self) -> None:
        """Until the save in flight is written and in storage; raises its error."""
        self.staging = None  # the write began from the copy: done once the write is
        in_flight, self.in_flight = self.in_flight, []
        try:
            for future in in_flight:
                future.result()
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = None

    def close(self) -> None:
        """The last save written and in storage; the staging buffers freed."""
        try:
            self.wait()
        finally:
            if self.stager is not None:
                self.stager.release()
                self.stager = None

    def _stager(self) -> DefaultStager:
        if self.stager is None:
            cuda = self.cuda
            # Staged on the stager's thread (on CUDA, its own stream) beside the next step's forward
            # and backward; `staged` holds that step's update until the copy is taken.
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
            self.stager = KeptStager(options)
        return self.stager


class KeptStager(DefaultStager):
    """A `DefaultStager` whose host buffers last until `release`, and whose later stages refill them.

    The first stage (and any whose state dict is laid out otherwise: other keys, shapes or dtypes) is
    DCP's: it builds the staged state dict, each tensor a host copy (a DTensor's around a host copy of its
    local shard). Each later stage copies every tensor's values into the staged tensor at its place, on
    the stager's thread (on CUDA non-blocking into the pinned buffers, on the stager's stream, then
    synchronized), and copies the other values; DCP's per-tensor rebuilding (DTensor construction through
    its dispatch, about half of a stage's time on a CPU, the memory copy the rest) is done once. The
    previous save's write must be over before the next stage (`Saver.start` waits for it).

    torch 2.11 closes the copier inside every stage (`DefaultStager._stage` calls
    ``_state_dict_stager.close()``), and its `async_save` closes the stager it is given once the save is
    staged; a closed copier has dropped its buffers and the table it copies with, so the next save fails
    (``KeyError: <class 'type'>``, seen on an H100 at a run's second checkpoint). Here both closes are
    no-ops and `release` frees."""

    def __init__(self, options: StagingOptions):
        super().__init__(options)
        copier = self._state_dict_stager
        self._release_copier = copier.close
        copier.close = lambda: None  # torch 2.11's `_stage`; later releases no longer call it
        self.staged: Any = None  # the last staged state dict, whose tensors the next stage refills
        self.refills = 0  # stages made by refilling (`tests/train/test_saver.py`)

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            staged = None if self.staged is None else _refilled(state_dict, self.staged, copies)
        except _LaidOutOtherwise:
            staged = None
        if staged is None:
            self.staged = compat.dcp_stage(self, state_dict, **kwargs)
            return self.staged
        with torch.no_grad():
            if self._config.use_non_blocking_copy and self._staging_stream is not None:
                with self._staging_stream:
                    for staged_tensor, source in copies:
                        staged_tensor.copy_(source, non_blocking=True)
                self._staging_stream.synchronize()
            else:
                for staged_tensor, source in copies:
                    staged_tensor.copy_(source)
        self.staged = staged
        self.refills += 1
        return staged

    def close(self) -> None:
        pass

    def release(self) -> None:
        self.staged = None
        super().close()
        self._release_copier()


class _LaidOutOtherwise(Exception):
    """A state dict whose layout is not the staged one's: DCP stages it anew."""


def _refilled(source: Any, staged: Any, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``staged``'s layout with ``source``'s values: each tensor of ``source`` paired in ``copies`` with
    the staged tensor at its place (its host buffer; a DTensor's local shard), every other value copied.
    Raises `_LaidOutOtherwise` where the two differ."""
    if isinstance(source, torch.Tensor):
        if (
            type(staged) is not type(source)
            or staged.shape != source.shape
            or staged.dtype != source.dtype
            or staged.is_sparse
            or source.is_sparse
        ):
            raise _LaidOutOtherwise
        if isinstance(source, DTensor):
            if staged.placements != source.placements:
                raise _LaidOutOtherwise
            local, into = source.to_local(), staged.to_local()
        else:
            local, into = source, staged
        if into.shape != local.shape or into.device.type != "cpu":
            raise _LaidOutOtherwise
        copies.append((into, local))
        return staged
    if isinstance(source, dict):
        if not isinstance(staged, dict) or staged.keys() != source.keys():
            raise _LaidOutOtherwise
        return type(source)((key, _refilled(value, staged[key], copies)) for key, value in source.items())
    if isinstance(source, list | tuple) and not hasattr(source, "_fields"):
        if type(staged) is not type(source) or len(staged) != len(source):
            raise _LaidOutOtherwise
        return type(source)(_refilled(a, b, copies) for a, b in zip(source, staged, strict=True))
    if isinstance(staged, torch.Tensor | dict | list | tuple):
        raise _LaidOutOtherwise
    return copy.deepcopy(source)


def _writer(directory: str, step: int) -> FileSystemWriter:
    """DCP's file writer into ``directory``; held for a while first where the test hook says so."""
    hook = os.environ.get(WRITE_DELAY_ENV, "")
    if not hook or int(hook.split(":")[0]) != step:
        return FileSystemWriter(directory)
    seconds = float(hook.split(":")[1])

    class HeldWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            time.sleep(seconds)  # in DCP's background thread
            return super().write_data(plan, planner)

    return HeldWriter(directory)
