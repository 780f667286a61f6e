"""The best checkpoint (`pipeline.train.scoring.best`) and the shards scores are made on
(`pipeline.train.scoring.sets`), without Ray: ranking, Ray Train's retention settings, best/ as an export,
the validation split and the probe sets' checks. A whole run's retention and resume:
tests/system/test_probe.py."""

from __future__ import annotations

import json
import math

import pytest

import vit
from pipeline import storage
from pipeline.model_source import load_model_source
from pipeline.train.config import TrainConfig
from pipeline.train.scoring import best
from pipeline.train.scoring.sets import check_sets, validation_split
from tests.train.test_probe import write_checkpoint


def test_the_best_is_the_highest_accuracy_or_the_lowest_loss_of_a_complete_checkpoint_ties_to_the_later():
    rows = [
        {"step": 2, "loss": 0.9, "probe_accuracy": 0.8},
        {"step": 4, "loss": 0.5, "probe_accuracy": 0.9},  # the best probe, but deleted: not complete
        {"step": 6, "loss": 0.4, "probe_accuracy": float("nan")},  # its probe failed
        {"step": 8, "loss": 0.4, "probe_accuracy": 0.8},
        {"step": 9, "loss": 0.1},  # no checkpoint at this row
    ]
    complete = {2: "checkpoint_00000002", 6: "checkpoint_00000006", 8: "checkpoint_00000008"}
    assert best.choose("probe", rows, complete, None) == best.Best(8, 0.8, "checkpoint_00000008")  # a tie
    assert best.choose("loss", rows, complete, None) == best.Best(8, 0.4, "checkpoint_00000008")
    assert best.choose("knn", rows, complete, None) is None
    start = best.Best(0, 0.85, best.BEST)  # a fine-tuning's starting point, already in best/
    assert best.choose("probe", rows, complete, start) == start
    assert best.choose("probe", rows, complete, best.Best(0, 0.8, best.BEST)).step == 8


def test_ray_trains_retention_ranks_by_the_score_and_a_report_holds_it_from_the_start():
    assert best.retention(None) == {} and best.report_fields(None) == {}
    assert best.retention("loss") == {"checkpoint_score_attribute": "loss", "checkpoint_score_order": "min"}
    assert best.retention("eval") == {
        "checkpoint_score_attribute": "val_accuracy",
        "checkpoint_score_order": "max",
    }
    assert math.isnan(best.report_fields("knn")["knn_accuracy"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_best_is_the_checkpoints_model_as_an_export_and_records_what_it_is(tmp_path):
    run = storage.as_location(str(tmp_path))
    write_checkpoint(tmp_path, 4, seed=1)
    record = best.training_record({"preprocessing": {}, "training": {"loss": 0.5}}, "probe", 4, 0.75)
    where = best.export_checkpoint(run, best.Best(4, 0.75, "checkpoint_00000004"), record)
    exported, checkpoint = load_model_source(where), load_model_source(run.join("checkpoint_00000004"))
    assert exported.kind == "export" and exported.sha256 == checkpoint.sha256  # the same weights
    assert vit.load_pretrained(where)[0].config == checkpoint.config
    assert best.exported_best(run, "probe") == best.Best(4, 0.75, best.BEST)
    assert best.exported_best(run, "knn") is None  # ranked by another score: no candidate

    # A probe of best/ (a fine-tuning's step 0) lands later: its scores into best/'s own record.
    assert best.record_scores(run, "probe", {"probe_accuracy": 0.8, "knn_accuracy": 0.7}) == 0.8
    training = json.loads((tmp_path / "best" / "config.json").read_text())["training"]
    assert training["best"] == {"by": "probe", "step": 4, "score": 0.8} and training["knn_accuracy"] == 0.7


def config(**changes) -> TrainConfig:
    return TrainConfig().replace(shards="x", out="y", num_workers=2, **changes)


def test_the_validation_split_is_val_data_or_the_end_of_a_plain_data_never_eval_data(synthetic_shards):
    urls = synthetic_shards.urls  # 4 shards
    assert validation_split(config(), urls, mixed=False) == (urls, [])
    assert validation_split(config(keep_best="eval"), urls, mixed=False) == (urls[:3], urls[3:])
    given = config(keep_best="eval", val_shards=urls[3], eval_shards=urls[2], image_size=32, num_classes=4)
    assert validation_split(given, urls[:3], mixed=False) == (urls[:3], [urls[3]])
    with pytest.raises(ValueError, match="--val-data and --data share 1 shard"):
        validation_split(given, urls, mixed=False)
    with pytest.raises(ValueError, match="with sources mixed by weight, pass --val-data"):
        validation_split(config(keep_best="eval"), urls, mixed=True)
    with pytest.raises(
        ValueError, match=r"holds out 1 of the 2 shards .* fewer than the 2 workers need; pass --val-data"
    ):
        validation_split(config(keep_best="eval"), urls[:2], mixed=False)


def test_the_probe_sets_and_keep_best_are_checked_before_any_cluster_work(synthetic_shards, tmp_path):
    urls = synthetic_shards.urls
    probed = {"image_size": 32, "num_classes": 4, "probe_shards": ",".join(urls[:3])}
    check_sets(config(**probed, probe_eval_shards=urls[3]))
    with pytest.raises(ValueError, match="--probe-data and --probe-eval-data share 1 shard"):
        check_sets(config(**probed, probe_eval_shards=urls[2]))
    with pytest.raises(ValueError, match=r"^--probe-eval-data: .*none-\*\.tar matches no files"):
        check_sets(config(**probed, probe_eval_shards=str(tmp_path / "none-*.tar")))
    for changes, message in (
        ({"probe_shards": urls[0]}, "--probe-data needs --probe-eval-data"),
        (
            {"keep_best": "probe"},
            "--keep-best probe ranks checkpoints by the checkpoint probe: pass --probe-data",
        ),
        (
            {"keep_best": "eval", "objective": "mae", "label_key": None},
            "--keep-best eval and --val-data score",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            config(**changes).validate()
