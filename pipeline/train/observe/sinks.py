"""Where rank 0's logged steps go besides `metrics.jsonl` (which stays the record of a run):
TensorBoard event files under ``<out>/tensorboard/`` (``--tensorboard``) and a Weights & Biases run
(``--wandb PROJECT``).

    log = attach(MetricsLog(config.run_dir, resume_step), config)   # rank 0 only
    log.append(row, flush)   # -> metrics.jsonl, then every sink; flush at checkpoints

Every numeric field of a `metrics.jsonl` row becomes a scalar ``train/<field>`` at that row's step
(learning rate ``train/lr``, throughput ``train/images_per_s`` among them), and each number of a field
that holds some by name ``train/<field>/<name>`` (where the time went, ``train/goodput/lost_share``;
mixed sources, ``train/sources/<source>/share``); fields without a value (``mfu`` on CPU) and the row's
wall-clock ``time`` are left out. A run resumed at step S drops what a sink logged past S, as
`metrics.jsonl` does: TensorBoard through ``purge_step``; W&B keeps one run per ``--out`` and
ignores steps it has already seen.

Event files of a run on object storage are written locally and uploaded whole at each flush.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from numbers import Real
from typing import Any, Protocol

from pipeline import storage
from pipeline.train.config import TrainConfig
from pipeline.train.observe.metrics import log_line

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
# A checkpoint probe's numeric fields (`pipeline.train.scoring.results`), which a row gets after its step.
PROBE_FIELDS = (
    "probe_accuracy",
    "knn_accuracy",
    "probe_images",
    "probe_eval_images",
    "probe_bad_samples",
    "probe_seconds",
)
PROBE_STEP = "probe_step"  # W&B's x-axis of those


class Sink(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...
    def amend(self, step: int, fields: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


# A row's fields that are no metric: its x-axis, and its wall-clock time.
NOT_SCALARS = ("step", "time")


def scalars(row: dict[str, Any], prefix: str = "train/") -> dict[str, float]:
    """``{"train/<field>": value}`` for every finite number of a metrics row except its step and time; a
    field that holds numbers by name (``goodput``) gives ``train/<field>/<name>``."""
    out = {}
    for k, v in row.items():
        if k in NOT_SCALARS and prefix == "train/":
            continue
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v):
            out[f"{prefix}{k}"] = float(v)
    return out


class TensorBoardSink:
    """Event files of one run (`tensorboardX`, which Ray Train already depends on)."""

    def __init__(self, run_dir: storage.Location | str, resume_step: int = 0):
        from tensorboardX import SummaryWriter

        self.uri = storage.as_location(run_dir).join(TENSORBOARD_DIR)
        self.staging = None if self.uri.is_local else tempfile.mkdtemp(prefix="vitray-tb-")
        logdir = self.staging or self.uri.local_path
        os.makedirs(logdir, exist_ok=True)
        # purge_step: TensorBoard hides events at or past it from earlier files of this run.
        self.writer = SummaryWriter(logdir=logdir, purge_step=resume_step + 1 if resume_step else None)

    def log(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=row["step"])
        if self.staging is None:
            self.writer.flush()  # a local file costs nothing to keep current, as metrics.jsonl is

    def amend(self, step: int, fields: dict[str, Any]) -> None:
        """Scalars of a step logged before (a checkpoint's probe): TensorBoard takes any step's points."""
        self.log({"step": step, **fields})

    def flush(self) -> None:
        self.writer.flush()
        if self.staging is not None:
            storage.upload_dir(self.staging, self.uri)

    def close(self) -> None:
        self.flush()
        self.writer.close()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)


class WandbSink:
    """One W&B run per run directory (its id comes from ``--out``, so a resumed run continues it).

    ``WANDB_MODE=offline`` (or ``wandb offline``) keeps it on this machine; ``wandb sync`` uploads it later.
    """

    def __init__(self, config: TrainConfig):
        import wandb

        local = storage.is_local(config.run.out)
        self.dir = storage.local_path(config.run.out) if local else tempfile.mkdtemp(prefix="vitray-wandb-")
        os.makedirs(self.dir, exist_ok=True)
        self.run = wandb.init(
            project=config.run.wandb,
            id=run_id(config.run.out),
            name=config.run.out.rstrip("/").rsplit("/", 1)[-1],
            dir=self.dir,
            config=config.to_dict(),
            resume="allow",
            # console="off": W&B would otherwise wrap stdout, which Ray already forwards.
            settings=wandb.Settings(console="off", silent=True),
        )
        if self.run.offline:
            where = f"offline in {os.path.dirname(self.run.dir)} (upload it with `wandb sync`)"
        else:
            where = self.run.url
        log_line(f"W&B run {self.run.id}: {where}")
        # A checkpoint's probe lands after its step was logged, and a W&B run's steps only go forward: its
        # scalars are plotted against a step of their own, the checkpoint's (W&B's `define_metric`).
        self.run.define_metric(f"train/{PROBE_STEP}", hidden=True)
        for field in PROBE_FIELDS:
            self.run.define_metric(f"train/{field}", step_metric=f"train/{PROBE_STEP}")

    def log(self, row: dict[str, Any]) -> None:
        if row["step"] < self.run.step:
            return  # logged before this resume: a W&B run's steps only go forward
        self.run.log(scalars(row), step=row["step"])

    def amend(self, step: int, fields: dict[str, Any]) -> None:
        """A checkpoint's probe, plotted at its step (`define_metric` above), sent with W&B's next step."""
        self.run.log(scalars({PROBE_STEP: step, **fields}), commit=False)

    def flush(self) -> None:
        """W&B writes (and, online, uploads) in its own process."""

    def close(self) -> None:
        import wandb

        self.run.finish()
        # Waits for W&B's own process to have written (or sent) everything: a Ray worker may end
        # without running this process's exit hooks.
        wandb.teardown()


def run_id(out: str) -> str:
    """A W&B run id that is the same for every run of one ``--out``."""
    return "vitray-" + hashlib.sha256(out.rstrip("/").encode()).hexdigest()[:16]


class SinkedLog:
    """A `MetricsLog` that also hands every row to the sinks; its other attributes are the log's. The sinks
    close with the last step's row, or with ``hold`` (a run whose probes land after their rows) at `close`."""

    def __init__(self, log: Any, sinks: list[Sink], last_step: int, hold: bool = False):
        self.inner, self.sinks, self.last_step, self.hold = log, sinks, last_step, hold

    def append(self, row: dict[str, Any], flush: bool) -> None:
        self.inner.append(row, flush)
        last = row["step"] >= self.last_step and not self.hold
        for sink in self.sinks:
            sink.log(row)
            if flush and not last:
                sink.flush()
        if last:
            self.close()

    def amend(self, step: int, fields: dict[str, Any]) -> bool:
        """`MetricsLog.amend`, and where it found the row, the sinks get the fields at ``step``."""
        amended = self.inner.amend(step, fields)
        for sink in self.sinks if amended else ():
            sink.amend(step, fields)
        return amended

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def attach(log: Any, config: TrainConfig) -> Any:
    """``log`` (rank 0's `MetricsLog`) with the sinks ``config`` asks for; ``log`` itself when none."""
    resume_step = log.rows[-1]["step"] if log.rows else 0
    sinks: list[Sink] = []
    if config.run.tensorboard:
        sinks.append(TensorBoardSink(config.run_dir, resume_step))
    if config.run.wandb:
        sinks.append(WandbSink(config))
    return SinkedLog(log, sinks, config.last_step, hold=config.scoring.probing) if sinks else log
