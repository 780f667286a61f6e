"""MAE pretraining and fine-tuning under Ray Train: 2 CPU workers (gloo, FSDP2), a tiny ViT.

Same shards and arithmetic as test_pretrain.py (4 shards x 16 samples, batch 16 -> 4 steps an epoch).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

import vit
from pipeline import dcp
from pipeline.embed.config import EmbedConfig
from pipeline.embed.job import prepare as prepare_embedding
from pipeline.embed.job import run as run_embedding
from pipeline.evaluate import checkpoint_probe
from pipeline.train.driver import fit, prepare, prepare_eval, read_metrics
from pipeline.train.finetune import resolve_pretrained
from tests.system.test_pretrain import config, final_weights
from tests.system.test_pretrain import shards as shards  # a fixture, shared
from tests.system.test_probe import by_hand, printed

pytestmark = pytest.mark.slow
MAE = {"objective": "mae", "label_key": None, "decoder_dim": 32, "decoder_depth": 1, "decoder_num_heads": 4}


def test_mae_run_logs_reconstruction_losses_and_exports_its_encoder(ray_session, shards, tmp_path):
    # Stop-and-resume equality for MAE runs in one process: tests/train/test_loop.py.
    run = tmp_path / "run"
    # Its checkpoints probed beside training on labeled shards (the shards' labels, which MAE never reads).
    probed = {"probe_shards": ",".join(shards.urls[:3]), "probe_eval_shards": shards.urls[3]}
    summary = fit(config(shards, run, **MAE, **probed), shards.urls, scorer=checkpoint_probe.score)
    metrics = summary["metrics"]
    assert metrics["step"] == 8 and metrics["accuracy"] is None

    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    assert all(r["accuracy"] is None and r["loss"] > 0 for r in rows)
    a = final_weights(run)

    # The last checkpoint's probe, in its row, the summary and final/'s record, is what jobs/embed.py
    # --label-key cls over each set and jobs/evaluate.py say of that checkpoint.
    in_run = {key: rows[-1][key] for key in ("probe_accuracy", "knn_accuracy")}
    hand = by_hand(
        run / dcp.checkpoint_name(8), shards.urls[:3], shards.urls[3:], tmp_path / "hand", label_key="cls"
    )
    assert printed(in_run) == printed(hand) and in_run == hand
    assert {key: summary["probe"][key] for key in in_run} == in_run
    training = json.loads((run / "final" / "config.json").read_text())["training"]
    assert {key: training[key] for key in in_run} == in_run

    # final/ is the encoder alone, a plain ViT pooled by average; the checkpoint keeps the decoder.
    meta = json.loads((run / "final" / "config.json").read_text())
    assert (meta["objective"], meta["mask_ratio"], meta["model"]["pool"]) == ("mae", 0.75, "gap")
    model, _ = vit.load_pretrained(run / "final")
    assert model.config.pool == "gap" and not any(name.startswith("decoder") for name in a)
    saved = json.loads((run / dcp.checkpoint_name(8) / "config.json").read_text())
    assert saved["mae"]["decoder_depth"] == 1
    with pytest.raises(ValueError, match="was written with mae"):  # another decoder: before any Ray work
        prepare(config(shards, run, max_steps=12, **{**MAE, "decoder_depth": 2}))


def test_finetuning_an_export_learns_and_its_export_embeds(ray_session, shards, tmp_path):
    from pipeline.data.synthetic import write_synthetic_shards

    # An export as pretraining leaves it (the tiny model, 32 px, a pretraining head of 10 classes);
    # fresh weights, so the learning below is fine-tuning's own.
    pretrained = tmp_path / "pretrained"
    source = vit.create_model("vit_tiny_test", image_size=32)
    vit.save_pretrained(pretrained / "final", source.state_dict(), source.config)
    held_out = write_synthetic_shards(
        tmp_path / "val", 32, samples_per_shard=16, image_size=32, num_classes=4, seed=7, prefix="val"
    )
    val = write_synthetic_shards(
        tmp_path / "v", 16, samples_per_shard=16, image_size=32, num_classes=4, seed=8
    )
    out = tmp_path / "finetuned"
    ft = config(
        shards,
        out,
        weights=str(pretrained / "final"),
        eval_data=",".join(held_out.urls),
        keep_best="eval",  # on --val-data: the starting point scored and kept as best/ until beaten
        val_data=val.urls[0],
        image_size=48,  # 6x6 patches after 4x4: position embeddings resampled
        optimizer="sgd",
        weight_decay=0.0,
        lr=0.05,
        warmup_steps=2,
        max_steps=24,
        eval_every=12,
        log_every=6,
        checkpoint_every=24,
    )
    ft = resolve_pretrained(ft)
    summary = fit(ft, shards.urls.copy(), prepare_eval(ft), val_shards=val.urls)
    evaluated = [r for r in read_metrics(str(out)) if r.get("eval_accuracy") is not None]
    assert [r["step"] for r in evaluated] == [12, 24]
    assert summary["metrics"]["eval_accuracy"] >= 0.6, evaluated  # chance is 0.25
    # best/: the better of the starting point (a zero head: one class for every image) and checkpoint 24.
    start, last = summary["start"]["val_accuracy"], summary["metrics"]["val_accuracy"]
    assert summary["best"]["score"] == max(start, last) and summary["best"]["step"] == (
        0 if start > last else 24
    )
    recorded = json.loads((out / "best" / "config.json").read_text())["training"]["best"]
    assert recorded == {"by": "eval", "step": summary["best"]["step"], "score": summary["best"]["score"]}

    meta = json.loads((out / "final" / "config.json").read_text())
    model = meta["model"]
    assert (model["head"], model["image_size"], model["num_classes"]) == ("finetune", 48, 4)
    # The export embeds (the job's plan and run, on this session's Ray): one row per held-out image.
    embeddings = tmp_path / "embeddings"
    plan = prepare_embedding(
        EmbedConfig(data=held_out.dir, weights=str(out), out=str(embeddings), batch_size=8)
    )
    assert plan.header["weights"]["source"] == "export" and plan.header["dim"] == 64
    run_embedding(plan)
    assert pq.read_table(embeddings).num_rows == 32
