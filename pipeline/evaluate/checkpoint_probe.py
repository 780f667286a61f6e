"""A training checkpoint scored as ``jobs/embed.py`` and ``jobs/evaluate.py`` would score it, in one process.

    checkpoint (or export) -> `load_model_source`, once
      -> --probe-data, --probe-eval-data: each embedded by the embedding job's own stages and output
         (`pipeline.embed.job.prepare` + `run_in_process`: its eval transform, `Embedder`, Parquet files and
         manifest, into a scratch directory of this process), read back by the evaluate job's reader
      -> `pipeline.evaluate.evaluation.evaluate`: its linear probe and k-NN, at its defaults (few-shot off)

`score` is what a training run's checkpoint probe runs in a task of its own
(`pipeline.train.scoring.probe`): the numbers are the ones ``jobs/embed.py --weights CHECKPOINT`` over each
set, then ``jobs/evaluate.py`` over the two outputs, print for that checkpoint (on CPU, where the embedding
is bit for bit the same: tested). Only the executor differs: the embedding job's read tasks and model actors
on Ray Data, here one loop in this process. With ``use_gpu`` the model runs as ``jobs/embed.py --gpu``
runs it, in bf16 on one GPU. The probe sets' rules are the embedding job's and the evaluate job's: a corrupt
sample is skipped and counted, a share past 1% of them, a shard with no readable sample or an unreadable one,
unlabeled rows, sets that share a shard or an evaluation class the fitting set lacks are each one line
(a ValueError), which the training run records as the probe's error.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from pipeline import storage


def score(
    weights: storage.Location,
    *,
    train: str,
    test: str,
    label_key: str = "auto",
    use_gpu: bool = False,
    threads: int = 1,
) -> dict[str, Any]:
    """The linear probe's and k-NN's accuracy of ``weights`` (a checkpoint or export, with its storage
    options) fit on ``train`` and scored on ``test`` (shard URLs, as ``--data`` takes them); ``label_key``
    as ``jobs/embed.py --label-key`` takes it; ``threads``: the model's torch threads (``--cpus-per-actor``).
    Also ``probe_images`` and
    ``probe_eval_images`` (rows fit and scored), ``probe_bad_samples`` (skipped in both),
    ``probe_converged`` and ``probe_seconds``. Raises a one-line ValueError (or the embedding job's own
    error) where either job would refuse."""
    # Imported here: the training jobs hand this function in, and their one-line errors stay quick.
    from pipeline.embed.config import EmbedConfig
    from pipeline.embed.job import prepare, run_in_process
    from pipeline.embed.reader import load_embeddings
    from pipeline.evaluate.config import EvaluateConfig
    from pipeline.evaluate.evaluation import check_pair, evaluate
    from pipeline.model_source import load_model_source

    start = time.perf_counter()
    source = load_model_source(weights)
    options = dict(weights.options) or None
    embedded = {}
    bad = 0
    with tempfile.TemporaryDirectory(prefix="vitray-probe-") as scratch:
        for name, data, flag in (("train", train, "--probe-data"), ("test", test, "--probe-eval-data")):
            config = EmbedConfig(
                data=data,
                weights=weights.url,
                out=f"{scratch}/{name}",
                label_key=label_key,
                use_gpu=use_gpu,
                cpus_per_actor=float(threads),
                storage_options=options,
            )
            summary = run_in_process(prepare(config, source))
            if summary.failed:
                url, why = next(iter(summary.failed.items()))
                raise ValueError(f"{flag}: shard {url} could not be read ({why})")
            bad += summary.bad_samples["bad"]
            embedded[name] = load_embeddings(f"{scratch}/{name}", name=flag)
    fit, scored = embedded["train"], embedded["test"]
    check_pair(fit, scored, ("--probe-data", "--probe-eval-data"))
    config = EvaluateConfig(train=train, test=test, shots=())  # its defaults: C, iterations, k
    if len(fit.labels) < config.k:
        raise ValueError(
            f"--probe-data holds {len(fit.labels)} labeled images; the k-NN votes among {config.k}: give it "
            f"{config.k} or more"
        )
    report = evaluate(config, fit, scored)
    return {
        "probe_accuracy": report.linear_probe["accuracy"],
        "knn_accuracy": report.knn["accuracy"],
        "probe_converged": report.linear_probe["converged"],
        "probe_images": len(fit.labels),
        "probe_eval_images": len(scored.labels),
        "probe_bad_samples": bad,
        "probe_seconds": time.perf_counter() - start,
    }
