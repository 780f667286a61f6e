"""The training job's host work beside a device-shaped step: does the host keep a GPU busy?

    python jobs/benchmark.py host --step-ms 50 --steps 200 --log-every 20
    python jobs/benchmark.py host --device-queue 0 ...     # a host that waits for the device every step
    python jobs/benchmark.py host --probe ...              # every checkpoint probed beside training

The real job on a local Ray (the driver, Ray Train's worker loop `pipeline.train.loop`, the rank's Ray
Data pipeline decoding synthetic JPEG shards on this machine's other cores) with one change: the
model step is a wait of ``--step-ms`` on a device (`DeviceQueue`) that holds no interpreter lock, as a
GPU step does for the host. A host that keeps up runs at the ideal 1000 / step-ms steps a second; what
it loses is host work the device waits for: the next step's input, the loop's own bookkeeping, log
lines, checkpoints, and any time the training thread could not get the interpreter or a core.

The device runs behind the host, as a CUDA stream does: the loop never waits for the GPU inside a step
(the input's copy is non-blocking, loss and skipped steps are summed on the device), so a step's call
queues its kernels and returns, and the host builds the next step's input while the device runs.
``--device-queue N`` (default 1) steps may wait behind the running one before a step's call blocks, as a
host blocks when the stream's launch queue (about a thousand kernels: a step or so) is full; host work
up to about a step's length is then hidden. The host waits for the device where the loop reads a device
value: until the device has run every step queued (`device_reads`: a checkpoint, an evaluation, the end),
or, at a log line, until it has run the log line's step, once the next step is queued behind it (the
event of the window's copy, `DeviceQueue.event`).
``--device-queue 0`` is a host that synchronizes every step: it waits out each step, then does its own
work, serially (a real loop with AdamW kernels other than fused reads the gradient norm every step).

Per log window (``--log-every`` steps; the first holds the start), from the end of one window's last
step on the device to the end of the next's (so every second is in one window): achieved steps/s against the ideal, the host milliseconds a step outside its waits
for the device (median, p99, max), and where the training thread was (`pipeline.train.observe.stacks`: the
share of its samples waiting for the device and in each part of the loop, the longest gap between two
samples, what it did in the window's slowest step). With py-spy installed, the threads of the training
process that held the interpreter lock over the run, by thread, from ``py-spy record --gil``.
"""

from __future__ import annotations

import argparse
import functools
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs.benchmarks.report import machine, print_table, write_json

# "MS,N,DIR": the wait a step, the device's queue (`DeviceQueue`), where each step's record is written
STEPS_ENV = "VITRAY_DEVICE_STEP"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python jobs/benchmark.py host", description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, default=50.0, help="the device-shaped wait of a step")
    p.add_argument(
        "--device-queue", type=queue_depth, default=1, metavar="N",
        help="steps that wait behind the one the device runs before a step call blocks, as a CUDA "
        "stream's launch queue (about a thousand kernels: a step or so) lets a host run ahead; 0: the "
        "host waits for every step, a host that synchronizes with the device each step",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20, help="steps a window (a log line each)")
    p.add_argument("--batch-size", type=int, default=16, help="images a step")
    p.add_argument(
        "--micro-batch-size", type=int, default=8, help="images a micro-batch (accumulation: the rest)"
    )
    p.add_argument("--images", type=int, default=2048, help="synthetic images in the shards")
    p.add_argument("--source-size", type=int, default=160, help="side of the JPEGs decoded")
    p.add_argument("--image-size", type=int, default=64, help="side of the crop the step takes")
    p.add_argument(
        "--model", default="vit_ti16", help="built but never stepped (its optimizer is checkpointed)"
    )
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument(
        "--data-process", choices=("inline", "feeder"), default="inline",
        help="where the rank's pipeline runs (the job's --data-process)",
    )  # fmt: skip
    p.add_argument(
        "--probe", action="store_true",
        help="the checkpoint probe on (--probe-data, --probe-eval-data: synthetic shards of its own, "
        "--probe-images of them), its task on one more logical CPU of the local Ray",
    )  # fmt: skip
    p.add_argument("--probe-images", type=int, default=384, help="with --probe: images of its two sets")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2, help="logical CPUs of the local Ray")
    p.add_argument("--no-py-spy", action="store_true", help="do not sample the GIL holder with py-spy")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def queue_depth(text: str) -> int:
    """``--device-queue``: a whole number, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is no number of steps: give 0 or more (1: the default)")
    return int(text)


def device_shaped_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    """A Ray Train worker running the real loop, its `TrainStep` replaced by `wait_step_class`'s and its
    reads of device values waiting for that step's device (`wait_at_device_reads`)."""
    from pipeline.train import loop

    device = DeviceQueue(int(os.environ[STEPS_ENV].split(",")[1]))
    loop.TrainStep = wait_step_class(device)
    wait_at_device_reads(device)
    return loop.train_loop_per_worker(loop_config)


class DeviceQueue:
    """The device of the device-shaped step: each step's wait runs here, after the ones before it.

    ``depth`` 0: `launch` waits in the caller, a host that synchronizes with the device every step.
    ``depth`` >= 1: the waits run one after another on a thread of their own (a ``time.sleep``, which
    holds no interpreter lock), as a CUDA stream runs a step's kernels after the last step's; `launch`
    returns at once unless ``depth`` waits are already pending behind the running one, and then blocks
    until the device takes the next, as a host blocks when the stream's launch queue is full. `drain`
    waits until every launched wait has ended: what a read of a device value does (``tolist``, ``item``).
    `event` is a CUDA event recorded behind the waits launched so far: its ``synchronize`` waits for
    those, not for the ones launched after it.
    """

    def __init__(self, depth: int):
        if depth < 0:
            raise ValueError(f"a device queue of {depth} steps; give 0 or more")
        self.depth = depth
        # (when launched, seconds, its callback) of each wait launched and not yet running
        self.pending: queue.Queue[tuple[float, float, Callable[[float], None]]] = queue.Queue(max(depth, 1))
        self.idle = threading.Condition()
        self.launched = 0  # waits launched and not ended
        self.total, self.ended = 0, 0  # waits launched, and ended, since the start
        self.drained_s = 0.0  # the seconds `drain` and events have waited, all told
        if depth:
            threading.Thread(target=self._run, name="vitray-device", daemon=True).start()

    def launch(self, seconds: float, ended: Callable[[float], None]) -> None:
        """A wait of ``seconds`` after those launched before; ``ended(when)`` is called as it ends (on the
        device's thread), with its end on `time.time`'s clock."""
        if not self.depth:
            time.sleep(seconds)  # releases the interpreter lock, as a wait for the GPU does
            ended(time.time())
            with self.idle:
                self.total += 1
                self.ended += 1
            return
        with self.idle:
            self.launched += 1
            self.total += 1
        self.pending.put((time.time(), seconds, ended))  # blocks while `depth` waits are pending

    def _run(self) -> None:
        free = 0.0  # when the device ended its last wait
        while True:
            launched, seconds, ended = self.pending.get()
            # A GPU starts a queued step as soon as the step before it ends, whoever holds the host's
            # interpreter lock: each wait ends at its own time, however late this thread wakes to it.
            free = max(free, launched) + seconds
            time.sleep(max(free - time.time(), 0.0))
            try:
                ended(free)
            finally:
                with self.idle:
                    self.launched -= 1
                    self.ended += 1
                    self.idle.notify_all()

    def drain(self) -> None:
        """Until every launched wait has ended."""
        with self.idle:
            total = self.total
        self.wait_until(total)

    def wait_until(self, launched: int) -> None:
        """Until the first ``launched`` waits have ended (those launched after them may still run)."""
        started = time.perf_counter()
        with self.idle:
            self.idle.wait_for(lambda: self.ended >= launched)
        self.drained_s += time.perf_counter() - started

    def event(self) -> QueuedEvent:
        """An event behind the waits launched so far."""
        with self.idle:
            return QueuedEvent(self, self.total)


class QueuedEvent:
    """`DeviceQueue.event`: ``synchronize`` waits until the device has run the waits launched before
    it was recorded, as a CUDA event's does."""

    def __init__(self, device: DeviceQueue, launched: int):
        self.device, self.launched = device, launched

    def synchronize(self) -> None:
        self.device.wait_until(self.launched)


def device_reads() -> list[tuple[Any, str]]:
    """(owner, attribute) of each place where the loop (`pipeline.train.loop`) reads a device value
    queued last, and a real step's host therefore waits for every step queued. Besides these it waits only
    for an event behind a step (`pipeline.train.observe.host_copy.HostCopy`; `wait_at_device_reads` models it with
    `DeviceQueue.event`): a log line's (its step, not the one queued after it) and a checkpoint's finite
    check (`pipeline.train.checkpointing.saver.FiniteCheck`, read inside the next step). Its step, the input's copy
    and the metrics' sums are queued and never read back in between (with fused AdamW, the default on
    CUDA; other AdamW kernels read the gradient norm every step, `pipeline.train.step.train_step`)."""
    from pipeline.train import finetune
    from pipeline.train.checkpointing import saver

    return [
        (saver.Checkpointer, "close"),  # the run's end: its last save, then the export of the weights
        (finetune, "evaluate_in_run"),  # an evaluation's accuracy (``item``); none in this benchmark
    ]


def wait_at_device_reads(device: DeviceQueue, patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Each of `device_reads()` drains ``device`` first, and a log line's copy records its event on
    ``device`` (``patch``: how an attribute is replaced; a test's undoes itself)."""
    from pipeline.train.observe.host_copy import HostCopy

    for owner, name in device_reads():
        patch(owner, name, _after_drain(device, getattr(owner, name)))
    patch(HostCopy, "record_event", staticmethod(lambda _: device.event()))


def _after_drain(device: DeviceQueue, read: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(read)
    def drained_first(*args: Any, **kwargs: Any) -> Any:
        device.drain()
        return read(*args, **kwargs)

    return drained_first


def wait_step_class(device: DeviceQueue) -> type:
    """`TrainStep` with a wait on ``device`` in place of the model's work (imported in the worker: torch)."""
    from pipeline.train.step.train_step import Gradients, StepStats, TrainStep

    class _WaitStep(TrainStep):
        """The step's place in the loop, its optimizer (checkpoints hold it) and its stats, with a wait
        of ``VITRAY_DEVICE_STEP``'s milliseconds on the device in place of forward, backward and update.
        Each step's record (`read_steps`): its host seconds since the last step's call returned, less
        the device reads' waits (`DeviceQueue.drain`) between; when its wait ended on the device. Its
        two calls are the real step's (`TrainStep.forward_backward`, `TrainStep.update`)."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            import torch

            ms, _, directory = os.environ[STEPS_ENV].split(",", 2)
            self.wait_s = float(ms) / 1000
            self.out = open(Path(directory) / f"steps-{os.getpid()}.tsv", "a", buffering=1)  # noqa: SIM115
            self.zero = torch.zeros((), device=self.device)
            self.first_update()
            self.device_queue = device
            self.returned, self.drained = time.time(), device.drained_s  # as the last call returned

        def first_update(self) -> None:
            """The optimizer's state as a real first step leaves it (its moments, its step count), from an
            update at learning rate 0 that changes no weight. Without it the first checkpoint would make
            that state: DCP's state dict runs an optimizer step when the optimizer has none, through
            DTensor's first (uncached) sharding propagation, seconds of host time that a real run spends
            in its first step, not at its first save."""
            import torch

            rates = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
                group["lr"] = lr

        def forward_backward(
            self, step: int, micro_batches: list, global_count: int, micro_steps: int | None = None
        ) -> Gradients:
            """The step's wait launched on the device, in place of its forward and backward; the loop's
            work before the update (a checkpoint's copy, which the real step waits for before it queues
            its update) follows it, while the device runs the wait."""
            called, since, device = time.time(), self.returned, self.device_queue
            host = called - since - (device.drained_s - self.drained)

            def ended(when: float) -> None:  # the clock of `pipeline.train.observe.stacks` samples
                self.out.write(f"{step + 1}\t{host:.6f}\t{when:.6f}\t{since:.6f}\t{called:.6f}\n")

            device.launch(self.wait_s, ended)
            count = sum(len(mb[0]) for mb in micro_batches)
            return Gradients(step, self.zero, self.zero.long(), count)

        def update(self, gradients: Gradients) -> StepStats:
            """No update: the step's stats, as the host's last call of the step returns."""
            self.returned, self.drained = time.time(), self.device_queue.drained_s
            zero = self.zero
            return StepStats(zero, gradients.correct, gradients.count, zero, 0.0, zero.bool())

    return _WaitStep


def read_steps(directory: Path) -> list[tuple[int, float, float, float, float]]:
    """(step, host seconds outside the waits before its call, when its wait ended on the device, when the
    call before it returned, when it was called) of every step the workers wrote."""
    rows = []
    for path in directory.glob("steps-*.tsv"):
        for line in path.read_text().splitlines():
            step, *times = line.split("\t")
            rows.append((int(step), *(float(t) for t in times)))
    return sorted(rows)


def window_rows(steps: list[tuple], log_every: int, step_ms: float) -> list[dict[str, Any]]:
    """One row per window of ``log_every`` steps: steps/s against the ideal, and the host ms a step
    (each of ``steps``: step, host seconds, when its wait ended on the device, maybe more). A window runs
    from the end of the last window's last wait on the device to the end of its own last wait (the first
    from its first step's start), as the loop cuts its windows (`pipeline.train.observe.metrics.MetricsWindow`):
    every second is in one window, a log line's and a checkpoint's host time in the next one."""
    ideal = 1000 / step_ms
    rows = []
    by_step = {s: (host, ended) for s, host, ended, *_ in steps}
    last = max(by_step, default=0)
    for end in range(log_every, last + 1, log_every):
        chosen = [by_step[s] for s in range(end - log_every + 1, end + 1) if s in by_step]
        if len(chosen) < log_every:
            continue
        before = by_step.get(end - log_every)
        start = before[1] if before else chosen[0][1] - step_ms / 1000 - chosen[0][0]
        seconds = chosen[-1][1] - start
        host_ms = sorted(1000 * h for h, _ in chosen)
        rate = log_every / seconds
        rows.append({
            "steps": f"{end - log_every + 1}-{end}",
            "steps/s": rate,
            "of ideal": rate / ideal,
            "host ms median": statistics.median(host_ms),
            "host ms p99": host_ms[min(len(host_ms) - 1, round(0.99 * (len(host_ms) - 1)))],
            "host ms max": host_ms[-1],
        })  # fmt: skip
    return rows


# Frames of the training thread waiting for the device: a step call on a full queue, a read (`drain` and
# an event both wait in `wait_until`).
DEVICE_WAITS = ("host.py:launch", "host.py:wait_until")


def stack_parts(tsv: Path, rows: list[dict[str, Any]], steps: list[tuple]) -> None:
    """Add to each window's row where the training thread was: `device`, waiting for the device (a
    step's wait, a full queue, a read of a device value), else the parts of `pipeline.train.observe.stacks` (the
    innermost frames most often sampled in `other`); and
    what it did in the window's slowest step outside those waits: the innermost frames sampled between
    the return of the step before and its call, most frequent first."""
    from pipeline.train.observe.stacks import PARTS, part_of, windows

    if not tsv.is_file():
        return
    lines = tsv.read_text().splitlines()
    found = {w.last_step: w for w in windows(lines) if w.last_step is not None}
    samples = [
        (float(t), stack, "device" if any(f in stack for f in DEVICE_WAITS) else part_of(stack))
        for t, stack in ((t, rest.split(" < ")) for t, _, rest in (x.partition("\t") for x in lines))
        if not stack[0].startswith("step ")  # a log line's mark
    ]
    names = ("device", *(name for name, _ in PARTS), "other")
    by_step = {s: (host, since, called) for s, host, _, since, called in steps}
    for row in rows:
        first, last = (int(x) for x in row["steps"].split("-"))
        w = found.get(last)
        if w is None or not w.samples:
            continue
        inside = [(stack, part) for t, stack, part in samples if w.start <= t <= w.end]
        parts, n = Counter(part for _, part in inside), max(len(inside), 1)
        other = Counter(stack[0] for stack, part in inside if part == "other").most_common(2)
        row["where"] = " ".join(f"{name} {100 * parts[name] / n:.0f}%" for name in names)
        row["where"] += f" ({', '.join(f'{f} {k}' for f, k in other)})" if other else ""
        row["gap s"] = w.longest_gap
        worst = max(range(first, last + 1), key=lambda s: by_step.get(s, (0.0,))[0])
        _, begin, end = by_step.get(worst, (0.0, 0.0, 0.0))
        frames = Counter(
            stack[0]
            for t, stack, part in samples
            if begin <= t <= end and part != "device" and stack[0] != "?"
        )
        row["slowest step"] = f"{worst}: " + ", ".join(f"{f} {k}" for f, k in frames.most_common(2))


def gil_holders(raw: Path) -> list[dict[str, Any]]:
    """From ``py-spy record --gil --threads --format raw``: each thread's share of the samples that
    held the interpreter lock, and its innermost frame most often."""
    threads: dict[str, int] = {}
    frames: dict[str, dict[str, int]] = {}
    for line in raw.read_text().splitlines() if raw.is_file() else []:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        thread = parts[0].split(" ")[-1].strip('"') if parts else "?"
        threads[thread] = threads.get(thread, 0) + int(count)
        inner = parts[-1].split(" (")[0] if len(parts) > 1 else "?"
        frames.setdefault(thread, {})
        frames[thread][inner] = frames[thread].get(inner, 0) + int(count)
    total = sum(threads.values()) or 1
    return [
        {"thread": t, "GIL samples": n, "share": n / total, "top frame": max(frames[t], key=frames[t].get)}
        for t, n in sorted(threads.items(), key=lambda kv: -kv[1])
    ]


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    import ray

    from pipeline.cli import apply_local_ray_env
    from pipeline.data.synthetic import write_synthetic_shards
    from pipeline.evaluate import checkpoint_probe
    from pipeline.train.config import TrainConfig
    from pipeline.train.driver import fit, read_metrics

    scratch = Path(tempfile.mkdtemp(prefix="vitray-bench-host-"))
    shards = write_synthetic_shards(
        scratch / "shards", args.images, samples_per_shard=max(args.images // 8, 1),
        image_size=args.source_size, num_classes=10,
    )  # fmt: skip
    record = scratch / "steps"
    record.mkdir()
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.environ[STEPS_ENV] = f"{args.step_ms},{args.device_queue},{record}"
    os.environ["VITRAY_SAMPLE_STACKS"] = str(scratch / "stacks")
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    probe: dict[str, Any] = {}
    if args.probe:  # two thirds to fit on, a third to score, each its own shards
        sets = [("probe", 2 * args.probe_images // 3, 1), ("probe-eval", args.probe_images // 3, 2)]
        fit_on, scored = (
            write_synthetic_shards(
                scratch / name,
                n,
                samples_per_shard=max(n // 2, 1),
                image_size=args.source_size,
                num_classes=10,
                seed=seed,
            )
            for name, n, seed in sets
        )
        probe = {"probe_data": ",".join(fit_on.urls), "probe_eval_data": ",".join(scored.urls)}
    apply_local_ray_env()
    cpus = args.num_cpus + (1 if args.probe else 0)  # the probe's task: one logical CPU beside the rest
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    config = TrainConfig().replace(
        model=args.model, image_size=args.image_size, num_classes=10, batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size, num_workers=1, use_gpu=False, max_steps=args.steps, warmup_steps=1,
        checkpoint_every=args.checkpoint_every, log_every=args.log_every, keep_checkpoints=1,
        data_process=args.data_process,
        max_failures=0, shards=",".join(shards.urls), out=str(scratch / "run"), **probe,
    )  # fmt: skip
    spy = None if args.no_py_spy else _start_py_spy(record, scratch / "gil.txt", args)
    started = time.perf_counter()
    fit(
        config,
        shards.urls,
        worker_loop=device_shaped_worker,
        scorer=checkpoint_probe.score if args.probe else None,
    )
    seconds = time.perf_counter() - started
    if spy is not None:
        try:
            spy.wait(timeout=30)  # it ends with the worker's process
        except subprocess.TimeoutExpired:
            spy.terminate()
            spy.wait()
    ray.shutdown()
    steps = read_steps(record)
    rows = window_rows(steps, args.log_every, args.step_ms)
    stack_parts(scratch / "stacks" / "stacks-rank0.tsv", rows, steps)
    logged = {r["step"]: r for r in read_metrics(str(scratch / "run"))}
    for row in rows:  # the log line that ends each window: its collection and checkpoint stall
        at = logged.get(int(row["steps"].split("-")[1]), {})
        row["gc s"], row["ckpt s"] = at.get("gc_s"), at.get("checkpoint_stall_s")
    later = [r["of ideal"] for r in rows[1:]]
    title = (
        f"host beside a {args.step_ms:g} ms device-shaped step: batch {args.batch_size} "
        f"({args.micro_batch_size} a micro-batch), {args.source_size}px JPEGs cropped to {args.image_size}px, "
        f"{args.num_cpus} CPUs, data process {args.data_process}, device queue {args.device_queue}"
        f"{', the checkpoint probe on' if args.probe else ''}; "
        f"ideal {1000 / args.step_ms:.1f} steps/s"
    )
    if later:
        title += f"; windows after the first: {min(later):.1%} to {max(later):.1%} of ideal"
    print_table(title, rows)
    holders = gil_holders(scratch / "gil.txt")
    if holders:
        print_table(
            "who held the interpreter lock in the training process (py-spy --gil, whole run)", holders
        )
    figures = {"config": vars(args), "rows": rows, "gil": holders, "run_s": seconds,
               "worst_after_first": min(later) if later else None, "machine": machine()}  # fmt: skip
    if args.json:
        write_json(args.json, figures)
    shutil.rmtree(scratch, ignore_errors=True)
    return figures


def _start_py_spy(record: Path, out: Path, args: argparse.Namespace) -> subprocess.Popen | None:
    """py-spy on the training worker once it has written its first step, in the background; None
    without py-spy."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("py-spy is not installed: no GIL holders (pip install py-spy)", flush=True)
        return None
    script = (
        f"while ! ls {record}/steps-*.tsv >/dev/null 2>&1; do sleep 0.2; done; "
        f'pid=$(ls {record}/steps-*.tsv | head -1 | sed "s/.*steps-//; s/.tsv//"); '
        f"exec {exe} record --pid $pid --gil --threads --format raw --rate 50 --nonblocking "
        f"--output {out} --duration {int(args.steps * args.step_ms / 1000 * 3) + 30}"
    )
    return subprocess.Popen(["bash", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
