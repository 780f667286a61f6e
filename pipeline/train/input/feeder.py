"""The data plane in a process of its own (``--data-process feeder``): each rank's pipeline runs in a
feeder, a Ray actor on the rank's node, and the training process only copies finished step inputs to
the device and steps.

    training process (rank r)                          feeder (an actor on rank r's node, no GPU)
    FeederPlan.epoch_input --- open(epoch, cursor) --> the rank's own plan (`pipeline.train.input.dataplan`):
    FeederInputs.next <------- next(epoch) ----------- Ray Data's executor, the shuffle buffer, rebatch,
      uint8 patches, labels, keys (the object store)   bad samples, the position's columns (`Prefetcher`)

Why inline costs the step. Inline, the streaming executor's scheduling thread, the shuffle buffer, the
rebatching and the bad-sample accounting run on threads of the training process and take the
interpreter lock from the training thread whenever they run (BENCHMARKS.md, "The host beside a
device-shaped step"). In a feeder they take another process's lock.

Why an actor and not a subprocess. The pipeline is Ray Data's, which needs a process connected to the
cluster to drive its tasks: an actor is one, placed by Ray on the node named here
(``NodeAffinitySchedulingStrategy``, not soft: its arrays must reach the rank through the node's own
shared memory), owned by the training worker (it dies with it; `FeederPlan.close` kills it at the end of
the run), and its replies travel through the node's object store: an array above Ray's inline limit is
written once into shared memory and ``ray.get`` maps it into the training process without a copy. A
subprocess would need a connection of its own to the cluster (a Ray worker's fork is not one), a
shared-memory protocol of its own and a cleanup of its own.

Exact resume. The feeder holds a copy of the rank's plan (its `pipeline.train.state.Rank` without the
device or the process group) and builds each epoch's step inputs as the inline plan does, from a copy
of the cursor taken when the epoch's input is opened: what a stream reads of the cursor (the micro-batches
taken, an elastic epoch's deal, the counts a re-read starts from) is fixed for the epoch. So the same keys
reach the same steps as inline, at the same and at another world size. The training process keeps the
cursor, the agreements and the checkpoints; the feeder has none of them.

Head start. The feeder's `Prefetcher` builds ``--prefetch-steps`` ahead, and the training process keeps as
many ``next`` calls in flight (at least one; at most as many as a share of the node's object store holds,
`calls_in_flight`: each reply in flight is a step's input there) from a thread that receives the replies
(`FeederInputs`), so a step's arrays are in shared memory, and copied out of it, before the training
thread asks. When the feeder's stream runs dry, its final counts ride on its next replies
(`FeederInputs.ran_dry`), and the loop opens the next epoch on the same feeder while this epoch's last
steps train.

Device copies. On CUDA a step's arrays are copied into reused pinned buffers (`PinnedPool`) on that
receiving thread, and from there to the device on a CUDA stream of the training process's own, which the
step's stream waits for.

A dead feeder is a failed rank, never a hang: every wait on it is bounded. A feeder that died (killed, out
of memory) raises in the training process at its next wait; one silent for `WAIT_S` raises too. The rank
fails and Ray Train restarts the run from its last checkpoint, as for any failed rank (``--max-failures``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.train.config import TrainConfig
from pipeline.train.input.cursor import EpochCursor, Position
from pipeline.train.input.dataplan import DataPlan, StepInputs, plan_for
from pipeline.train.input.prefetch import PinnedPool, StepInput
from pipeline.train.state import Rank

# The longest a rank waits for one reply of its feeder. A reply is a step's input, which a feeder
# builds ahead: a wait this long is a feeder that is stuck, whose rank is failed rather than left to
# hang the run. Far above the slowest first input of an epoch seen (a new pipeline: seconds).
WAIT_S = 600.0
# The share of its node's object store that one rank's replies in flight may fill, split between the
# ranks of the node: the rest holds the decode tasks' blocks and what else the run puts there.
IN_FLIGHT_SHARE = 0.25


def calls_in_flight(depth: int, step_bytes: int, store_bytes: float, ranks_on_node: int) -> int:
    """How many ``next`` calls a rank keeps in flight: ``depth`` (``--prefetch-steps``), at most as many
    step inputs of ``step_bytes`` as its part of `IN_FLIGHT_SHARE` of the node's object store
    (``store_bytes``, shared by ``ranks_on_node``) holds, and at least one."""
    room = int(store_bytes * IN_FLIGHT_SHARE / max(ranks_on_node, 1)) // max(step_bytes, 1)
    return max(1, min(depth, room))


def step_bytes(config: TrainConfig, data_config: DataConfig, accum: int) -> int:
    """The bytes of one step's input on a rank, its uint8 patches and (MAE) an int64 index a patch."""
    patches = (data_config.image_size // data_config.patch_size) ** 2
    return config.optim.micro_batch_size * accum * patches * (data_config.patch_size**2 * 3 + 8)


def node_store_bytes() -> float:
    """This node's object store, in bytes (the cluster's where Ray does not list the node)."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here:
            return float(node.get("Resources", {}).get("object_store_memory", 0.0))
    return float(ray.cluster_resources().get("object_store_memory", 0.0))


def ranks_on_node() -> int:
    """The training ranks on this node (Ray Train's local world size; 1 outside a Train run: a test's)."""
    try:
        return ray.train.get_context().get_local_world_size()
    except RuntimeError:
        return 1


class Feeder:
    """The actor: a rank's plan, and the step inputs of each epoch opened on it (`Prefetcher`s)."""

    def __init__(self, plan: DataPlan):
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # as in the training process
        self.plan = plan
        self.inputs: dict[int, StepInputs] = {}

    def pid(self) -> int:
        return os.getpid()

    def open(self, epoch: int, cursor: EpochCursor, ahead: dict[str, Any] | None) -> None:
        """Start ``epoch``'s step inputs (`DataPlan.epoch_input`, with ``cursor`` as the rank's was)."""
        counts = None if ahead is None else BadSamples.from_dict(ahead)
        self.inputs[epoch] = self.plan.epoch_input(epoch, cursor, ahead=counts)

    def next(self, epoch: int) -> dict[str, Any]:
        """The next step input of ``epoch`` as arrays (one dict of columns a micro-batch), and the
        epoch's final counts once its stream has run dry (``dry``; None before)."""
        inputs = self.inputs[epoch]
        step_input = inputs.next()
        dry = inputs.ran_dry()
        columns = self.plan.columns
        return {
            "micro_batches": [
                {c: t.numpy() for c, t in zip(columns, mb, strict=True)} for mb in step_input.micro_batches
            ],
            "keys": step_input.keys,
            "samples": step_input.samples,
            "ran_dry": step_input.ran_dry,
            "error": step_input.error,
            "bad_samples": step_input.bad_samples.to_dict(),
            "consumed": step_input.consumed,
            "counted": step_input.counted,
            "tallied": step_input.tallied,
            "tallied_bad": step_input.tallied_bad,
            "dry": None if dry is None else dry.to_dict(),
        }

    def close(self, epoch: int) -> None:
        inputs = self.inputs.pop(epoch, None)
        if inputs is not None:
            inputs.close()


@dataclass
class FedInput(StepInput):
    """A step input from a feeder: on CUDA its pinned micro-batches go to the device on ``copy_stream``."""

    copy_stream: Any = None  # torch.cuda.Stream

    def to_device(self, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        if device.type != "cuda" or self.copy_stream is None:
            return self.micro_batches
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.copy_stream):
            copied = [tuple(t.to(device, non_blocking=True) for t in mb) for mb in self.micro_batches]
        current.wait_stream(self.copy_stream)
        for mb in copied:
            for t in mb:
                t.record_stream(current)  # made on the copy stream, used (and freed) on the step's
        return copied


@dataclass(frozen=True)
class DeviceCopies:
    """On CUDA, what every epoch's inputs copy to the device with: the pinned buffers (allocated once,
    as page-locking memory takes a driver-wide lock) and the copy stream; on CPU, neither."""

    pool: PinnedPool | None = None
    stream: Any = None  # torch.cuda.Stream

    @classmethod
    def on(cls, device: torch.device) -> DeviceCopies:
        return cls(PinnedPool(), torch.cuda.Stream(device)) if device.type == "cuda" else cls()


class FeederInputs:
    """An epoch's step inputs from the rank's feeder (`pipeline.train.input.dataplan.StepInputs`).

    Its replies are received on a thread of its own (`start`): the ``in_flight`` calls kept waiting on the
    feeder, the reply mapped from the object store and its arrays copied into pinned buffers (a ViT-B/16
    step of 256 images is 38.5 MB), up to `READY` steps ahead of the training thread, which only takes a
    step that is ready. On the training thread, that copy was a tenth of each step of the B/16 job on an
    H200 (its windows' data wait, 9-11% in every one). The epoch's final counts ride on the replies after
    the feeder found its stream's end: `ran_dry` gives them once the training thread has taken one."""

    READY = 2  # steps received and copied ahead: hides the copy; more would only pin more memory

    def __init__(
        self,
        feeder: Any,
        epoch: int,
        *,
        rank: int,
        columns: tuple[str, ...],
        in_flight: int,
        copies: DeviceCopies,
    ):
        self.feeder, self.epoch, self.rank, self.columns = feeder, epoch, rank, columns
        self.in_flight = max(in_flight, 1)
        self.pool, self.copy_stream = copies.pool, copies.stream
        self.dry: BadSamples | None = None  # the stream's final counts, once a reply taken carried them
        self.final: BadSamples | None = None  # the same, once the input where it ran dry was taken
        self._ready: queue.Queue[tuple[Any, FedInput] | BaseException] = queue.Queue(maxsize=self.READY)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin receiving this epoch's replies; the epoch's first `next` does. Not when the epoch is
        opened ahead: the feeder is one actor, and its calls for the next epoch, which wait for that
        epoch's first step, would hold up the replies of this one's last steps behind them."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._receive, name=f"feeder-replies-{self.epoch}", daemon=True
            )
            self._thread.start()

    def next(self) -> StepInput:
        """The next step's input; an empty one once the stream has run dry (as `Prefetcher.next`)."""
        if self.final is not None:
            return StepInput([], [], 0, True, "", BadSamples.from_dict(self.final.to_dict()))
        self.start()
        # The thread always puts something: a reply, or what stopped it (its waits are bounded).
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        dry, step_input = item
        if dry is not None and self.dry is None:
            self.dry = BadSamples.from_dict(dry)
        if step_input.ran_dry:
            self.final = step_input.bad_samples
        return step_input

    def ran_dry(self) -> BadSamples | None:
        """The stream's final counts once a reply taken carried them (`Prefetcher.ran_dry`)."""
        return self.dry

    def _receive(self) -> None:
        """The thread: ``in_flight`` calls kept waiting, their replies turned into step inputs in order,
        until the stream runs dry (the calls then in flight would return empty replies), an error, or
        `close`."""
        pending: deque[Any] = deque()
        try:
            while not self._stop.is_set():
                while len(pending) < self.in_flight:
                    pending.append(self.feeder.next.remote(self.epoch))
                reply = self.wait(pending.popleft())
                step_input = self.step_input(reply)
                if not self._put((reply["dry"], step_input)) or step_input.ran_dry:
                    return
        except BaseException as e:  # the training thread raises it at its next step
            self._put(e)

    def _put(self, item: Any) -> bool:
        """Hand ``item`` to the training thread once it has room; False once the epoch is closed."""
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def wait(self, ref: Any) -> dict[str, Any]:
        try:
            return ray.get(ref, timeout=WAIT_S)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"the data feeder of worker {self.rank} died ({str(e).splitlines()[0]}); the run restarts "
                "from its last checkpoint where --max-failures allows"
            ) from e
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(
                f"the data feeder of worker {self.rank} sent no step input in {WAIT_S:g} s; the run restarts "
                "from its last checkpoint where --max-failures allows"
            ) from e

    def step_input(self, reply: dict[str, Any]) -> FedInput:
        batches = reply["micro_batches"]
        if self.pool is not None:
            buffers = [self.pool.take(b, self.columns) for b in batches]
            tensors = [tuple(buf[c] for c in self.columns) for buf in buffers]
        else:
            buffers = []
            # Arrays mapped from the object store are read-only, which torch must not wrap.
            tensors = [tuple(torch.from_numpy(np.array(b[c])) for c in self.columns) for b in batches]
        return FedInput(
            micro_batches=tensors, keys=reply["keys"], samples=reply["samples"], ran_dry=reply["ran_dry"],
            error=reply["error"], bad_samples=BadSamples.from_dict(reply["bad_samples"]), buffers=buffers,
            consumed=reply["consumed"], counted=reply["counted"], tallied=reply["tallied"],
            tallied_bad=reply["tallied_bad"], copy_stream=self.copy_stream,
        )  # fmt: skip

    def release(self, step_input: StepInput) -> None:
        """After `StepInput.to_device`: its pinned buffers may be refilled once the copies are done."""
        if self.pool is not None:
            self.pool.give_back(step_input.buffers)

    def close(self) -> None:
        """Stop receiving, and the epoch's pipeline in the feeder (neither waited for: the thread ends at
        its next reply, and the feeder's next call waits behind its close)."""
        self._stop.set()
        with contextlib.suppress(ray.exceptions.RayActorError):  # died: its next wait says so
            self.feeder.close.remote(self.epoch)


class FeederPlan:
    """The rank's plan with its pipeline in a feeder (module docstring); what the loop asks of the plan
    beside the step inputs (position, fingerprint, decode CPUs, metrics) is the inline plan's. ``depth``:
    the ``next`` calls its step inputs keep in flight (`calls_in_flight`)."""

    def __init__(self, inline: DataPlan, me: Rank, depth: int):
        self.inline, self.me, self.depth = inline, me, depth
        self.fingerprint = inline.fingerprint
        self.feeder: Any = None  # the actor, started with the first epoch's input
        self.copies = DeviceCopies.on(me.device)

    def position(self) -> Position:
        return self.inline.position()

    def cpus(self, epoch: int) -> float:
        return self.inline.cpus(epoch)

    def metrics(self, counts: BadSamples, group: dist.ProcessGroup | None) -> dict[str, Any]:
        return self.inline.metrics(counts, group)

    def epoch_input(
        self,
        epoch: int,
        cursor: EpochCursor,
        *,
        ahead: BadSamples | None,
    ) -> StepInputs:
        if self.feeder is None:
            self.feeder = self.start()
        # What the stream reads of the cursor, not the samples it has consumed (large, and not read).
        snapshot = replace(cursor, samples=None)
        self.feeder.open.remote(epoch, snapshot, None if ahead is None else ahead.to_dict())
        return FeederInputs(
            self.feeder, epoch, rank=self.me.rank, columns=self.inline.columns, in_flight=self.depth,
            copies=self.copies,
        )  # fmt: skip

    def start(self) -> Any:
        """The feeder actor on this node, holding a copy of the plan without the device or the group."""
        plan = copy.copy(self.inline)
        plan.me = Rank(self.me.rank, self.me.world, torch.device("cpu"), None, self.me.accum)
        here = ray.get_runtime_context().get_node_id()
        actor = ray.remote(Feeder).options(
            num_cpus=0,  # its pipeline's tasks reserve the decode CPUs; the feeder drives them
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            max_restarts=0,  # a restarted feeder would not know where its stream stood
        )
        return actor.remote(plan)

    def close(self) -> None:
        """Stop the feeder (the run is over or failed)."""
        if self.feeder is not None:
            ray.kill(self.feeder)
            self.feeder = None


def feeder_plan_for(
    loop_config: dict[str, Any],
    config: TrainConfig,
    data_config: DataConfig,
    me: Rank,
    columns: tuple[str, ...],
) -> DataPlan:
    """`pipeline.train.input.dataplan.plan_for`, its pipeline in a feeder with ``--data-process feeder``."""
    plan = plan_for(loop_config, config, data_config, me, columns)
    if config.speed.data_process != "feeder":
        return plan
    in_flight = calls_in_flight(
        config.speed.prefetch_steps,
        step_bytes(config, data_config, me.accum),
        node_store_bytes(),
        ranks_on_node(),
    )
    return FeederPlan(plan, me, in_flight)
