"""The checkpoint probe: every checkpoint's weights, as saved, scored off the training workers.

    rank 0 reports checkpoint N with ``validation=True`` (`pipeline.train.session.RaySession.report`)
      -> Ray Train registers it once every rank's files are in storage, then its controller runs
         `probe_checkpoint` in a task of its own (`ValidationConfig`, no CPU: it only waits)
           -> a newer complete checkpoint in the run directory already? skipped, recorded (the newest next)
           -> else `_score`: a task on the probe's resources (--probe-cpus, --probe-gpu), the job's scorer
              (`CheckpointScorer`: `pipeline.evaluate.checkpoint_probe.score`) over the checkpoint
           -> the record (scores, or the error, or why skipped) into the `ProbeLedger`; its scores to Ray
              Train, which ranks the checkpoint by them (`pipeline.train.scoring.best`)
      -> rank 0 takes the ledger's records at its log lines without waiting (`pipeline.train.scoring.results`)

Design notes
------------
- What Ray Train's validation hook gives (`ray.train.report(..., validation=True)` with the trainer's
  `ValidationConfig`, Ray 2.60): the task starts from the checkpoint as registered, whole and in storage,
  never from live weights, while training goes on; at most one runs at a time; its metrics are merged into
  the checkpoint's, which is what Ray Train's retention ranks by (`CheckpointConfig
  checkpoint_score_attribute`), so the best checkpoint is never deleted; a run resumed from the same
  ``--out`` runs again the probes its snapshot holds as pending; the run's end waits for the probes
  queued. A run's own deletion could not do this: Ray Train's snapshot of checkpoints must match the
  directories, or a resume fails.
- What it does not give, and is done here: (1) its queue is unbounded and first in, first out: a probe
  slower than the checkpoint interval would fall further behind at every checkpoint. Each probe first looks
  for a newer complete checkpoint and, if there is one, skips itself in a second, with a record and a log
  line: the probe running finishes, the newest waits next, none is skipped silently. (2) It runs the
  function where it is and lets nothing fail it: a task that raises is logged with its traceback, and one
  whose process dies (a kill, the out-of-memory killer) raises in Ray Train's controller, which fails the
  run. Here the hook's task holds no CPU and only waits for `_score`, a task on the probe's own resources
  that is never retried; whatever `_score` raises, or its process dying, or running past --probe-timeout
  (it is then cancelled), becomes the record's one-line error; the run goes on. (3) Its results reach
  Ray Train's controller, not the workers, and a checkpoint whose score ranks low may be deleted as soon as
  it is scored: each record is also put into a `ProbeLedger`, an actor the driver holds for the run, which
  rank 0 reads. (4) It starts only from checkpoints: a fine-tuning's starting point, which has no
  checkpoint (its step 0, exported as ``best/``), is probed by `submit`, the same probe in a task rank 0
  starts itself.
- The probe's resources are asked of the cluster as any task's: CPUs beside the workers (a local Ray counts
  them in, `pipeline.train.driver.local_cpus_needed`), and with --probe-gpu a GPU of its own, which
  never is a training worker's (Ray gives a GPU to one task or actor at a time).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from pipeline import dcp, redaction, storage
from pipeline.train.scoring.sets import label_key

SCORES = ("probe_accuracy", "knn_accuracy")  # what a probe adds to its checkpoint's row, and ranks by
ERROR_CHARS = 300  # a record's error: its first line, at most this long


class CheckpointScorer(Protocol):
    """What a probe runs (`pipeline.evaluate.checkpoint_probe.score`): the scores of ``weights`` fit on the
    ``train`` shards and scored on the ``test`` ones, at least `SCORES`; a one-line exception if it cannot."""

    def __call__(
        self,
        weights: storage.Location,
        *,
        train: str,
        test: str,
        label_key: str,
        use_gpu: bool,
        threads: int,
    ) -> dict[str, Any]: ...


@ray.remote(num_cpus=0)
class ProbeLedger:
    """The records of a run's probes, put by each probe's task and taken by rank 0 (a record at most once)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def put(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def take(self) -> list[dict[str, Any]]:
        taken, self.records = self.records, []
        return taken


@dataclass(frozen=True)
class ProbePlan:
    """A run's probe: the scorer and its arguments (the probe sets as their flags give them, the label
    key, the model's device and threads), its task's resources, its timeout, the run directory the
    checkpoints are in, and the ledger its records go to."""

    scorer: CheckpointScorer
    request: dict[str, Any] = dataclasses.field(repr=False)  # its URLs may be signed: not in Ray's records
    cpus: float
    gpu: bool
    timeout: float
    run_dir: storage.Location
    ledger: Any  # a `ProbeLedger` actor's handle

    @classmethod
    def start(cls, config: Any, scorer: CheckpointScorer) -> ProbePlan:
        """The plan of a run (``config``: its `TrainConfig`), its ledger started on the connected Ray."""
        scoring = config.scoring
        request = {
            "train": scoring.probe_shards,
            "test": scoring.probe_eval_shards,
            "label_key": label_key(config),
            "use_gpu": scoring.probe_gpu,
            "threads": max(1, int(scoring.probe_cpus)),
        }
        ledger = ProbeLedger.remote()
        return cls(
            scorer,
            request,
            scoring.probe_cpus,
            scoring.probe_gpu,
            scoring.probe_timeout,
            config.run_dir,
            ledger,
        )

    def validation_config(self) -> Any:
        """Ray Train's `ValidationConfig` for the trainer: `probe_checkpoint` with this plan, in a task
        that holds no CPU (it waits for `_score`, which holds the probe's)."""
        from functools import partial

        from ray.train import ValidationConfig

        return ValidationConfig(fn=partial(probe_checkpoint, plan=self), ray_remote_kwargs={"num_cpus": 0})


def probe_checkpoint(checkpoint: Any, *, plan: ProbePlan) -> dict[str, float]:
    """Ray Train's validation function (its task, beside training): `probe` of the registered
    ``checkpoint`` (a `ray.train.Checkpoint` of the run directory). Returns the scores Ray Train merges
    into the checkpoint's metrics: NaN where the probe failed or skipped it, which ranks it last."""
    name = checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
    record = probe(plan, name, step_of(name))
    return {key: float(record.get(key, float("nan"))) for key in SCORES}


def step_of(name: str) -> int:
    """``checkpoint_00000120`` -> 120."""
    return int(name.rsplit("_", 1)[-1])


def probe(plan: ProbePlan, name: str, step: int, *, checkpoint: bool = True) -> dict[str, Any]:
    """One probe of ``name`` under the run directory (a checkpoint, or with ``checkpoint`` False an export
    such as ``best/``) at ``step``: skipped if a newer checkpoint is complete, else scored in `_score`'s
    task within the plan's timeout. The record (``step``, ``checkpoint``, the scores or ``probe_error`` or
    ``probe_skipped``) is put into the ledger and returned; nothing here raises for the probe's failure."""
    record: dict[str, Any] = {"step": step, "checkpoint": name}
    newer = dcp.latest_complete(plan.run_dir) if checkpoint else None
    if newer is not None and step_of(newer.url.rstrip("/").rsplit("/", 1)[-1]) > step:
        newest = newer.url.rstrip("/").rsplit("/", 1)[-1]
        record["probe_skipped"] = (
            f"{newest} was saved before this probe could start; the newest is probed next"
        )
    else:
        record.update(_scored(plan, plan.run_dir.join(name)))
    ray.get(plan.ledger.put.remote(record))
    return record


def _scored(plan: ProbePlan, weights: storage.Location) -> dict[str, Any]:
    """`_score` of ``weights`` in its own task, waited for at most the plan's timeout; its process dying,
    the task raising or running past the timeout (then cancelled) are the result's ``probe_error``."""
    task = _score.options(num_cpus=plan.cpus, num_gpus=1 if plan.gpu else 0, max_retries=0)
    ref = task.remote(plan.scorer, weights, plan.request)
    try:
        return ray.get(ref, timeout=plan.timeout)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        return {
            "probe_error": f"the probe took longer than --probe-timeout {plan.timeout:g} s and was stopped"
        }
    except ray.exceptions.RayError as e:  # its process died (killed, out of memory), or was cancelled
        return {"probe_error": f"the probe's task ended: {one_line(e)}"}


@ray.remote
def _score(scorer: CheckpointScorer, weights: storage.Location, request: dict[str, Any]) -> dict[str, Any]:
    """The scorer's result, or its exception as ``probe_error`` (one line, no traceback)."""
    start = time.perf_counter()
    try:
        result = scorer(weights, **request)
    except Exception as e:  # a bad shard, unlabeled rows, weights that do not load: the record says so
        return {"probe_error": one_line(e), "probe_seconds": time.perf_counter() - start}
    return {"probe_seconds": time.perf_counter() - start, **result}


def one_line(e: BaseException) -> str:
    """An exception as one line of a record: its first line, without credentials, `ERROR_CHARS` at most."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = redaction.public_text(text)
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def submit(plan: ProbePlan, name: str, step: int) -> Any:
    """`probe` of the export ``name`` (under the run directory) at ``step``, in a task started here (no
    checkpoint, so no Ray Train hook: a fine-tuning's starting point, ``best/``); its record reaches the
    ledger as every probe's does. Returns the task's reference (nothing needs to wait for it)."""
    return _probe_task.remote(plan, name, step)


@ray.remote(num_cpus=0)
def _probe_task(plan: ProbePlan, name: str, step: int) -> dict[str, Any]:
    return probe(plan, name, step, checkpoint=False)
