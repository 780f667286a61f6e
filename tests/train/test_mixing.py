"""Label smoothing, Mixup and CutMix in the supervised step: off is today's loss to the bit; on, soft targets
of the drawn mix, draws a pure function of (seed, step, rank, micro-batch), patches still uint8."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import vit
from pipeline.train.step import mixing
from pipeline.train.step.mixing import Mix, cutmix_mask, draw, mix_patches, mix_seed, soft_targets
from pipeline.train.step.model import build_model, model_config
from pipeline.train.step.objective import objective_for
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config

CONFIG = tiny_config()  # vit_tiny_test at 32 px: 4x4 patches of 8x8x3, 4 classes
MODEL = model_config(CONFIG)
MIXED = CONFIG.replace(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1)


def batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    patches = torch.randint(0, 256, (n, MODEL.num_patches, MODEL.patch_dim), dtype=torch.uint8, generator=g)
    return patches, torch.randint(0, 4, (n,), generator=g)


def test_off_is_todays_loss_to_the_bit(world):
    model = build_model(CONFIG, world)
    objective = objective_for(CONFIG)
    assert objective.mixer is None
    x, y = batch()
    losses, hits = objective.losses(model, (x, y), seed=mix_seed(0, 3, 0, 0))
    with torch.no_grad():
        logits = model(x).float()
    assert torch.equal(losses.detach(), F.cross_entropy(logits, y, reduction="none"))
    assert hits.item() == int((logits.argmax(-1) == y).sum())


def test_label_smoothing_is_cross_entropy_against_smoothed_one_hot_targets(world):
    config = CONFIG.replace(label_smoothing=0.1)
    model = build_model(config, world)
    x, y = batch()
    losses, hits = objective_for(config).losses(model, (x, y), seed=1)
    with torch.no_grad():
        logits = model(x).float()
    targets = F.one_hot(y, 4).float() * 0.9 + 0.1 / 4  # 0.925 on the label, 0.025 elsewhere
    torch.testing.assert_close(losses.detach(), -(targets * logits.log_softmax(-1)).sum(-1))
    assert hits.item() == int((logits.argmax(-1) == y).sum())


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_mixed_targets_sum_to_one_and_weigh_both_labels(smoothing):
    y = torch.tensor([0, 1, 2, 3, 3])
    t = soft_targets(y, 4, 0.7, smoothing)
    torch.testing.assert_close(t.sum(-1), torch.ones(5))
    one_hot = F.one_hot(y, 4).float() * (1 - smoothing) + smoothing / 4
    for i in range(5):
        torch.testing.assert_close(t[i], 0.7 * one_hot[i] + 0.3 * one_hot[4 - i])  # partner: B-1-i
    assert torch.equal(soft_targets(y, 4, 1.0, 0.0), F.one_hot(y, 4).float())


def test_draws_are_a_pure_function_of_seed_step_rank_and_micro_batch():
    task = MIXED.task
    assert mix_seed(0, 5, 1, 0) == mix_seed(0, 5, 1, 0)
    assert draw(task, 32, mix_seed(0, 5, 1, 0)) == draw(task, 32, mix_seed(0, 5, 1, 0))
    seeds = {mix_seed(0, 5, 1, 0), mix_seed(0, 6, 1, 0), mix_seed(0, 5, 0, 0), mix_seed(0, 5, 1, 1)}
    seeds.add(mix_seed(1, 5, 1, 0))
    assert len(seeds) == 5
    lams = {draw(task, 32, mix_seed(0, step, 0, 0)).lam for step in range(20)}
    assert len(lams) == 20  # another step, another draw
    before = torch.random.get_rng_state()
    draw(task, 32, 7)
    assert torch.equal(torch.random.get_rng_state(), before)  # torch's global RNG untouched


def test_mix_and_switch_probabilities_and_each_alpha_alone():
    def kinds(**changes) -> list[str]:
        task = MIXED.replace(**changes).task
        mixes = [draw(task, 32, seed) for seed in range(2000)]
        return ["none" if m.lam == 1.0 else "cutmix" if m.box else "mixup" for m in mixes]

    both = kinds()
    # Unmixed only where CutMix drew a box under one pixel wide (lambda within ~1e-3 of 1).
    assert both.count("none") < 20 and abs(both.count("cutmix") / 2000 - 0.5) < 0.05
    half = kinds(mix_prob=0.5)
    assert abs(half.count("none") / 2000 - 0.5) < 0.05
    assert set(kinds(cutmix_alpha=0.0)) == {"mixup"} and set(kinds(mixup_alpha=0.0)) <= {"cutmix", "none"}
    assert set(kinds(mix_prob=0.0)) == {"none"}


def test_a_cutmix_box_is_a_rectangle_of_the_image_whose_area_is_one_minus_lambda():
    task = CONFIG.replace(cutmix_alpha=1.0).task
    x, _ = batch(4)
    for seed in range(200):
        mix = draw(task, 32, seed)
        if mix.box is None:
            continue
        top, bottom, left, right = mix.box
        assert 0 <= top < bottom <= 32 and 0 <= left < right <= 32
        mask = cutmix_mask(mix.box, MODEL)
        assert mask.shape == (16, 192) and mask.float().mean().item() == pytest.approx(1 - mix.lam)
        mixed = mix_patches(x, mix, MODEL)
        assert mixed.dtype == torch.uint8 and mixed.shape == x.shape
        image, own, partner = (vit.unpatchify(t, 8, (4, 4)) for t in (mixed, x, x.flip(0)))
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top:bottom, left:right] = True
        assert torch.equal(image[:, inside], partner[:, inside])
        assert torch.equal(image[:, ~inside], own[:, ~inside])


def test_mixup_blends_pixels_and_stays_uint8_in_range():
    x, _ = batch(5)
    x[0] = 255  # extremes blend to the ends of the range, never past them
    x[4] = 0
    for lam in (0.0, 0.3, 0.5, 0.999):
        mixed = mix_patches(x, Mix(lam), MODEL)
        assert mixed.dtype == torch.uint8 and mixed.shape == x.shape
        exact = lam * x.double() + (1 - lam) * x.flip(0).double()
        assert (mixed.double() - exact).abs().max() <= 0.5 + 1e-6
    assert mix_patches(x, Mix(), MODEL) is x


def test_a_mixed_step_trains_on_the_drawn_mix_and_counts_hits_by_the_soft_targets_argmax(world):
    model = build_model(MIXED, world)
    objective = objective_for(MIXED)
    x, y = batch(8, seed=3)
    seed = mix_seed(0, 4, 0, 0)
    losses, hits = objective.losses(model, (x, y), seed=seed)
    mix = draw(MIXED.task, 32, seed)
    assert mix.lam < 1.0
    targets = soft_targets(y, 4, mix.lam, 0.1)
    with torch.no_grad():
        logits = model(mix_patches(x, mix, MODEL)).float()
    torch.testing.assert_close(losses.detach(), -(targets * logits.log_softmax(-1)).sum(-1))
    assert hits.item() == int((logits.argmax(-1) == targets.argmax(-1)).sum())


def test_the_step_seeds_each_micro_batch_by_seed_step_rank_and_index(world, monkeypatch):
    config = MIXED.replace(micro_batch_size=4, seed=11)
    step = TrainStep(build_model(config, world), config, world)
    seen = []
    real = step.objective.losses
    monkeypatch.setattr(
        step.objective, "losses", lambda m, b, seed=None: (seen.append(seed), real(m, b, seed))[1]
    )
    x, y = batch(8)
    step(6, [(x[:4], y[:4]), (x[4:], y[4:])], global_count=8)
    assert seen == [mix_seed(11, 6, 0, 0), mix_seed(11, 6, 0, 1)]  # a resumed step 6 seeds alike


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"objective": "mae", "label_key": None, "mixup_alpha": 0.8, "label_smoothing": 0.1},
            "--label-smoothing, --mixup-alpha: soft targets of supervised training; drop them for --objective mae",
        ),
        ({"label_smoothing": 1.0}, "--label-smoothing must be in [0, 1), got 1.0"),
        ({"cutmix_alpha": -1.0}, "--cutmix-alpha must be in [0, 100], got -1.0"),
        ({"mix_prob": 1.5}, "--mix-prob must be in [0, 1], got 1.5"),
        ({"switch_prob": -0.1}, "--switch-prob must be in [0, 1], got -0.1"),
    ],
)
def test_settings_are_checked_in_one_line(changes, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        CONFIG.replace(**changes).validate()


def test_the_module_draws_nothing_from_numpys_global_rng(monkeypatch):
    monkeypatch.setattr(mixing.np.random, "random", lambda *a: pytest.fail("global numpy RNG"))
    monkeypatch.setattr(mixing.np.random, "beta", lambda *a: pytest.fail("global numpy RNG"))
    draw(MIXED.task, 32, 3)
