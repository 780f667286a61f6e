"""Every preset is a valid configuration of a buildable model, and the recipe presets carry the
published hyperparameters they cite."""

from __future__ import annotations

import pytest
import torch

import vit
from pipeline.train.presets import PRESETS
from pipeline.train.step.model import model_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates_and_resolves_to_a_model(name):
    config = PRESETS[name]().replace(shards="/data/train-{000..009}.tar", out="/runs/x")
    config.validate()
    mcfg = model_config(config)
    assert mcfg.image_size == config.data.image_size
    assert isinstance(mcfg, vit.ViTConfig)


def test_small_recipe_is_small_with_regularization_only():
    small, recipe = PRESETS["small"]().to_dict(), PRESETS["small_recipe"]().to_dict()
    changed = {
        (section, name)
        for section, fields in recipe.items()
        if isinstance(fields, dict)
        for name, value in fields.items()
        if small[section][name] != value
    }
    assert {name for _, name in changed} == {
        "randaug_ops",  # at magnitude 9, the setting's default
        "mixup_alpha",
        "cutmix_alpha",
        "label_smoothing",
        "drop_path_rate",
    }


@pytest.mark.parametrize(
    ("name", "model", "params"), [("deit_s16_224", "vit_s16", 22.05e6), ("deit_b16_224", "vit_b16", 86.57e6)]
)
def test_deit_presets_follow_the_paper(name, model, params):
    config = PRESETS[name]().replace(shards="x", out="y")
    assert config.arch.model == model
    assert config.optim.lr == pytest.approx(5e-4 * config.optim.batch_size / 512)  # DeiT's scaling rule
    assert (config.optim.weight_decay, config.optim.grad_clip) == (0.05, 0.0)
    assert (config.task.mixup_alpha, config.task.cutmix_alpha, config.task.label_smoothing) == (0.8, 1.0, 0.1)
    assert config.arch.drop_path_rate == 0.1
    assert (config.data.randaug_ops, config.data.randaug_magnitude) == (2, 9)  # rand-m9, timm's 2 ops
    epochs = config.optim.max_steps * config.optim.batch_size / 1_281_167
    assert epochs == pytest.approx(300, abs=0.1)
    mcfg = model_config(config)
    assert mcfg.head == "finetune"  # one linear layer on [CLS], as DeiT's
    with torch.device("meta"):
        model = vit.VisionTransformer(mcfg)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
