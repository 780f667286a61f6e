"""Training metrics: one readable log line per interval, and `metrics.jsonl` beside the checkpoints."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pipeline import storage

METRICS_FILE = "metrics.jsonl"


def log_line(line: str) -> None:
    """One line to the run's log. Written to stdout directly: Ray Train's patched `print` would
    show every line twice on the driver (once from stdout, once through its logger)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class MetricsLog:
    """Rank 0's record of logged steps, kept in `<run>/metrics.jsonl` (one JSON object a line).

    On resume, lines past the resumed step (written by a run that died before its next
    checkpoint) are dropped, so the file always describes one history. Local files are rewritten
    atomically each time; object stores get the whole file at each flush (a few hundred KB at most).
    """

    def __init__(self, run_uri: str, resume_step: int = 0):
        self.uri = storage.join(run_uri, METRICS_FILE)
        self.rows: list[dict[str, Any]] = []
        if resume_step and storage.exists(self.uri):
            lines = storage.read_text(self.uri).splitlines()
            self.rows = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= resume_step]

    def append(self, row: dict[str, Any], flush: bool) -> None:
        self.rows.append(row)
        if flush or storage.is_local(self.uri):
            self.flush()

    def flush(self) -> None:
        storage.write_text(self.uri, "".join(json.dumps(r) + "\n" for r in self.rows))


def format_line(m: dict[str, Any], last_step: int, started: float, first_step: int) -> str:
    """`step 120/1000 (12%) | loss 1.234 | acc 56.0% | ...`: what a person watching wants to read."""
    parts = [
        f"step {m['step']}/{last_step} ({100 * m['step'] / last_step:.0f}%)",
        f"epoch {m['epoch']}",
        f"loss {m['loss']:.4f}",
        f"acc {100 * m['accuracy']:.1f}%",
        f"lr {m['lr']:.2e}",
        f"gnorm {m['grad_norm']:.2f}",
        f"{m['images_per_s']:,.0f} img/s ({m['images_per_s_per_worker']:,.0f}/worker)",
    ]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    parts.append(f"data wait {100 * m['data_wait_share']:.0f}%")
    parts.append(f"bad samples {m['bad_samples']}")
    parts.append(f"mem {m['memory_gib']:.1f} GiB")
    done = m["step"] - first_step
    if done > 0:
        eta = (time.perf_counter() - started) / done * (last_step - m["step"])
        parts.append(f"eta {_hms(eta)}")
    return " | ".join(parts)


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def plot_training_curve(rows: list[dict[str, Any]], path: str) -> str:
    """Loss and accuracy against step, from `metrics.jsonl` rows, as a PNG at a local `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, loss_axis = plt.subplots(figsize=(7, 4), dpi=120)
    loss_axis.plot(steps, [r["loss"] for r in rows], color="tab:blue", marker="o", markersize=3)
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(
        steps, [100 * r["accuracy"] for r in rows], color="tab:orange", marker="o", markersize=3
    )
    accuracy_axis.set_ylabel("training accuracy (%)", color="tab:orange")
    accuracy_axis.set_ylim(0, 100)
    loss_axis.grid(alpha=0.3)
    fig.suptitle("vitray pretraining")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
