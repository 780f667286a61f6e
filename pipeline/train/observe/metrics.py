"""Training metrics: sums over a logging window, one readable log line per interval, and
`metrics.jsonl` beside the checkpoints."""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeline import storage
from pipeline.train.observe import stacks
from pipeline.train.observe.collector import Collector
from pipeline.train.observe.host_copy import HostCopy
from pipeline.train.observe.mfu import mfu
from pipeline.train.observe.stragglers import slow_window, straggler

if TYPE_CHECKING:
    from pipeline.train.state import TrainState

METRICS_FILE = "metrics.jsonl"
# The accuracies a row may hold, in the order they are printed: (key, the log line's label, the summary's).
ACCURACIES = (
    ("accuracy", "acc", "accuracy"),
    ("eval_accuracy", "eval acc", "eval accuracy"),
    ("eval_ema_accuracy", "EMA eval acc", "EMA eval accuracy"),
    ("val_accuracy", "val acc", "val accuracy"),  # the validation split's (`pipeline.train.scoring.best`)
)


def log_line(line: str) -> None:
    """One line to the run's log. Written to stdout directly: Ray Train's patched `print` would
    show every line twice on the driver (once from stdout, once through its logger)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@dataclass
class RunTotals:
    """What the windows of one attempt share: when its first window began, the images stepped over
    since (all ranks), and Python's collector (`pipeline.train.observe.collector`)."""

    start: float
    collector: Collector
    images: float = 0.0


class MetricsWindow:
    """Sums over the steps since the last log line, on every rank.

    Loss and top-1 hits stay on the device, so adding a step never waits for the GPU. A log line at
    step N cuts the window in two moves. `close`, as soon as step N is queued: the window's device
    sums, the gradient norm and the skipped steps' counts are copied behind step N (`HostCopy`) without
    waiting for the device, and the next window begins collecting step N+1's sums. `reduce`, then or
    (the loop's plain log lines: `pipeline.train.loop`) once step N+1 is queued too: it waits for the
    device to have run step N, and no later step, and that instant is the window's end and the next
    one's start (on CPU, where a step's work is done when its call returns, the instant of `close`):
    every second of the run is in exactly one window, the device's backlog at a log line included, a
    window shows what the device did in it, not what the host queued, and a report's host work after
    the wait falls in the next window, beside the device's next step. Its all-reduces are of host
    values, over the CPU group it is given, and wait for no device.

    Python's collector runs at log lines only: the first window makes the run's `Collector`, which turns
    its automatic collections off, and each log line's collection is timed into the window after the
    device wait and reported as ``gc_s``.
    """

    def __init__(self, device: torch.device, totals: RunTotals | None = None):
        self.device = device
        self.loss = torch.zeros((), dtype=torch.float64, device=device)  # summed per-sample loss
        self.correct = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0  # samples stepped over
        # Samples of the steps not skipped: what loss and accuracy average over.
        self.scored = torch.zeros((), dtype=torch.float64, device=device)
        self.data_wait = 0.0  # seconds spent waiting for the next step's batches
        # Seconds spent in the steps' agreements (`pipeline.train.state.agree_on_step`): where a rank
        # that is ahead waits for the others; the rest of the window is its own time (`reduce`).
        self.sync_wait = 0.0
        self.steps = 0
        first = totals is None
        if totals is None:
            totals = RunTotals(start=time.perf_counter(), collector=Collector())
        self.totals = totals
        self.start = totals.start if first else time.perf_counter()  # a following one's: set at `wait`
        self.copy: HostCopy | None = None  # set by `close`: the device values as of the last step
        self.next: MetricsWindow | None = None  # the window `close` began, from the instant this one ends
        self.values: list[float] = []  # the copy's, once `wait` has read them
        self.end: float | None = None  # set by `wait`, when the device has run the last step

    def add_step(
        self, loss_sum: torch.Tensor, correct: torch.Tensor, count: int, skipped: torch.Tensor
    ) -> None:
        """One step's sums on this rank; a skipped step's (non-finite) loss is left out, on the device."""
        self.count += count
        self.steps += 1
        kept = ~skipped
        self.loss += torch.where(kept, loss_sum, 0.0)
        self.correct += torch.where(kept, correct, 0)
        self.scored += kept * count

    def close(self, grad_norm: torch.Tensor, skipped: SkippedSteps | None = None) -> MetricsWindow:
        """The window's last step is queued: copy its device sums, the step's ``grad_norm`` and
        ``skipped``'s counts behind it, without waiting for the device, and begin the next window."""
        counts = skipped.take() if skipped is not None else torch.zeros(2, device=self.device)
        norm = grad_norm.to(self.device, torch.float64).reshape(1)
        sums = torch.stack([self.loss, self.correct, self.scored])
        self.copy = HostCopy(torch.cat([sums, norm, counts.to(torch.float64)]))
        self.next = MetricsWindow(self.device, self.totals)
        return self.next

    def wait(self) -> tuple[int, int]:
        """Until the device has run the window's last step (not the steps queued after it): the
        window ends there and the next one starts. Returns ``skipped``'s counts as `close` took them."""
        if self.copy is None or self.next is None:
            raise RuntimeError("a window waits for the device only once closed")
        if self.end is None:
            self.values, self.end = self.copy.wait()
            self.next.start = self.end
        return int(self.values[4]), int(self.values[5])

    def reduce(
        self,
        *,
        step: int,
        epoch: int,
        lr: float,
        samples_seen: int,
        bad_samples: int,
        skipped_steps: int,
        flops_per_image: float,
        peak_tflops: float | None,
        grad_norm: torch.Tensor | None = None,
        has_accuracy: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Collective over ``group``: this window's metrics over all ranks, one `metrics.jsonl` row; the
        window is closed (with ``grad_norm``) unless `close` did, and ends at its `wait`.

        `samples_seen` and `bad_samples` are this rank's run totals as of the window's last step;
        `grad_norm` and `skipped_steps` (the run's total) are the same on every rank. Without
        `has_accuracy` (an objective with no classes, MAE) ``accuracy`` is None. ``run_images_per_s``
        is the attempt's rate so far, every window. ``rank_step_s``: each rank's own seconds per step
        (the window less its waits at the steps' agreements), gathered in the same all-reduce: each
        rank fills its own place of a zero vector.
        """
        if self.copy is None:
            if grad_norm is None:
                raise ValueError("an open window needs its last step's grad_norm to close")
            self.close(grad_norm)
        self.wait()
        assert self.end is not None
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        gc_s = self.totals.collector.collect()
        own = [0.0] * world
        own[rank] = (self.end - self.start - self.sync_wait) / max(self.steps, 1)
        loss, correct, scored, norm = self.values[:4]
        sums = torch.tensor(
            [loss, correct, scored, self.count, self.data_wait, samples_seen, bad_samples, gc_s, *own],
            dtype=torch.float64,
        )
        dist.all_reduce(sums, group=group)
        (loss, correct, scored, count, wait, seen, n_bad, gc_sum), step_s = (
            sums[:8].tolist(),
            sums[8:].tolist(),
        )
        elapsed = self.end - self.start
        self.totals.images += count
        memory = torch.tensor([_memory_gib(self.device)], dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX, group=group)
        images_per_s = count / elapsed
        return {
            "step": step,
            "epoch": epoch,
            "loss": loss / scored if scored else float("nan"),
            "accuracy": (correct / scored if scored else float("nan")) if has_accuracy else None,
            "lr": lr,
            "grad_norm": norm,
            "images_per_s": images_per_s,
            "images_per_s_per_worker": images_per_s / world,
            "mfu": mfu(images_per_s, flops_per_image, peak_tflops, devices=world),
            "data_wait_share": wait / (world * elapsed),
            "samples_seen": int(seen),
            "bad_samples": int(n_bad),
            "skipped_steps": skipped_steps,
            "memory_gib": memory.item(),
            "gc_s": gc_sum / world,  # the ranks' mean
            "run_images_per_s": self.totals.images / (self.end - self.totals.start),
            "rank_step_s": step_s,
        }


class SkippedSteps:
    """Steps skipped for a non-finite loss or gradient norm, counted on the device, so that a step never
    waits for its verdict; taken when a log line is due (`MetricsWindow.close`) and read with the
    window's sums."""

    def __init__(self, device: torch.device):
        self.unread = torch.zeros((), device=device)  # skipped since the last take
        self.in_a_row = torch.zeros((), device=device)  # the latest steps, all skipped

    def add(self, skipped: torch.Tensor) -> None:
        skipped = skipped.float()
        self.unread += skipped
        self.in_a_row = (self.in_a_row + skipped) * skipped

    def take(self) -> torch.Tensor:
        """(skipped since the last take, skipped in a row up to the latest step), on the device: queued
        behind the steps so far, no wait."""
        counts = torch.stack([self.unread, self.in_a_row])
        self.unread.zero_()
        return counts

    @staticmethod
    def check(state: TrainState, step: int, counts: tuple[int, int], limit: int, rank: int) -> str:
        """At each log line, step ``step``'s ``counts`` (`take`, as read by `MetricsWindow.wait`): add the
        skipped steps since the last one to ``state.skipped_steps`` (rank 0 logs them) and return the
        one-line error that ends the run when ``limit`` (--max-skipped-steps) came in a row, else "".
        Found at most --log-every steps late, and at a log line that is no checkpoint, evaluation or
        last step one step later again: the loop reads that line's counts once the next step is queued
        (`pipeline.train.loop`); a skipped step changes no weight, and a checkpoint's own log line reads
        its counts before it saves. Every rank sees the same global gradient norm, so every rank
        decides alike without a collective."""
        new, in_a_row = counts
        if not new:
            return ""
        state.skipped_steps += new
        if rank == 0:
            log_line(
                f"{new} step(s) up to step {step} skipped for a non-finite loss or gradient norm; "
                f"{in_a_row} in a row, {state.skipped_steps} in the run"
            )
        if in_a_row < limit:
            return ""
        return (
            f"{in_a_row} steps in a row (up to step {step}) had a non-finite loss or "
            f"gradient norm and were skipped, --max-skipped-steps {limit}; resume from the last "
            "checkpoint with a lower --lr or a smaller --grad-clip, or check the data"
        )


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricsLog:
    """Rank 0's record of logged steps, kept in `<run>/metrics.jsonl` (one JSON object a line).

    On resume, lines past the resumed step (written by a run that died before its next
    checkpoint) are dropped, so the file always describes one history. Local files are rewritten
    atomically each time; object stores get the whole file at each flush (a few hundred KB at most),
    once per checkpoint: the loop stores a checkpoint's row before the save (`flush(pending=row)`), and
    its append after the save writes nothing more there.
    """

    def __init__(self, run_dir: storage.Location | str, resume_step: int = 0, *, watch: bool = False):
        self.uri = storage.as_location(run_dir).join(METRICS_FILE)
        # With ``watch`` (rank 0's log, built on the training thread): that thread sampled, so that a
        # window more than `SLOW` under the run's median says in one line where the thread was.
        self.watch = stacks.Watch() if watch else None
        self.rates: list[float] = []  # images_per_s of this attempt's windows after its first
        self.windows = 0
        self.rows: list[dict[str, Any]] = []
        if resume_step and storage.exists(self.uri):
            lines = storage.read_text(self.uri).splitlines()
            self.rows = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= resume_step]
        # The row `flush(pending=...)` wrote, not yet appended.
        self.stored_ahead: dict[str, Any] | None = None

    def append(self, row: dict[str, Any], flush: bool) -> None:
        """Add ``row``; written at once to a local file, else when ``flush`` (a checkpoint's row), unless
        it is in storage already: written ahead of its save, where what the save added to it since (its
        ``checkpoint_stall_s``) waits for the next flush."""
        self.rows.append(row)
        if self.watch is not None:
            window, self.windows = self.watch.take(), self.windows + 1
            note = slow_window(row, self.rates, window) if self.windows > 1 else ""  # not the start
            if note:
                log_line(note)
        stored, self.stored_ahead = row is self.stored_ahead, None
        if self.uri.is_local or (flush and not stored):
            self.flush()

    def flush(self, pending: dict[str, Any] | None = None) -> None:
        """Write the rows, and ``pending`` after them (a row not yet appended: its checkpoint's, whose
        `append` then writes nothing to an object store)."""
        rows = [*self.rows, pending] if pending is not None else self.rows
        storage.write_text(self.uri, "".join(json.dumps(r) + "\n" for r in rows))
        self.stored_ahead = pending

    def row(self, step: int) -> dict[str, Any]:
        """The row logged at `step`, or {}."""
        return next((r for r in reversed(self.rows) if r["step"] == step), {})

    def amend(self, step: int, fields: dict[str, Any]) -> bool:
        """Add ``fields`` to the row of ``step`` (a checkpoint's probe, which lands after its row) and write
        the file now; False where no row of that step is kept (nothing is written)."""
        row = self.row(step)
        if not row:
            return False
        row.update(fields)
        if self.stored_ahead is None:  # a row stored ahead of its save is written whole by its append
            self.flush()
        return True

    def close(self) -> None:
        """The run's end: every row is in storage already (a checkpoint's at its save, the last at the run's
        end)."""


def format_line(m: dict[str, Any], last_step: int, started: float, first_step: int) -> str:
    """`step 120/1000 (12%) | loss 1.234 | acc 56.0% | ...`: what a person watching wants to read."""
    parts = [
        f"step {m['step']}/{last_step} ({100 * m['step'] / last_step:.0f}%)",
        f"epoch {m['epoch']}",
        f"loss {m['loss']:.4f}",
        *(f"{label} {100 * m[key]:.1f}%" for key, label, _ in ACCURACIES if m.get(key) is not None),
        f"lr {m['lr']:.2e}",
        f"gnorm {m['grad_norm']:.2f}",
        f"{m['images_per_s']:,.0f} img/s ({m['images_per_s_per_worker']:,.0f}/worker)",
    ]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    parts.append(f"data wait {100 * m['data_wait_share']:.0f}%")
    parts.append(f"bad samples {m['bad_samples']}")
    if m.get("sources"):  # mixed sources: share against weight, pass, bad samples of each
        parts.append(format_sources(m["sources"]))
    if m.get("skipped_steps"):
        parts.append(f"skipped steps {m['skipped_steps']}")
    parts.append(f"mem {m['memory_gib']:.1f} GiB")
    if slow := straggler(m.get("rank_step_s") or []):
        parts.append(slow)
    if m.get("gc_s"):  # Python's collection at this log line (`collect_garbage`)
        parts.append(f"gc {m['gc_s']:.2f} s")
    if m.get("checkpoint_stall_s") is not None:  # training's wait for this step's checkpoint
        parts.append(f"checkpoint stall {m['checkpoint_stall_s']:.2f} s")
    done = m["step"] - first_step
    if done > 0:
        eta = (time.perf_counter() - started) / done * (last_step - m["step"])
        parts.append(f"eta {_hms(eta)}")
    return " | ".join(parts)


def format_sources(sources: dict[str, dict[str, Any]]) -> str:
    """``laion 70.3%/70% pass 1 (12,800) bad 2 · cc ...``: per source its share of the samples taken
    against its weight, the pass it is in (samples taken in it) and its bad samples."""
    return " · ".join(
        f"{name} {100 * s['share']:.1f}%/{100 * s['weight']:.0f}% pass {s['pass']} ({s['in_pass']:,}) "
        f"bad {s['bad']}"
        for name, s in sources.items()
    )


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def plot_training_curve(rows: list[dict[str, Any]], path: str) -> str:
    """Loss and accuracy against step, from `metrics.jsonl` rows, as a PNG at a local `path` (loss
    alone for an objective without accuracy); beside it, where the rows hold a checkpoint probe's scores,
    the linear probe's and k-NN's accuracy against step (`pipeline.train.scoring`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    probed = [r for r in rows if r.get("probe_accuracy") is not None]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2 if probed else 1, figsize=(12 if probed else 7, 4), dpi=120, squeeze=False)
    loss_axis = axes[0][0]
    loss_axis.plot(steps, [r["loss"] for r in rows], color="tab:blue", marker="o", markersize=3)
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    if any(r.get("accuracy") is not None for r in rows):
        accuracy_axis = loss_axis.twinx()
        accuracy = [100 * r["accuracy"] if r.get("accuracy") is not None else float("nan") for r in rows]
        accuracy_axis.plot(steps, accuracy, color="tab:orange", marker="o", markersize=3)
        accuracy_axis.set_ylabel("training accuracy (%)", color="tab:orange")
        accuracy_axis.set_ylim(0, 100)
    loss_axis.grid(alpha=0.3)
    if probed:
        probe_axis = axes[0][1]
        at = [r["step"] for r in probed]
        for key, label, color in (
            ("probe_accuracy", "linear probe", "tab:green"),
            ("knn_accuracy", "k-NN", "tab:red"),
        ):
            probe_axis.plot(at, [100 * r[key] for r in probed], color=color, marker="o", label=label)
        probe_axis.set_xlim(loss_axis.get_xlim())  # the same steps as the loss beside it
        probe_axis.set_xlabel("step (checkpoints)")
        probe_axis.set_ylabel("accuracy on --probe-eval-data (%)")
        probe_axis.grid(alpha=0.3)
        probe_axis.legend()
        probe_axis.set_title("what the model has learned: the checkpoint probe")
    fig.suptitle("vitray pretraining")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
