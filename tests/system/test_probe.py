"""The checkpoint probe in runs on Ray Train: what it scores equals ``jobs/embed.py`` + ``jobs/evaluate.py``
by hand on the same checkpoint (a supervised run's here, an MAE run's in test_objectives.py), and with
--keep-best the best checkpoint survives retention and a resume, and is exported as best/.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline import dcp, storage
from pipeline.embed.config import EmbedConfig
from pipeline.embed.job import prepare as prepare_embedding
from pipeline.embed.job import run as run_embedding
from pipeline.evaluate import checkpoint_probe, evaluation
from pipeline.evaluate.config import EvaluateConfig
from pipeline.train.config import TrainConfig
from pipeline.train.driver import fit, read_metrics
from pipeline.train.loop import StepWatch, train_loop_per_worker
from pipeline.train.scoring.probe import ProbePlan, probe_checkpoint
from tests.system.test_pretrain import config
from tests.system.test_pretrain import shards as shards  # a fixture, shared

pytestmark = pytest.mark.slow


def by_hand(checkpoint: Path, train: list[str], test: list[str], scratch: Path, **embed) -> dict[str, float]:
    """``jobs/embed.py --weights CHECKPOINT`` over each set (on the tests' Ray), then ``jobs/evaluate.py``:
    the linear probe's and the k-NN's accuracy as the evaluate job prints them."""
    for name, urls in (("train", train), ("test", test)):
        out = scratch / name
        run_embedding(
            prepare_embedding(
                EmbedConfig(data=",".join(urls), weights=str(checkpoint), out=str(out), **embed)
            )
        )
    config = EvaluateConfig(train=str(scratch / "train"), test=str(scratch / "test"))
    report = evaluation.evaluate(config, *evaluation.load(config))
    return {"probe_accuracy": report.linear_probe["accuracy"], "knn_accuracy": report.knn["accuracy"]}


def printed(scores: dict[str, float]) -> dict[str, str]:
    """The scores as the evaluate job's table prints them."""
    return {key: f"{100 * value:9.2f}%" for key, value in scores.items()}


def test_a_supervised_checkpoints_probe_equals_embed_and_evaluate_by_hand(
    ray_session, straight_run, tmp_path
):
    urls = straight_run.shards.urls
    checkpoint = straight_run.out / dcp.checkpoint_name(12)
    train = TrainConfig().replace(
        shards=",".join(urls),
        out=str(straight_run.out),
        probe_shards=",".join(urls[:3]),
        probe_eval_shards=urls[3],
    )
    plan = ProbePlan.start(train, checkpoint_probe.score)

    class Registered:  # what Ray Train hands the run's validation function: the checkpoint as registered
        path = str(checkpoint)

    in_run = probe_checkpoint(Registered(), plan=plan)
    (record,) = ray_session.get(plan.ledger.take.remote())
    assert (record["probe_images"], record["probe_eval_images"]) == (48, 16)
    hand = by_hand(checkpoint, urls[:3], [urls[3]], tmp_path)
    assert printed(in_run) == printed(hand)
    assert in_run == hand  # the same embeddings, bit for bit on CPU: the same numbers


class ProbedBeforeNextStep(StepWatch):
    """Holds each step after a checkpoint until its probe was scored (the fake scorer leaves a file), so
    that no probe is skipped for a newer checkpoint, however slowly this machine starts the probe's task."""

    def __init__(self, run: Path, every: int):
        self.run, self.every = run, every

    def taken(self, step) -> None:
        done = step.step - 1
        if done == 0 or done % self.every:
            return
        deadline = time.time() + 120
        while not (self.run / f"scored-{done}").exists() and time.time() < deadline:
            time.sleep(0.05)


def test_the_best_checkpoint_survives_retention_and_a_resume_and_is_exported_as_best(
    ray_session, shards, tmp_path
):
    run = tmp_path / "run"
    ranks = {4: 0.9, 8: 0.5, 12: 0.7}  # checkpoint 4 the best, never the latest after step 4

    def scorer(weights: storage.Location, **_) -> dict:
        step = int(weights.url.rsplit("_", 1)[-1])
        Path(run, f"scored-{step}").write_text("")
        return {
            "probe_accuracy": ranks[step],
            "knn_accuracy": 0.5,
            "probe_images": 48,
            "probe_eval_images": 16,
        }

    def loop(loop_config: dict) -> dict:
        return train_loop_per_worker(loop_config, watch=ProbedBeforeNextStep(run, 4))

    urls = shards.urls
    cfg = config(
        shards, run, max_steps=12, keep_checkpoints=1, keep_best="probe", probe_shards=",".join(urls[:3]),
        probe_eval_shards=urls[3],
    )  # fmt: skip
    first = fit(cfg.replace(stop_at_step=8), urls, scorer=scorer, worker_loop=loop)
    assert first["best"] == {"by": "probe", "step": 4, "score": 0.9, "name": dcp.checkpoint_name(4)}
    # Retention keeps the best (4) and the latest (8) of one kept; best/ is checkpoint 4's model.
    assert sorted(p.name for p in run.glob("checkpoint_0*")) == [
        dcp.checkpoint_name(4),
        dcp.checkpoint_name(8),
    ]
    record = json.loads((run / "best" / "config.json").read_text())["training"]
    assert (record["step"], record["best"], record["probe_accuracy"]) == (
        4,
        {"by": "probe", "step": 4, "score": 0.9},
        0.9,
    )

    # The same command resumed to the end: 12 scores under 4, 8 goes, 4 stays and best/ still holds it.
    second = fit(cfg, urls, scorer=scorer, worker_loop=loop)
    assert sorted(p.name for p in run.glob("checkpoint_0*")) == [
        dcp.checkpoint_name(4),
        dcp.checkpoint_name(12),
    ]
    assert second["best"] == {"by": "probe", "step": 4, "score": 0.9, "name": "best"}
    assert second["probe"]["step"] == 12 and second["probe"]["probe_accuracy"] == 0.7
    scored = {r["step"]: r.get("probe_accuracy") for r in read_metrics(str(run))}
    assert scored == {2: None, 4: 0.9, 6: None, 8: 0.5, 10: None, 12: 0.7}  # each in its checkpoint's row
    assert json.loads((run / "best" / "config.json").read_text())["training"]["step"] == 4
