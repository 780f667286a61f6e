"""The analyze job on an MAE run: the reconstruction figure, with the decoder read from the checkpoint."""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed.checkpoint as dcp_io

import vit
from pipeline import dcp
from pipeline.data.config import DataConfig
from pipeline.evaluate.config import AnalyzeConfig
from pipeline.evaluate.inspection import analyze
from pipeline.evaluate.reconstruction import MAE_PNG, find_mae_checkpoint, load_mae, reconstruct
from vit.mae import encoder_state_dict


def mae_run(tmp_path, image_size: int = 64):
    """A run directory as MAE pretraining leaves it: checkpoint_00000001/ (encoder + decoder) and final/."""
    mae = vit.MAEConfig(decoder_dim=32, decoder_depth=1, decoder_num_heads=4)
    model = vit.create_mae("vit_tiny_test", mae=mae, image_size=image_size)
    run = tmp_path / "run"
    ckpt = run / dcp.checkpoint_name(1)
    dcp_io.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / dcp.TRAIN_STATE).write_text(json.dumps({"step": 1}))
    meta = {"objective": "mae", "mask_ratio": 0.75, "mae": mae.to_dict()}
    saved = {"model_config": model.encoder.config.to_dict(), **meta}
    (ckpt / dcp.CONFIG).write_text(json.dumps(saved))
    vit.save_pretrained(
        run / "final", encoder_state_dict(model.state_dict()), model.encoder.config, extra=meta
    )
    return run, model


def test_visible_patches_are_kept_and_hidden_ones_drawn_gray(tmp_path, synthetic_shards):
    run, model = mae_run(tmp_path)
    assert find_mae_checkpoint(str(run / "final")).url == str(run / dcp.checkpoint_name(1))
    assert find_mae_checkpoint(str(run)).url == str(run / dcp.checkpoint_name(1))
    loaded, saved = load_mae(find_mae_checkpoint(str(run)))
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    rng = np.random.default_rng(0)
    patches = rng.integers(0, 256, (2, 64, 8 * 8 * 3), dtype=np.uint8)
    config = DataConfig.for_eval(None, image_size=64, patch_size=8, label_key=None, require_labels=False)
    original, masked, rebuilt = reconstruct(loaded, patches, config, saved["mask_ratio"])
    assert original.shape == masked.shape == rebuilt.shape == (2, 64, 64, 3)
    assert np.array_equal(original, vit.unpatchify(patches, 8, (8, 8)))
    shown = vit.patchify(masked, 8)  # (2, 64, K): hidden patches all gray, visible ones the original's
    hidden = (shown == 128).all(axis=-1)
    assert (hidden.sum(axis=1) == 48).all()  # 75% of 64 patches
    kept = vit.patchify(rebuilt, 8)
    assert np.array_equal(kept[~hidden], patches[~hidden])


def test_analyze_draws_the_reconstructions_of_an_mae_run(tmp_path, synthetic_shards):
    run, _ = mae_run(tmp_path)
    out = tmp_path / "analysis"
    result = analyze(
        AnalyzeConfig(
            weights=str(run / "final"), data=synthetic_shards.dir, out=str(out), images=4, cpu=True
        ),
        log=lambda _: None,
    )
    assert MAE_PNG in result.files and (out / MAE_PNG).stat().st_size > 0
    numbers = json.loads((out / "analysis.json").read_text())
    assert numbers["mae_reconstruction"]["images"] == 4


def test_other_weights_get_no_reconstruction_figure(tmp_path):
    model = vit.create_model("vit_tiny_test")
    vit.save_pretrained(tmp_path / "final", model.state_dict(), model.config)
    assert find_mae_checkpoint(str(tmp_path / "final")) is None
