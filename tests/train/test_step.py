"""The optimizer step, schedule, decay rules and checkpoints, in one process (a world of one)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pipeline import dcp
from pipeline.data.dataset import rebatch
from pipeline.train.checkpointing import checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.step.model import build_model, model_config
from pipeline.train.step.optim import lr_factor, param_groups
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config
from tests.distributed import spawn

CONFIG = tiny_config()


def batch(n: int, seed: int, config: TrainConfig = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mcfg = model_config(config)
    patches = torch.randint(0, 256, (n, mcfg.num_patches, mcfg.patch_dim), dtype=torch.uint8, generator=g)
    return patches, torch.randint(0, config.arch.num_classes, (n,), generator=g)


def params(model) -> dict[str, torch.Tensor]:
    # Parameters are FSDP2 DTensors; buffers (the input normalization) are plain tensors.
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in full.items()}


def test_schedule_warms_up_then_decays_to_min():
    cfg = CONFIG.replace(warmup_steps=10, max_steps=110, min_lr=1e-4, lr=1e-3)
    factors = [lr_factor(s, cfg) for s in range(111)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5)  # cosine halfway
    assert factors[110] == pytest.approx(0.1)  # min_lr / lr
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))  # never rises after warmup
    linear = cfg.replace(lr_schedule="linear")
    assert lr_factor(60, linear) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(35, linear) == pytest.approx(0.1 + 0.9 * 0.75)


def test_no_decay_on_biases_norms_position_and_cls(world):
    model = build_model(CONFIG, world)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert {"pos_embed", "cls_token"} <= no_decay_names
    assert all(n.endswith(".weight") and "norm" not in n for n in decay_names)
    assert any("norm" in n for n in no_decay_names) and any(n.endswith(".bias") for n in no_decay_names)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))


def gradients_of_one_step(step: TrainStep, micro_batches, global_count: int, micro_steps=None):
    """(full gradients just before the optimizer step, StepStats): what the update is made from."""
    grads, real = {}, step.optimizer.step

    def capture():
        for name, p in step.model.named_parameters():
            grads[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        real()

    step.optimizer.step = capture
    stats = step(0, micro_batches, global_count=global_count, micro_steps=micro_steps)
    step.optimizer.step = real
    return grads, stats


NO_CLIP = CONFIG.replace(grad_clip=1e9)  # gradients compared as computed, not as clipped


def test_accumulation_equals_one_big_batch(world):
    patches, labels = batch(8, seed=1)
    one = TrainStep(build_model(NO_CLIP, world), NO_CLIP, world)
    grads_one, stats_one = gradients_of_one_step(one, [(patches, labels)], 8)
    cfg = NO_CLIP.replace(micro_batch_size=4)
    two = TrainStep(build_model(cfg, world), cfg, world)
    micro = [(patches[:4], labels[:4]), (patches[4:], labels[4:])]
    grads_two, stats_two = gradients_of_one_step(two, micro, 8)
    # Adam's first update is about lr x sign(g): only the gradients show a wrong scale.
    torch.testing.assert_close(stats_two.grad_norm, stats_one.grad_norm, rtol=1e-5, atol=0)
    assert grads_one.keys() == grads_two.keys()
    for name in grads_one:
        torch.testing.assert_close(grads_two[name], grads_one[name], rtol=1e-4, atol=1e-7)
    a, b = params(one.model), params(two.model)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(a[k], params(build_model(CONFIG, world))[k]) for k in a)


def test_parameters_stay_gathered_and_gradients_unsynced_until_the_last_micro_batch(world, monkeypatch):
    # Issue 13 (HSDP): the non-final micro-batches neither reduce gradients nor reshard parameters, so
    # the next micro-batch's forward does not gather them again.
    cfg = CONFIG.replace(micro_batch_size=2)
    step = TrainStep(build_model(cfg, world), cfg, world)
    calls = {"sync": [], "reshard": []}
    for name, key in (("set_requires_gradient_sync", "sync"), ("set_reshard_after_backward", "reshard")):
        real = getattr(step.model, name)
        monkeypatch.setattr(
            step.model, name, lambda flag, _real=real, _key=key: (calls[_key].append(flag), _real(flag))
        )
    patches, labels = batch(6, seed=2)
    micro = [(patches[i : i + 2], labels[i : i + 2]) for i in (0, 2, 4)]
    step(0, micro, global_count=6, micro_steps=4)  # three micro-batches and one zero-loss pass
    assert calls == {"sync": [False, False, False, True], "reshard": [False, False, False, True]}


def _two_rank_steps(rank: int, config: dict, weights: dict, cases: list, out_path: str) -> None:
    """Each case's step on this rank's micro-batches (8 samples in all, two micro-steps on every rank),
    from the same weights; rank 0 saves the gradients and norms."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    cfg = TrainConfig.from_dict(config)
    results = []
    for per_rank in cases:
        model = build_model(cfg, torch.device("cpu"))
        set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))
        grads, stats = gradients_of_one_step(TrainStep(model, cfg, torch.device("cpu")), per_rank[rank], 8, 2)
        results.append({"grads": grads, "grad_norm": stats.grad_norm})
    if rank == 0:
        torch.save(results, out_path)


# Micro-batch sizes of rank 0 and rank 1, cut from one batch of 8.
UNEVEN = {
    "uneven samples": ([4, 2], [1, 1]),
    "fewer micro-batches": ([4, 2], [2]),
    "a rank with no samples": ([4, 4], []),
}


def test_ranks_with_uneven_or_no_samples_make_the_gradient_of_the_mean_loss(world, tmp_path):
    """Two ranks' micro-batches (two processes, FSDP2; two micro-steps each, whether or not a rank has
    data for them) against one process over all 8 samples."""
    patches, labels = batch(8, seed=6)
    reference = build_model(NO_CLIP, world)
    weights = params(reference)
    grads, stats = gradients_of_one_step(TrainStep(reference, NO_CLIP, world), [(patches, labels)], 8)

    cases = []
    for sizes in UNEVEN.values():
        bounds = np.cumsum([0, *sizes[0], *sizes[1]]).tolist()
        cuts = [(patches[a:b], labels[a:b]) for a, b in itertools.pairwise(bounds)]
        per_rank = [cuts[: len(sizes[0])], cuts[len(sizes[0]) :]]
        cases.append(per_rank)
    cfg = NO_CLIP.replace(num_workers=2, micro_batch_size=4)
    spawn(_two_rank_steps, cfg.to_dict(), weights, cases, str(tmp_path / "out.pt"))
    for name, two in zip(UNEVEN, torch.load(tmp_path / "out.pt", weights_only=True), strict=True):
        torch.testing.assert_close(two["grad_norm"], stats.grad_norm, rtol=1e-5, atol=0, msg=name)
        for param, grad in grads.items():
            torch.testing.assert_close(
                two["grads"][param], grad, rtol=1e-4, atol=1e-7, msg=f"{name}: {param}"
            )


def test_loss_falls_on_a_fixed_batch(world):
    model = build_model(CONFIG, world)
    step = TrainStep(model, CONFIG, world)
    patches, labels = batch(8, seed=2)
    losses = [step(i, [(patches, labels)], 8).loss_sum.item() / 8 for i in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad():  # top-1 hits of the weights step 30 starts from, counted here
        hits = int((model(patches.to(world)).argmax(-1).cpu() == labels).sum())
    stats = step(30, [(patches, labels)], 8)
    assert stats.count == 8 and stats.correct.item() == hits and hits >= 6  # the batch is mostly learned
    assert stats.lr == pytest.approx(CONFIG.optim.lr * lr_factor(30, CONFIG))
    assert torch.isfinite(stats.grad_norm)


def refuse_reads_from_the_device(monkeypatch) -> None:
    """Make any read of a tensor's value on the host (what waits for a GPU) fail."""

    def refuse(*args, **kwargs):
        raise AssertionError("the step read a value back from the device")

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_a_non_finite_loss_skips_the_update_as_if_the_step_never_ran(world, monkeypatch, impl):
    # foreach: the host decides, reading the norm back; fused: the kernels skip on the device, and
    # the step reads nothing back.
    config = CONFIG.replace(optimizer_impl=impl)
    good, other = batch(8, seed=4), batch(8, seed=5)
    straight = build_model(config, world)
    straight_step = TrainStep(straight, config, world)
    straight_step(0, [good], 8)
    straight_step(2, [other], 8)

    model = build_model(config, world)
    step = TrainStep(model, config, world)
    step(0, [good], 8)
    real_loss = torch.nn.functional.cross_entropy
    monkeypatch.setattr(
        torch.nn.functional, "cross_entropy", lambda *a, **k: real_loss(*a, **k) * float("nan")
    )
    if impl == "fused":
        refuse_reads_from_the_device(monkeypatch)
    stats = step(1, [good], 8)
    monkeypatch.undo()
    assert stats.skipped and not torch.isfinite(stats.grad_norm)
    assert all(p.grad is None for p in model.parameters())
    assert not step(2, [other], 8).skipped
    # Weights and AdamW's moments and step counts as if step 1 had never been taken.
    for k, v in params(straight).items():
        assert torch.equal(v, params(model)[k]), k
    a, b = straight_step.optimizer.state_dict()["state"], step.optimizer.state_dict()["state"]
    for i in a:
        for name in a[i]:
            assert torch.equal(torch.as_tensor(a[i][name]), torch.as_tensor(b[i][name])), (i, name)


def test_checkpoint_round_trip(world, tmp_path):
    model = build_model(CONFIG, world)
    step = TrainStep(model, CONFIG, world)
    patches, labels = batch(8, seed=3)
    for i in range(3):
        step(i, [(patches, labels)], 8)
    state = {
        "step": 3,
        "epoch": 1,
        "seed": 0,
        "epoch_position": {"world": 1, "micro_batch_size": 8, "micro_batches": 2},
    }
    mcfg = model_config(CONFIG)
    path = tmp_path / dcp.checkpoint_name(3)
    checkpoint.save(path, model, step.optimizer, state, {"model_config": mcfg.to_dict()})
    assert dcp.is_complete(path) and dcp.latest_complete(tmp_path).url == str(path)
    (tmp_path / dcp.checkpoint_name(9)).mkdir()  # a save that never finished
    assert dcp.latest_complete(tmp_path).url == str(path)

    fresh = build_model(CONFIG.replace(seed=7), world)
    fresh_step = TrainStep(fresh, CONFIG, world)
    loaded = checkpoint.load(path, fresh, fresh_step.optimizer)
    assert {k: loaded[k] for k in state} == state
    for k, v in params(model).items():
        assert torch.equal(v, params(fresh)[k]), k
    # Same state, same next step: optimizer moments came back too.
    step(3, [(patches, labels)], 8)
    fresh_step(3, [(patches, labels)], 8)
    for k, v in params(model).items():
        torch.testing.assert_close(v, params(fresh)[k], rtol=0, atol=0)

    other = CONFIG.replace(model_overrides={"embed_dim": 32, "num_heads": 2})
    with pytest.raises(ValueError, match=r"another model: embed_dim 64 \(checkpoint\) vs 32"):
        checkpoint.check_compatible(path, model_config(other))


def test_a_resume_takes_its_moments_from_the_checkpoint_and_its_settings_from_the_run(world, tmp_path):
    before = CONFIG.replace(optimizer="adamw", weight_decay=0.05, layer_decay=0.75)
    model = build_model(before, world)
    step = TrainStep(model, before, world)
    patches, labels = batch(8, seed=3)
    step(0, [(patches, labels)], 8)
    path = tmp_path / dcp.checkpoint_name(1)
    saved = {"model_config": model_config(before).to_dict(), "train": before.to_dict()}
    checkpoint.save(path, model, step.optimizer, {"step": 1, "epoch": 0, "seed": 0}, saved)

    # Another weight decay and layer decay on resume: the command line's apply, the moments are kept.
    now = before.replace(weight_decay=0.3, layer_decay=0.65)
    checkpoint.check_compatible(path, model_config(now), None, now.optim)
    fresh = build_model(now, world)
    fresh_step = TrainStep(fresh, now, world)
    checkpoint.load(path, fresh, fresh_step.optimizer)
    wanted = TrainStep(build_model(now, world), now, world).optimizer.param_groups
    for group, own in zip(fresh_step.optimizer.param_groups, wanted, strict=True):
        assert (group["weight_decay"], group["lr_scale"]) == (own["weight_decay"], own["lr_scale"])
    assert {g["weight_decay"] for g in fresh_step.optimizer.param_groups} == {0.0, 0.3}
    originals = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        moment, saved_moment = (
            fresh_step.optimizer.state[p]["exp_avg"],
            step.optimizer.state[originals[name]]["exp_avg"],
        )
        torch.testing.assert_close(moment, saved_moment, rtol=0, atol=0)

    # Another optimizer, or layer decay turned off (other parameter groups): refused in one line.
    with pytest.raises(
        ValueError, match=r"holds the state of optimizer adamw, this run has --optimizer sgd;"
    ):
        checkpoint.check_compatible(path, model_config(now), None, now.replace(optimizer="sgd").optim)
    with pytest.raises(
        ValueError, match=r"state of --layer-decay 0.75, this run has 1 \(no per-layer groups\)"
    ):
        checkpoint.check_compatible(path, model_config(now), None, now.replace(layer_decay=1.0).optim)


def test_rebatch_cuts_exact_sizes_and_keeps_the_short_tail():
    def b(start: int, n: int) -> dict[str, np.ndarray]:
        return {
            "label": np.arange(start, start + n),
            "url": np.array([f"u{i}" for i in range(start, start + n)]),
        }

    out = list(rebatch(iter([b(0, 4), b(4, 3), b(7, 6), b(13, 0), b(13, 2)]), 4))
    assert [len(x["label"]) for x in out] == [4, 4, 4, 3]  # every sample once: the last batch is short
    assert np.concatenate([x["label"] for x in out]).tolist() == list(range(15))
    assert out[2]["url"].tolist() == ["u8", "u9", "u10", "u11"]
    assert out[3]["url"].tolist() == ["u12", "u13", "u14"]
    assert [len(x["label"]) for x in rebatch(iter([b(0, 4), b(4, 4)]), 4)] == [4, 4]  # no empty tail


def test_grad_clip_zero_trains_unclipped_and_a_negative_threshold_is_refused(world):
    """0 is "no clipping" (DeiT's recipe), not a threshold that scales every gradient to zero."""
    patches, labels = batch(8, seed=4)
    after = {}
    for clip in (0.0, 1e9):
        torch.manual_seed(0)
        config = tiny_config(grad_clip=clip)
        model = build_model(config, world)
        before = params(model)
        TrainStep(model, config, world)(0, [(patches, labels)], 8)
        after[clip] = params(model)
        assert any(not torch.equal(before[k], after[clip][k]) for k in before)
    for name, value in after[0.0].items():
        torch.testing.assert_close(value, after[1e9][name], rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match=r"--grad-clip must be in \[0, 1e\+09\]"):
        tiny_config(grad_clip=-1.0).validate()
