"""Objectives and fine-tuning's weight loading, in one process (a world of one, FSDP2 over gloo)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vit
from pipeline.data.config import DataConfig
from pipeline.data.masking import mask_batch
from pipeline.model_source import load_model_source
from pipeline.train import finetune
from pipeline.train.checkpointing import checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.sections import OBJECTIVES
from pipeline.train.step.model import build_model, model_config
from pipeline.train.step.objective import CLASSES, MAEObjective, Objective, objective_for
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config

SUPERVISED = tiny_config()
MAE = SUPERVISED.replace(
    objective="mae", label_key=None, decoder_dim=32, decoder_depth=1, decoder_num_heads=4
)


def patches(n: int, seed: int, config: TrainConfig = SUPERVISED) -> np.ndarray:
    mcfg = model_config(config)
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, mcfg.num_patches, mcfg.patch_dim), dtype=np.uint8)


def mae_batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """What the data stage hands an MAE run: `mask_batch` over patch rows."""
    rows = {
        "key": np.array([f"k{i}" for i in range(n)], dtype=object),
        "url": np.array(["u"] * n, dtype=object),
        "patches": patches(n, seed, MAE),
        "label": np.full(n, -1, np.int64),
        "error": np.array([""] * n, dtype=object),
    }
    masked = mask_batch(rows, config=MAE.data_for(8), epoch=0)
    return tuple(torch.from_numpy(masked[c]) for c in MAEObjective.columns)


def full(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def test_supervised_losses_are_cross_entropy_and_hits_are_top1(world):
    model = build_model(SUPERVISED, world)
    objective = objective_for(SUPERVISED)
    x = torch.from_numpy(patches(8, 0))
    labels = torch.arange(8) % 4
    losses, hits = objective.losses(model, (x, labels))
    with torch.no_grad():
        logits = model(x).float()
    assert losses.shape == (8,)
    torch.testing.assert_close(losses.detach(), F.cross_entropy(logits, labels, reduction="none"))
    assert hits.item() == int((logits.argmax(-1) == labels).sum())


def test_mae_steps_lower_the_reconstruction_loss_and_report_no_hits(world):
    model = build_model(MAE, world)
    step = TrainStep(model, MAE.replace(warmup_steps=1, lr=3e-3), world)
    assert isinstance(step.objective, MAEObjective)
    batch = mae_batch(8, seed=1)
    losses = []
    for i in range(12):
        stats = step(i, [batch], global_count=8)
        assert stats.correct.item() == 0 and stats.count == 8
        losses.append(stats.loss_sum.item() / 8)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("config", [SUPERVISED, MAE], ids=["supervised", "mae"])
def test_under_compile_every_forward_has_the_micro_batch_size_and_padding_changes_nothing(world, config):
    """An epoch's short last micro-batch and a pass of zero loss: the model sees the configured batch
    size (a compiled graph that saw another would recompile mid-run); the real samples' losses and
    gradients are those of the unpadded batch."""
    model = build_model(config, world)
    compiled = objective_for(config.replace(compile=True))  # the objective's view; the model stays eager
    plain = objective_for(config)
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    batch = mae_batch(3, seed=5) if config is MAE else (torch.from_numpy(patches(3, 5)), torch.arange(3) % 4)

    def losses_and_grads(objective):
        losses, _ = objective.losses(model, batch)
        losses.sum().backward()
        grads = {k: p.grad.full_tensor().clone() for k, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return losses.detach(), grads

    model.set_requires_gradient_sync(True)
    padded_losses, padded_grads = losses_and_grads(compiled)
    assert seen == [8] and padded_losses.shape == (3,)
    losses, grads = losses_and_grads(plain)
    assert seen == [8, 3]
    torch.testing.assert_close(padded_losses, losses, rtol=1e-5, atol=1e-6)
    assert padded_grads.keys() == grads.keys() and grads
    for k in grads:
        torch.testing.assert_close(padded_grads[k], grads[k], rtol=1e-4, atol=1e-6)
    compiled.participate(model, world)
    plain.participate(model, world)
    assert seen == [8, 3, 8, 1]
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("config", [SUPERVISED, MAE], ids=["supervised", "mae"])
def test_a_rank_without_samples_joins_with_zero_gradients(world, config):
    model = build_model(config, world)
    before = full(model)
    objective = objective_for(config)
    model.set_requires_gradient_sync(True)
    objective.participate(model, world)  # forward + backward through FSDP2's collectives
    grads = [p.grad for p in model.parameters()]
    assert any(g is not None for g in grads)
    for g in grads:
        if g is not None:
            assert torch.count_nonzero(g.full_tensor() if hasattr(g, "full_tensor") else g) == 0
    after = full(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    model.zero_grad(set_to_none=True)


def test_every_objective_name_the_config_takes_has_its_objective_and_no_other_exists():
    assert [cls.name for cls in CLASSES] == list(OBJECTIVES)
    assert [type(objective_for(c)).name for c in (SUPERVISED, MAE)] == list(OBJECTIVES)


def test_mae_model_config_is_an_encoder_without_classifier_pooled_by_average():
    mcfg = model_config(MAE)
    assert (mcfg.num_classes, mcfg.head, mcfg.pool) == (0, "finetune", "gap")
    assert MAE.data_for(8).mask_ratio == 0.75 and not MAE.data_for(8).require_labels
    assert SUPERVISED.data_for(8).mask_ratio is None
    objective = objective_for(MAE)
    assert objective.flops_per_image() < Objective(SUPERVISED).flops_per_image() * 3
    assert objective.checkpoint_meta()["mae"]["decoder_dim"] == 32


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"label_key": None}, "--label-key none leaves supervised training without labels"),
        ({"objective": "mae", "mask_ratio": 1.0}, "--mask-ratio must be in .0, 1., got 1.0"),
        ({"objective": "mae", "decoder_dim": 30}, "--decoder-dim 30 must be a multiple of 4"),
        ({"objective": "mae", "eval_data": "x"}, "fine-tuning and --eval-data are supervised"),
        ({"objective": "clip"}, "--objective must be one of supervised, mae"),
        ({"optimizer": "lamb"}, "--optimizer must be one of adamw, sgd, got 'lamb'"),
    ],
)
def test_objective_settings_are_checked_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message.replace("-", r"\-").replace("(", r"\(")):
        SUPERVISED.replace(**changes).validate()


def test_mae_checkpoint_exports_the_encoder_and_loads_as_weights(world, tmp_path):
    model = build_model(MAE, world)
    step = TrainStep(model, MAE, world)
    step(0, [mae_batch(8, seed=2)], global_count=8)
    objective = objective_for(MAE)
    saved = {
        "train": MAE.to_dict(),
        "model_config": model_config(MAE).to_dict(),
        **objective.checkpoint_meta(),
    }
    ckpt = tmp_path / "checkpoint_00000001"
    checkpoint.save(ckpt, model, step.optimizer, {"step": 1}, saved)
    encoder = objective.export_state(full(model))
    assert set(encoder) == set(vit.VisionTransformer(model_config(MAE), device="meta").state_dict())

    source = load_model_source(str(ckpt))  # the embedding job's --weights on an MAE checkpoint
    assert source.config.pool == "gap"
    for name, value in encoder.items():
        torch.testing.assert_close(source.state_dict[name], value)

    checkpoint.check_compatible(ckpt, model_config(MAE), objective.checkpoint_meta())
    other = objective_for(MAE.replace(decoder_depth=2)).checkpoint_meta()
    with pytest.raises(ValueError, match="was written with mae"):
        checkpoint.check_compatible(ckpt, model_config(MAE), other)
    with pytest.raises(ValueError, match="objective mae, this run has supervised"):
        checkpoint.check_compatible(ckpt, model_config(MAE), {"objective": "supervised"})
    assert json.loads((ckpt / "config.json").read_text())["mask_ratio"] == 0.75


def test_finetuning_drops_the_head_resamples_positions_and_keeps_the_rest(world, tmp_path):
    source = vit.create_model("vit_tiny_test", image_size=32, num_classes=10)  # 4x4 grid, pretraining head
    with torch.no_grad():
        source.pos_embed.normal_()  # a non-trivial grid to resample
    vit.save_pretrained(tmp_path / "final", source.state_dict(), source.config, extra={"preprocessing": {}})
    config = finetune.resolve_pretrained(
        SUPERVISED.replace(weights=str(tmp_path / "final"), image_size=48, num_classes=3)
    )
    mcfg = model_config(config)
    assert (mcfg.head, mcfg.num_classes, mcfg.grid_size, mcfg.embed_dim) == ("finetune", 3, 6, 64)

    model = build_model(config, world)
    finetune.load_pretrained(model, finetune.pretrained_state(config, mcfg))
    loaded, expected = full(model), source.state_dict()
    assert (
        torch.count_nonzero(loaded["head.fc.weight"]) == 0
        and torch.count_nonzero(loaded["head.fc.bias"]) == 0
    )
    assert loaded["head.fc.weight"].shape == (3, 64) and "head.pre_logits.weight" not in loaded
    pos = loaded["pos_embed"]
    assert pos.shape == (1 + 36, 64)
    torch.testing.assert_close(pos[0], expected["pos_embed"][0])  # [CLS] kept as it was
    torch.testing.assert_close(pos, vit.resample_pos_embed(expected["pos_embed"], 6))
    for name, value in expected.items():
        if not name.startswith("head.") and name != "pos_embed":
            torch.testing.assert_close(loaded[name], value, msg=name)


def test_finetuning_refuses_weights_that_do_not_fit(world):
    model = build_model(SUPERVISED, world)
    with pytest.raises(ValueError, match="the pretrained weights lack"):
        finetune.load_pretrained(model, {"pos_embed": torch.zeros(17, 64)})


def test_eval_data_config_uses_no_mask_and_never_fails_on_bad_samples():
    cfg = finetune.eval_data_config(SUPERVISED, 8)
    assert isinstance(cfg, DataConfig) and cfg.max_bad_fraction == 1.0 and cfg.require_labels


def test_the_evaluation_pipeline_is_set_up_as_each_ranks_training_one(monkeypatch):
    from pipeline.data import dataset

    set_up = []
    monkeypatch.setattr(dataset, "build_dataset", lambda shards, config, *, train: ("dataset", train))
    monkeypatch.setattr(dataset, "for_one_rank", lambda ds, cpus: set_up.append((ds, cpus)) or ds)
    monkeypatch.setattr(
        dataset, "iter_batches", lambda ds, size, config, **kw: iter([{"label": np.zeros(2)}])
    )
    config = finetune.eval_data_config(SUPERVISED, 8)
    assert len(list(finetune.eval_batches(["a.tar"], config, 2, data_cpus=0.5))) == 1
    assert set_up == [(("dataset", False), 0.5)]
