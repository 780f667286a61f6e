"""--drop-path-rate and --dropout in a training run: from the arch section into the model, a fine-tuning
run's own, evaluation in eval mode; and the flags of both jobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vit
from pipeline.data.config import sample_seed
from pipeline.train import finetune, presets
from pipeline.train.step.model import build_model, model_config
from tests.configs import tiny_config

CONFIG = tiny_config()


def test_the_arch_settings_become_the_models_fields():
    assert model_config(CONFIG).drop_path_rate == 0.0 and model_config(CONFIG).dropout == 0.0
    on = model_config(CONFIG.replace(drop_path_rate=0.1, dropout=0.05))
    assert (on.drop_path_rate, on.dropout) == (0.1, 0.05)
    mae = model_config(CONFIG.replace(objective="mae", label_key=None, drop_path_rate=0.1))
    assert mae.drop_path_rate == 0.1  # the MAE encoder takes it


def test_both_jobs_take_the_flags():
    pretrain = presets.pretrain_parser().parse_args(["--drop-path-rate", "0.1", "--dropout", "0.1"])
    assert presets.resolve(pretrain).arch.drop_path_rate == 0.1
    argv = ["--weights", "w", "--drop-path-rate", "0.1", "--label-smoothing", "0.1", "--mixup-alpha", "0.8"]
    config = presets.resolve(presets.finetune_parser().parse_args(argv), objective="supervised")
    assert (config.arch.drop_path_rate, config.task.label_smoothing, config.task.mixup_alpha) == (
        0.1,
        0.1,
        0.8,
    )
    with pytest.raises(SystemExit):  # the objective still comes from the weights
        presets.finetune_parser().parse_args(["--weights", "w", "--mask-ratio", "0.5"])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"drop_path_rate": 1.0}, r"^--drop-path-rate must be in \[0, 1\), got 1.0$"),
        ({"dropout": -0.1}, r"^--dropout must be in \[0, 1\), got -0.1$"),
        ({"model_overrides": {"dropout": 0.1}}, r"^model_overrides may not set dropout: use --dropout$"),
    ],
)
def test_settings_are_checked_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message):
        CONFIG.replace(**changes).validate()


def test_fine_tuning_sets_its_own_rates_not_the_pretraining_runs(tmp_path):
    source = vit.create_model("vit_tiny_test", num_classes=10, drop_path_rate=0.2, dropout=0.1)
    vit.save_pretrained(tmp_path, source.state_dict(), source.config, extra={"preprocessing": {}})
    config = finetune.resolve_pretrained(CONFIG.replace(weights=str(tmp_path), drop_path_rate=0.05))
    config.validate()
    assert not set(vit.REGULARIZATION_FIELDS) & set(config.arch.model_overrides)
    mcfg = model_config(config)
    assert (mcfg.drop_path_rate, mcfg.dropout) == (0.05, 0.0)


def test_evaluation_runs_the_model_in_eval_mode_and_hands_it_back_training(world):
    model = build_model(CONFIG.replace(dropout=0.5, drop_path_rate=0.5), world)
    modes = []
    model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    rng = np.random.default_rng(0)
    batch = {"patches": rng.integers(0, 256, (6, 16, 192), dtype=np.uint8), "label": np.arange(6) % 4}
    idle = (torch.zeros(1, 16, 192, dtype=torch.uint8),)  # the model's inputs
    first = finetune.evaluate(model, iter([batch]), idle, world)
    assert first == finetune.evaluate(model, iter([batch]), idle, world)
    assert modes == [False, False] and model.training


def test_each_rank_draws_from_a_torch_stream_of_its_own(world):
    build_model(CONFIG.replace(seed=5), world)
    assert torch.initial_seed() == sample_seed(5, 0, "torch-rng", "rank-0")
    assert sample_seed(5, 0, "torch-rng", "rank-1") != torch.initial_seed()


def test_the_model_trains_with_them_on(world):
    model = build_model(CONFIG.replace(dropout=0.1, drop_path_rate=0.2), world)
    assert any(isinstance(m, nn.Dropout) for m in model.modules())
    x = torch.randint(0, 256, (4, 16, 192), dtype=torch.uint8)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
