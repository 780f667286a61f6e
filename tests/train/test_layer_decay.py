"""Layer-wise learning-rate decay (`--layer-decay`, MAE's and BEiT's fine-tuning): which layer each
parameter belongs to, the groups' scales, and the step applying them. One process, no Ray."""

from __future__ import annotations

import pytest
import torch

import vit
from pipeline.train.step.model import build_model
from pipeline.train.step.optim import layer_of, lr_factor, param_groups
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config

CONFIG = tiny_config()  # vit_tiny_test: 2 blocks


def names_of(model: torch.nn.Module, group: dict) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in group["params"]}


def test_a_decay_of_1_is_todays_two_groups(world):
    model = build_model(CONFIG, world)
    assert [
        (sorted(names_of(model, g)), g["weight_decay"], "lr_scale" in g)
        for g in param_groups(model, 0.1, 1.0)
    ] == [(sorted(names_of(model, g)), g["weight_decay"], False) for g in param_groups(model, 0.1)]
    assert len(param_groups(model, 0.1, 1.0)) == 2


def test_each_layer_learns_at_decay_to_its_distance_from_the_head(world):
    model = build_model(CONFIG, world)
    groups = param_groups(model, 0.1, layer_decay=0.5)
    scale = {n: g["lr_scale"] for g in groups for n in names_of(model, g)}
    assert len(scale) == len(list(model.parameters()))  # every parameter in exactly one group
    assert {n: s for n, s in scale.items() if not n.startswith(("blocks.", "head."))} == {
        "cls_token": 0.125, "pos_embed": 0.125, "patch_embed.proj.weight": 0.125, "patch_embed.proj.bias": 0.125,
        "norm.weight": 1.0, "norm.bias": 1.0,
    }  # fmt: skip
    assert {s for n, s in scale.items() if n.startswith("head.")} == {1.0}
    assert {scale[n] for n in scale if n.startswith("blocks.0.")} == {0.25}
    assert {scale[n] for n in scale if n.startswith("blocks.1.")} == {0.5}
    for group in groups:  # the no-decay rule still holds within each layer
        names = names_of(model, group)
        if any(n in ("cls_token", "pos_embed") or n.endswith(".bias") for n in names):
            assert group["weight_decay"] == 0.0


def test_a_hybrids_cnn_is_the_embedding_layer():
    assert layer_of("patch_embed.backbone.stages.0.0.conv1.weight", 12) == 0
    assert layer_of("blocks.11.mlp.fc2.weight", 12) == 12
    assert layer_of("head.fc.weight", 12) == layer_of("norm.weight", 12) == 13
    model = vit.create_model("vit_r50_b16", image_size=32, num_classes=2)
    scales = {g["lr_scale"] for g in param_groups(model, 0.1, 0.9)}
    assert min(scales) == pytest.approx(0.9**13) and max(scales) == 1.0


def test_the_step_sets_each_groups_lr_to_its_scale_of_the_schedule(world):
    config = CONFIG.replace(layer_decay=0.5, warmup_steps=2)
    step = TrainStep(build_model(config, world), config, world)
    g = torch.Generator().manual_seed(0)
    patches = torch.randint(0, 256, (8, 16, 192), dtype=torch.uint8, generator=g)
    step(1, [(patches, torch.randint(0, 4, (8,), generator=g))], global_count=8)
    lr = config.optim.lr * lr_factor(1, config)
    assert sorted({group["lr"] for group in step.optimizer.param_groups}) == pytest.approx(
        [lr * 0.125, lr * 0.25, lr * 0.5, lr]
    )


def test_a_decay_outside_0_1_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^--layer-decay must be in \(0, 1\], got 1.5$"):
        CONFIG.replace(layer_decay=1.5).validate()
