"""The driver side of pretraining: the checks before any cluster work, then a Ray `TorchTrainer`
around the worker loop (`pipeline.train.loop.train_loop_per_worker`).

Storage: `--out` is the run directory, `TrainConfig.run_dir`: its URL with the job's `--storage-options`,
which every write under it uses (the marker, metrics, checkpoints, `final/`). Ray Train's storage path is
its parent and the run name its last part, so checkpoints land in `<out>/checkpoint_<step>/` beside
`metrics.jsonl` and `final/`; on an object store Ray Train gets the run directory's own filesystem
(`ray_storage`), so it reaches the store as the rest of the run does. Running the same command again
with the same `--out` resumes from the latest checkpoint there (Ray Train keeps a snapshot of the
reported checkpoints in the run directory).

The config the workers get is the saved form (`TrainConfig.to_dict`), which Ray Train also records for
its dashboard, with no credential (storage options as names, URLs without userinfo or query string); the
real storage options and URLs travel beside it inside `Location`s (whose text shows neither), and
`pipeline.train.config.worker_config` puts them back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import cli, console, storage
from pipeline.data.dataset import check_shards
from pipeline.data.mixture import check_disjoint, parse_sources
from pipeline.data.shards import ShardError, expand_shards
from pipeline.train import presets
from pipeline.train.checkpointing import lease as run_lease
from pipeline.train.config import TrainConfig
from pipeline.train.resources import local_out_problem, worker_resources

if TYPE_CHECKING:
    from pipeline.train.scoring.probe import CheckpointScorer

# torch comes in with pipeline.train.step.model and .metrics, Ray with pipeline.train.scoring; they are
# imported where used, so that
# `--print-config` and the one-line errors before cluster work stay quick.


# Written into --out before a run's first step: marks the directory as a training run's, so that the same
# command resumes into it and no run writes into a directory of the user's (`check_out`).
RUN_MARKER = ".vitray-run"
CHECKPOINT_PREFIX = "checkpoint_"


class TrainingError(cli.RunFailed):
    """The run stopped on a data problem every worker agreed on (one line, says what to do): a failed
    run, exit code 1."""


def split_run_uri(out: str) -> tuple[str, str]:
    """`/runs/exp1` -> (`/runs`, `exp1`); `s3://bucket/runs/exp1` -> (`s3://bucket/runs`, `exp1`)."""
    out = out.rstrip("/") or "/"
    if storage.is_local(out):
        out = os.path.abspath(storage.local_path(out))
    parent, _, name = out.rpartition("/")
    if not name or not parent or parent.endswith(":/"):
        raise ValueError(f"--out {out!r} needs a parent directory and a run name, e.g. s3://bucket/runs/exp1")
    return parent, name


def ray_storage(out: storage.Location) -> tuple[str, str, Any]:
    """Ray Train's ``(storage_path, name, storage_filesystem)`` for run directory ``out``. On an object
    store the filesystem is ``out``'s own, its options included (`pipeline.storage.arrow_filesystem`),
    and the path is within it (no scheme); a local run directory leaves the filesystem to Ray."""
    parent, name = split_run_uri(out.url)
    if out.is_local:
        return parent, name, None
    _, path = out.at(parent).fs()
    return path, name, storage.arrow_filesystem(out)


def prepare(config: TrainConfig) -> list[str]:
    """Every check that needs no cluster, cheapest first; returns the expanded shard list (`prepare_data`)."""
    return prepare_data(config)[0]


def prepare_data(config: TrainConfig) -> tuple[list[str], list[dict[str, Any]] | None]:
    """Every check that needs no cluster, cheapest first; returns the expanded shard list, and for sources
    mixed by weight each source's ``{"name", "weight", "shards"}`` (None for one plain source).

    Raises a one-line ValueError: a config that cannot run, an ``--out`` that is a filesystem root or
    holds what no training run wrote (unless ``--overwrite``), an unknown model or an image size the
    patch size does not divide, missing shards, a first shard without images or labels, fewer
    shards than workers (with mixed sources: of each source).
    """
    from pipeline.train.step.model import model_config

    config.validate()
    check_out(config)
    data_config = config.data_for(model_config(config).patch_size)
    shards, mixed = expand_data(config, check=lambda urls: check_shards(urls, data_config))
    check_resumable(config)
    workers = config.cluster.max_workers  # an elastic run's every size: its largest
    for source in mixed or [{"shards": shards}]:
        if len(source["shards"]) < workers:
            of = f" of source {source['name']}" if mixed else ""
            raise ValueError(
                f"{len(source['shards'])} shard(s){of} for {workers} workers: every "
                "worker needs at least one; write more, smaller shards (jobs/make_shards.py "
                "--samples-per-shard) or use fewer --num-workers"
            )
    return shards, mixed


def expand_data(
    config: TrainConfig, check: Callable[[list[str]], None] | None = None
) -> tuple[list[str], list[dict[str, Any]] | None]:
    """``--data`` expanded as the workers get it: every source's shards in order, each once, and for sources
    mixed by weight each source's ``{"name", "weight", "shards"}`` (None for one plain source). ``check``
    sees each source's shards as they are expanded; a ShardError names the source of a mixture."""
    mixed = parse_sources(config.run.shards)
    sources = [(s.name, s.weight, s.urls) for s in mixed] if mixed else [("", 1.0, config.run.shards)]
    expanded = []
    for name, weight, urls in sources:
        try:
            shards = expand_shards(config.location(urls))
            if check is not None:
                check(shards)
        except ShardError as e:
            if not mixed:
                raise
            raise ShardError(f"source {name}: {e}") from e  # which of the sources
        expanded.append({"name": name, "weight": weight, "shards": shards})
    if mixed:
        check_disjoint({source["name"]: source["shards"] for source in expanded})
    shards = list(dict.fromkeys(url for source in expanded for url in source["shards"]))
    return shards, expanded if mixed else None


def owns_run_dir(entries: dict[str, bool]) -> bool:
    """Whether a directory's entries (`pipeline.storage.list_entries`) are a training run's: its marker,
    its lease (a run that has not written its marker yet), or a checkpoint (a run written before the
    marker was)."""
    return (
        RUN_MARKER in entries
        or run_lease.LEASE in entries
        or any(is_dir and name.startswith(CHECKPOINT_PREFIX) for name, is_dir in entries.items())
    )


def check_out(config: TrainConfig) -> None:
    """A one-line ValueError for an ``--out`` that is a filesystem root, or that holds files but is no
    training run's (a user's ``metrics.jsonl`` and ``final/`` would be replaced), unless ``--overwrite``."""
    split_run_uri(config.run.out)  # a parent and a run name, or one line
    storage.check_output_dir(
        config.run_dir, job="a training run", owns=owns_run_dir, overwrite=config.run.overwrite
    )


def claim_out(config: TrainConfig) -> None:
    """Write `RUN_MARKER` into ``--out`` (checked on object stores, sent again if it does not arrive)."""
    with tempfile.TemporaryDirectory(prefix="vitray-run-") as scratch:
        marker = Path(scratch, RUN_MARKER)
        marker.write_text(json.dumps({"format": "vitray-run", "version": 1}) + "\n")
        storage.upload_dir(scratch, config.run_dir)


def check_resumable(config: TrainConfig) -> None:
    """A one-line ValueError when ``--out`` holds a checkpoint this run cannot resume: another model,
    objective or MAE decoder (local runs; the workers check every resume again)."""
    from pipeline import dcp
    from pipeline.train.checkpointing import checkpoint
    from pipeline.train.step.model import model_config
    from pipeline.train.step.objective import objective_for

    if not config.run_dir.is_local:
        return
    latest = dcp.latest_complete(config.run_dir)
    if latest is not None:
        checkpoint.check_compatible(
            latest.local_path,
            model_config(config),
            objective_for(config).checkpoint_meta(),
            config.optim,
        )


def prepare_eval(config: TrainConfig) -> list[str]:
    """The expanded ``eval_data`` shards (none without it), first one checked like the training data."""
    if not config.run.eval_shards:
        return []
    from pipeline.train.step.model import model_config

    shards = expand_shards(config.location(config.run.eval_shards))
    check_shards(shards, config.data_for(model_config(config).patch_size))
    return shards


def eval_note(config: TrainConfig) -> str | None:
    """A note for a run whose --eval-every (given, or its preset's) has no --eval-data to evaluate."""
    if not config.run.eval_every or config.run.eval_shards:
        return None
    why = (
        "held-out labeled shards"
        if config.task.objective == "supervised"
        else "supervised runs only; MAE pretraining has no classifier"
    )
    return f"note: no --eval-data, so --eval-every {config.run.eval_every} evaluates nothing (--eval-data: {why})"


def local_cpus_needed(config: TrainConfig) -> float:
    """Logical CPUs a local Ray needs: the training workers' plus two decode slots per worker (an
    elastic run's largest group: a local Ray has no node to join later), and the checkpoint probe's."""
    workers = config.cluster.max_workers
    probe = math.ceil(config.scoring.probe_cpus) if config.scoring.probing else 0
    return math.ceil(workers * config.cluster.cpus_per_worker) + 2 * workers + probe


def check_cluster(config: TrainConfig, *, local_ray: bool) -> None:
    """The checks that need the connected Ray, before any work is submitted; a one-line ValueError.

    A local Ray must have the GPUs the run asks for (a joined cluster's autoscaler may still bring
    them). A joined cluster must not get a local `--out` that its nodes do not share
    (`pipeline.train.resources.local_out_problem`). With ``--decode-nodes``, a node must carry the label:
    at once on a local Ray, within a bounded wait on a cluster (`pipeline.cli.check_decode_nodes`).
    """
    import ray

    cli.check_decode_nodes(config.data.decode_nodes, local=local_ray)

    if local_ray:
        gpus = ray.cluster_resources().get("GPU", 0)
        workers = config.cluster.min_workers  # an elastic run starts with its minimum
        if config.cluster.use_gpu and gpus < workers:
            raise ValueError(
                f"the local Ray has {gpus:.0f} GPUs for {workers} GPU workers; pass --cpu, fewer "
                "--num-workers, or submit to a GPU cluster"
            )
        training = workers if config.cluster.use_gpu else 0
        if config.scoring.probing and config.scoring.probe_gpu and gpus < training + 1:
            raise ValueError(
                f"--probe-gpu runs the checkpoint probe on a GPU of its own, and the local Ray has {gpus:.0f} "
                f"for {training} training worker(s); drop --probe-gpu (the probe runs on CPUs) or use fewer "
                "--num-workers"
            )
        return
    nodes = [{"resources": n.get("Resources", {})} for n in ray.nodes() if n.get("Alive")]
    problem = local_out_problem(config, nodes, worker_resources(config))
    if problem:
        raise ValueError(problem)


# Seconds between an elastic group's checks for room to grow (Ray Train's default: 60); tests shorten it.
RESIZE_CHECK_ENV = "VITRAY_RESIZE_CHECK_S"


def resize_check(config: TrainConfig) -> dict[str, float]:
    """The ScalingConfig's ``elastic_resize_monitor_interval_s`` for an elastic run whose environment sets
    `RESIZE_CHECK_ENV`; else nothing (Ray Train's default)."""
    seconds = os.environ.get(RESIZE_CHECK_ENV)
    if isinstance(config.cluster.num_workers, int) or not seconds:
        return {}
    return {"elastic_resize_monitor_interval_s": float(seconds)}


def fit(
    config: TrainConfig,
    shards: list[str],
    eval_shards: list[str] | None = None,
    sources: list[dict[str, Any]] | None = None,
    worker_loop: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    lease: str | None = None,
    val_shards: list[str] | None = None,
    scorer: CheckpointScorer | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """Run (or resume) training on the connected Ray cluster; `eval_shards` (fine-tuning) are
    evaluated every ``eval_every`` steps and at the end; ``sources`` (`prepare_data`) are mixed by weight.
    ``worker_loop`` replaces `train_loop_per_worker` (`jobs/benchmark.py host`: its step a wait);
    ``lease``: the run id of the lease this run holds on ``--out`` (`pipeline.train.checkpointing.lease`), which the
    workers check before each write there. ``val_shards``: the validation split, scored at every checkpoint
    (`pipeline.train.scoring.best.validation_split`); ``scorer``: what the checkpoint probe runs
    (`pipeline.evaluate.checkpoint_probe.score`, which the jobs hand in), needed with --probe-data;
    ``started``: when the job began (default: this call), the start of this session of the run
    (`pipeline.train.observe.goodput`).

    Returns the run summary: `metrics` (the last logged step), `bad_samples` (all workers' counts),
    `goodput` (where the run's time went, as the session closed; None when no attempt stepped).
    """
    started = time.time() if started is None else started  # before the imports: they are start-up too
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.train.loop import train_loop_per_worker
    from pipeline.train.observe import goodput
    from pipeline.train.scoring import best
    from pipeline.train.scoring.probe import ProbePlan

    session = goodput.new_session(started)

    if config.scoring.probing and scorer is None:
        raise ValueError("--probe-data: this entry point runs no checkpoint probe; use jobs/pretrain.py")
    probe = ProbePlan.start(config, scorer) if config.scoring.probing and scorer is not None else None
    storage_path, name, filesystem = ray_storage(config.run_dir)
    trainer = TorchTrainer(
        worker_loop or train_loop_per_worker,
        train_loop_config={
            "train": config.to_dict(),  # no credential: Ray Train records this
            # The storage options and the URLs whole (`pipeline.train.config.worker_config`), in Locations,
            # whose text shows neither.
            "out": config.run_dir,
            **({"weights": config.location(config.arch.weights)} if config.arch.weights else {}),
            "shards": shards,
            **({"sources": sources} if sources else {}),
            "eval_shards": list(eval_shards or []),
            "val_shards": list(val_shards or []),
            **({"probe": probe} if probe is not None else {}),
            # None: each worker decides every epoch (pipeline.train.resources); the cluster the
            # driver sees now may not have its GPU and decode nodes yet.
            "data_cpus_per_worker": config.cluster.data_cpus_per_worker,
            **({"lease": lease} if lease else {}),
            "session": session,  # this command's part of the run, for the account of its time
        },
        scaling_config=ScalingConfig(
            # MIN-MAX: Ray Train's elastic group, resized from the latest checkpoint (docs/scaling.md).
            num_workers=config.cluster.num_workers,
            **resize_check(config),
            use_gpu=config.cluster.use_gpu,
            resources_per_worker=worker_resources(config),
            placement_strategy=config.cluster.placement_strategy,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            failure_config=FailureConfig(max_failures=config.run.max_failures),
            # With --keep-best, ranked by its score: the best kept, and the latest (`scoring.best`).
            checkpoint_config=CheckpointConfig(
                num_to_keep=config.run.keep_checkpoints, **best.retention(config.scoring.keep_best)
            ),
            # Ray Train's own INFO lines would bury the training log (back with --verbose).
            logging_config=LoggingConfig(log_level=console.train_log_level()),
        ),
        # Every checkpoint probed beside training, in a task of its own (`pipeline.train.scoring.probe`).
        validation_config=probe.validation_config() if probe is not None else None,
    )
    claim_out(config)
    if config.cluster.data_cpus_per_worker is not None:
        print(
            f"{config.cluster.data_cpus_per_worker:g} decode CPUs per worker (--data-cpus-per-worker)",
            flush=True,
        )
    summary = None
    try:
        summary = trainer.fit().return_value or {}
    finally:  # the session's end and account into the run's record, and the attempts' figure
        try:
            account = goodput.close_session(
                config.run_dir, session, summary, price=config.run.price_per_device_hour
            )
        except Exception as e:  # the run's own outcome stands; only its account of time is missing
            account = None
            print(f"note: where the run's time went was not recorded ({cli.reason(e)})", flush=True)
    if summary.get("error"):
        raise TrainingError(summary["error"])
    return {**summary, "goodput": account}


def read_metrics(out: storage.Location | str) -> list[dict[str, Any]]:
    """The logged steps of a run (`<out>/metrics.jsonl`)."""
    from pipeline.train.observe.metrics import METRICS_FILE

    text = storage.read_text(storage.as_location(out).join(METRICS_FILE))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def format_summary(summary: dict[str, Any], config: TrainConfig) -> str:
    """What a finished run prints: its last step's loss and accuracy (and evaluation accuracy), the
    samples read and skipped. A run resumed at the end of its schedule trained no step: it says so."""
    from pipeline.train.observe.goodput import format_account
    from pipeline.train.observe.metrics import ACCURACIES

    metrics, bad = summary["metrics"], summary["bad_samples"]
    lost = sorted(bad.get("lost_shards", {}))
    reasons = ", ".join(f"{n} {reason}" for reason, n in bad["by_reason"].items()) or "none"
    scores = "".join(
        f", {label} {100 * metrics[key]:.1f}%" for key, _, label in ACCURACIES if metrics.get(key) is not None
    )
    if metrics:
        finished = f"finished at step {metrics['step']}: loss {metrics['loss']:.4f}{scores}"
        if metrics.get("run_images_per_s"):  # every second of the attempt, its log lines and saves too
            finished += f"; {metrics['run_images_per_s']:,.0f} images/s over the run"
    else:  # resumed at the schedule's end (run again after it finished, or killed after its last checkpoint)
        step = (summary.get("resumed_from") or {}).get("step")
        finished = f"finished at step {step}: resumed at the end of the schedule, nothing left to train"
    return (
        f"\n{finished}\n"
        f"samples read: {bad['total']}, skipped as bad: {bad['bad']} ({reasons})\n"
        + "".join(  # mixed sources: each one's part
            f"source {name}: {c['samples']} samples taken, {c['bad']} bad\n"
            for name, c in bad.get("sources", {}).items()
        )
        + f"lost shards (no readable sample): {len(lost)}{' (' + ', '.join(lost) + ')' if lost else ''}\n"
        + scores_summary(summary)
        + (f"{format_account(summary['goodput'])}\n" if summary.get("goodput") else "")
        + f"run directory: {config.run.out} (checkpoints, metrics.jsonl, final/"
        + (", best/)" if summary.get("best") else ")")
    )


def scores_summary(summary: dict[str, Any]) -> str:
    """The lines a run's probe and best checkpoint add to its summary ("" without either)."""
    from pipeline.train.scoring import best
    from pipeline.train.scoring.results import describe

    lines = ""
    start = summary.get("start")  # a fine-tuning's starting point, scored before its first step
    if start and start.get("val_accuracy") is not None:
        lines += f"starting point (step 0): val accuracy {100 * start['val_accuracy']:.2f}%\n"
    elif start:
        lines += f"starting point: {describe(start)}\n"
    if summary.get("probe"):  # the latest checkpoint's probe
        lines += f"last {describe(summary['probe'])}\n"
    if summary.get("best"):
        chosen = summary["best"]
        shown = best.Best(chosen["step"], chosen["score"], chosen["name"])
        lines += f"best checkpoint by --keep-best {chosen['by']}: {shown.describe(chosen['by'])} (best/)\n"
    return lines


def train(config: TrainConfig, args: argparse.Namespace, scorer: CheckpointScorer | None = None) -> int:
    """A training job once its config is resolved (`jobs/pretrain.py`, `jobs/finetune.py`): every check
    that needs no cluster, then Ray (`pipeline.cli.connect_ray` with ``args``), the run, its summary.
    A config with ``weights`` is a fine-tuning run: the weights' model with a new head. ``scorer``: what
    the checkpoint probe runs (`fit`)."""
    started = time.time()  # this session of the run begins: its start-up counts from here
    if config.arch.weights:
        from pipeline.train.finetune import resolve_pretrained

        config = resolve_pretrained(config)  # one line if the weights do not load
    from pipeline.train.scoring.sets import check_sets, validation_split

    shards, sources = prepare_data(config)
    shards, val_shards = validation_split(config, shards, mixed=sources is not None)
    if val_shards and not config.scoring.val_shards:
        print(
            f"validation split for --keep-best eval: the last {len(val_shards)} of {len(shards) + len(val_shards)} "
            "shards of --data, held out from training (--val-data names others)",
            flush=True,
        )
    check_sets(config)
    eval_shards = prepare_eval(config)
    note = eval_note(config)
    if note:
        print(note, flush=True)
    run_lease.check_free(config.run_dir)  # one line, before Ray, while another live run holds --out
    local = cli.connect_ray(args, needed_cpus=local_cpus_needed(config))
    check_cluster(config, local_ray=local)  # may refuse --out: nothing is written there before it
    held = run_lease.acquire(config.run_dir)  # taken (a run that started meanwhile: refused alike)
    try:
        cli.start_work()
        held.keep_renewed()
        summary = fit(
            config, shards, eval_shards, sources, lease=held.run, val_shards=val_shards, scorer=scorer,
            started=started,
        )  # fmt: skip
    finally:
        held.release()
    print(format_summary(summary, config))
    return 0


def pretrain_command(args: argparse.Namespace, scorer: CheckpointScorer | None = None) -> int:
    """`jobs/pretrain.py`: the preset and flags resolved, then `train` (or the config printed);
    ``scorer``: what the checkpoint probe runs, which the job hands in (train reads no embedding code)."""
    config = presets.resolve(args)
    return 0 if cli.printed(args, config) else train(config, args, scorer)


def finetune_command(args: argparse.Namespace, scorer: CheckpointScorer | None = None) -> int:
    """`jobs/finetune.py`: as `pretrain_command`, the objective supervised."""
    config = presets.resolve(args, objective="supervised")
    return 0 if cli.printed(args, config) else train(config, args, scorer)
