"""The next steps' micro-batches, built on a background thread while the current step runs.

Building a step's input is host work: pull micro-batches from the Ray Data stream (which rebatches
and filters bad samples), turn the numpy columns into tensors and, on CUDA, copy them into pinned
memory so the copy to the device can run without blocking. Done after each step returns, that work
would leave the GPU idle; here a thread does it up to `depth` steps ahead, and the step only starts
the (non-blocking) copies to the device.

A rank's stream ends before the epoch does when other ranks still hold samples: its last input holds
what was left (fewer micro-batches than a step takes, the last one maybe smaller), and every input
after it is empty, so the rank joins the epoch's last steps with nothing to train on
(`pipeline.train.step.train_step.TrainStep` makes its passes with zero loss).

When the stream runs dry, the thread that found it keeps its final bad-sample counts (`ran_dry`), up
to `depth` steps before the loop takes the input where it ran dry: the loop asks at every step and starts
the next epoch's pipeline then, while this epoch's last steps still train, so the next epoch's first
input is not waited for from scratch (a new Ray Data pipeline takes 1-1.5 s to its first step of input
on a GPU node: BENCHMARKS.md, "The product path on one GPU").

Pinned buffers are reused: a buffer goes back to the pool with a CUDA event recorded after its copy
to the device was issued, and the thread waits on that event before writing into it again.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples, LabelsMissingError
from pipeline.data.dataset import Batch
from pipeline.train.input.ledger import Tally, tally_batches, tally_keyed

_DONE = object()  # the producer has stopped
# The columns that name a sample for the data position; a mixed run's add its source and pass.
POSITION = ("url", "index", "shard_size", "source", "pass")


@dataclass
class StepInput:
    """One rank's input to one optimizer step, as the data thread built it."""

    micro_batches: list[tuple[torch.Tensor, ...]]  # host tensors (pinned on CUDA), one tuple per micro-batch
    keys: list[str]  # the samples' keys, in the order the step takes them
    samples: int
    ran_dry: bool  # fewer micro-batches than a step takes (maybe none): the stream has ended
    error: str  # a data error's one line (bad-sample budget, unlabeled shards), "" when none
    bad_samples: BadSamples  # this rank's counts as of this step's last micro-batch (a copy)
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)  # pinned, back to the pool after use
    # For the data position (`pipeline.train.input.position`): the micro-batches' samples as (url, index,
    # shard_size) columns, and the bad samples counted while building this input (url, index, shard_size);
    # a mixed run's also hold each sample's source and pass (`POSITION`).
    consumed: list[tuple[np.ndarray, ...]] = field(default_factory=list)
    counted: list[tuple[Any, ...]] = field(default_factory=list)
    # For the ledger (`pipeline.train.input.ledger`): the micro-batches' samples and the bad samples
    # counted while building this input, tallied by shard (and pass) on the data thread.
    tallied: Tally = field(default_factory=list)
    tallied_bad: Tally = field(default_factory=list)

    def to_device(self, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        """The micro-batches on `device`; on CUDA the copies are queued, not waited for."""
        if device.type != "cuda":
            return self.micro_batches
        return [tuple(t.to(device, non_blocking=True) for t in mb) for mb in self.micro_batches]


class PinnedPool:
    """Page-locked host buffers, one dict (column -> tensor) per micro-batch, reused across steps."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[tuple[dict[str, torch.Tensor], torch.cuda.Event | None]] = (
            queue.SimpleQueue()
        )

    def take(self, batch: Batch, columns: Sequence[str]) -> dict[str, torch.Tensor]:
        """A buffer holding `batch`'s columns; waits until the device has read its last contents.

        Each column is a view of a flat pinned block that grows to the largest it has held: native-aspect
        micro-batches change shape from one to the next (rows x length, one token budget), and pinning
        anew for each would take the driver-wide lock every step."""
        try:
            buffer, copied = self._free.get_nowait()
        except queue.Empty:
            buffer, copied = {}, None
        if copied is not None:
            copied.synchronize()
        for name in columns:
            array, dtype = batch[name], _torch_dtype(batch[name])
            block = buffer.get(f"{name}/block")  # flat, pinned
            if block is None or block.numel() < array.size or block.dtype != dtype:
                block = buffer[f"{name}/block"] = torch.empty(array.size, dtype=dtype, pin_memory=True)
            held = buffer[name] = block[: array.size].view(array.shape)
            np.copyto(held.numpy(), array)  # Ray's arrays are read-only: torch would not wrap them
        return buffer

    def give_back(self, buffers: list[dict[str, torch.Tensor]]) -> None:
        """Return buffers whose copies to the device have been queued on the current stream."""
        if not buffers:
            return
        copied = torch.cuda.Event()
        copied.record()
        for buffer in buffers:
            self._free.put((buffer, copied))


def _torch_dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype


class Prefetcher:
    """Steps of input from `stream`, built `depth` steps ahead on a thread (`depth=0`: in the caller).

    `stream` yields micro-batches of one size but the last, which may be smaller
    (`pipeline.data.dataset.micro_batches`); it runs, and is closed, on the data thread only.
    `bad_samples` is the object the stream counts into; each `StepInput` carries a copy of it, so the
    caller never reads it while the thread writes it. After the input where the stream ran dry, `next`
    returns empty inputs (`ran_dry`, no samples, the stream's final counts) for as long as it is called.
    `ran_dry` gives the final counts as soon as the thread has found the stream's end (not on an error).
    """

    def __init__(
        self,
        stream: Iterator[Batch],
        *,
        accum: int,
        columns: Sequence[str],
        bad_samples: BadSamples,
        pin: bool,
        depth: int,
    ):
        self.stream, self.accum, self.columns = stream, accum, tuple(columns)
        self.dry: BadSamples | None = None  # the stream's final counts, set by the thread that found its end
        self.bad_samples = bad_samples
        self.pool = PinnedPool() if pin else None
        self.depth = depth
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._thread = None
        self._final_counts: BadSamples | None = None  # set once the stream has run dry
        if depth > 0:
            self._thread = threading.Thread(target=self._produce, name="vitray-prefetch", daemon=True)
            self._thread.start()

    def next(self) -> StepInput:
        """The next step's input (blocks until it is built); an empty one once the stream has run dry."""
        if self._final_counts is not None:
            return StepInput([], [], 0, True, "", _copy(self._final_counts))
        if self._thread is None:
            item = self._build()
            self._dry(item)
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _DONE:
                raise RuntimeError("the data thread has stopped; no step input follows a data error")
        if item.ran_dry:
            self._final_counts = item.bad_samples
        return item

    def ran_dry(self) -> BadSamples | None:
        """The stream's final counts (a copy) once it has run dry, maybe steps ahead of the input that
        ends it; None before, and after a data error."""
        return self.dry

    def release(self, step_input: StepInput) -> None:
        """After `StepInput.to_device`: its pinned buffers may be refilled once the copies are done."""
        if self.pool is not None:
            self.pool.give_back(step_input.buffers)

    def close(self) -> None:
        """Stop the thread (it finishes the micro-batch it is reading) and close the stream."""
        self._stop.set()
        if self._thread is None:
            self.stream.close()
            return
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.1)  # unblocks a thread waiting to hand over a step
        self._thread.join()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                step_input = self._build()
                self._dry(step_input)
                if not self._hand_over(step_input) or step_input.ran_dry or step_input.error:
                    break
        except BaseException as e:  # handed to the training thread, which raises it
            self._hand_over(e)
        finally:
            self.stream.close()
            self._hand_over(_DONE)

    def _dry(self, step_input: StepInput) -> None:
        if step_input.ran_dry and not step_input.error and self.dry is None:
            self.dry = _copy(step_input.bad_samples)

    def _hand_over(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _build(self) -> StepInput:
        batches: list[Batch] = []
        error = ""
        try:
            while len(batches) < self.accum and not self._stop.is_set():
                batches.append(next(self.stream))
        except StopIteration:
            pass
        except (BadSampleBudgetError, LabelsMissingError) as e:  # one line each, saying what to do
            error = str(e)
        buffers = [self.pool.take(b, self.columns) for b in batches] if self.pool is not None else []
        if buffers:
            tensors = [tuple(buf[c] for c in self.columns) for buf in buffers]
        else:
            tensors = [tuple(_tensor(b[c]) for c in self.columns) for b in batches]
        return StepInput(
            micro_batches=tensors,
            keys=[k for b in batches for k in b["key"].tolist()],
            samples=sum(len(b[self.columns[0]]) for b in batches),
            ran_dry=len(batches) < self.accum,
            error=error,
            bad_samples=_copy(self.bad_samples),
            buffers=buffers,
            consumed=[tuple(b[c] for c in POSITION if c in b) for b in batches if "shard_size" in b],
            counted=self.bad_samples.take_counted(),
            tallied=tally_batches(batches),
            tallied_bad=tally_keyed(self.bad_samples.take_keyed()),
        )


def _copy(counts: BadSamples) -> BadSamples:
    return BadSamples.from_dict(counts.to_dict())


def _tensor(array: np.ndarray) -> torch.Tensor:
    # Ray hands out read-only arrays, which torch must not wrap: the step would be free to write them.
    return torch.from_numpy(array if array.flags.writeable else array.copy())
