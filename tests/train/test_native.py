"""Training on native-aspect batches (``--patches native``): the objectives over coordinates and masks,
micro-batches of one token budget through the loop, and the loop's promises kept (exact resume at the
sample, also at another layout; each bad sample counted once). One process, a world of one, the loop's
stand-in data stage (`tests.train.test_loop`) with rows made native (`tests.native_rows`)."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.data import native
from pipeline.train import loop
from pipeline.train.config import TrainConfig
from pipeline.train.input import dataplan
from pipeline.train.step.model import build_model, model_config
from pipeline.train.step.objective import objective_for
from tests.configs import tiny_config
from tests.native_rows import as_native, grid_of
from tests.train import test_elastic
from tests.train.test_loop import SAMPLES_PER_SHARD, config, fake_micro_batches, run

# 32 px, 8 px patches: the model's grid is 4 x 4; images of up to 20 patches (grids of their own: 2 x 7,
# 6 x 3, 4 x 4, 4 x 5, 6 x 2, 2 x 10), so micro-batches of 4 x 20 tokens hold 4 images padded to 20 or
# 5 padded to 16.
NATIVE = {"patches": "native", "max_patches": 20}
MAE = {"objective": "mae", "label_key": None, "decoder_dim": 32, "decoder_depth": 1, "decoder_num_heads": 4}


@pytest.fixture
def native_data(monkeypatch):
    """`tests.train.test_loop`'s stand-in data stage (4 shards of 9 samples, the first of each corrupt),
    whose rows are native ones for a native config."""
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)


def micro_batch(cfg: TrainConfig, keys: list[str], length: int) -> tuple[torch.Tensor, ...]:
    """The objective's columns for stand-in images of these keys, cut to ``length`` (`native.cut`)."""
    data = cfg.data_for(8)
    n = len(keys)
    rows = {
        "key": np.array(keys),
        "url": np.array(["mem://x"] * n),
        "patches": np.zeros((n, 1, 192), np.uint8),
        "label": np.arange(n) % 4,
        "error": np.array([""] * n, dtype=object),
    }
    rows = native.cut(as_native(rows, data), np.arange(n), length, data.mask_ratio)
    return tuple(torch.from_numpy(rows[c]) for c in objective_for(cfg).columns)


@pytest.mark.parametrize("changes", [NATIVE, {**NATIVE, **MAE}], ids=["supervised", "mae"])
def test_native_objectives_take_coordinates_and_masks_and_pad_under_compile_to_the_lengths_rows(
    world, changes
):
    """Under compile a micro-batch is padded to the rows its length holds in the budget (4 x 20 tokens:
    5 rows at length 16, 4 at 20), its losses and gradients those of the unpadded batch; a rank without
    samples joins with zero gradients."""
    cfg = tiny_config(micro_batch_size=4, **changes)
    model = build_model(cfg, world)
    compiled, plain = objective_for(cfg.replace(compile=True)), objective_for(cfg)
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape[:2])))
    keys = [k for k in (f"k{i}" for i in range(40)) if np.prod(grid_of(k, cfg.data_for(8))) <= 16][:3]
    batch = micro_batch(cfg, keys, 16)
    model.set_requires_gradient_sync(True)
    results = []
    for objective in (compiled, plain):
        losses, _ = objective.losses(model, batch)
        losses.sum().backward()
        grads = {k: p.grad.full_tensor().clone() for k, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((losses.detach(), grads))
    width = 16 if "mae" not in changes.values() else native.native_visible(16, 0.75)
    assert seen == [(5, width), (3, width)]
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for k in results[1][1]:
        torch.testing.assert_close(results[0][1][k], results[1][1][k], rtol=1e-4, atol=1e-6)
    plain.participate(model, world)
    assert all(
        torch.count_nonzero(p.grad.full_tensor()) == 0 for p in model.parameters() if p.grad is not None
    )
    model.zero_grad(set_to_none=True)
    square = objective_for(tiny_config(**{k: v for k, v in changes.items() if k not in NATIVE}))
    assert plain.flops_per_image() > square.flops_per_image()  # an image of up to 20 patches, not 16


class Steps(loop.StepWatch):
    """(epoch, keys) of each step trained, across every run it watches."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[str]]] = []

    def taken(self, step: loop.TakenStep) -> None:
        self.steps.append((step.epoch, list(step.keys)))


GOOD = sorted(f"mem://shard-{s}/{i}" for s in range(4) for i in range(1, SAMPLES_PER_SHARD))


@pytest.mark.parametrize("changes", [NATIVE, {**NATIVE, **MAE}], ids=["supervised", "mae"])
def test_a_native_run_stopped_mid_epoch_and_resumed_trains_on_the_samples_of_a_straight_run(
    world, native_data, monkeypatch, tmp_path, changes
):
    """Micro-batches of one token budget hold 4 or 5 images, so an epoch's steps differ in size; a run
    stopped inside epoch 0 and resumed trains the straight run's samples, step by step."""
    watch = Steps()
    straight = config(tmp_path / "straight", prefetch_steps=2, **changes)
    summary, _ = run(straight, world, watch)
    straight_steps, watch.steps = watch.steps, []
    by_epoch = collections.defaultdict(list)
    for epoch, keys in straight_steps:
        by_epoch[epoch] += keys
    assert sorted(by_epoch[0]) == GOOD and sorted(by_epoch[1]) == GOOD  # every good sample once an epoch
    assert len({len(keys) for _, keys in straight_steps}) > 1
    stop = 2
    assert straight_steps[stop][0] == 0  # the stop falls inside epoch 0

    stopped = config(tmp_path / "stopped", prefetch_steps=2, stop_at_step=stop, **changes)
    run(stopped, world, watch)
    resumed, _ = run(stopped.replace(stop_at_step=None), world, watch)
    assert watch.steps == straight_steps  # the same samples at the same steps
    assert resumed["bad_samples"] == summary["bad_samples"]  # each bad sample counted once
    assert summary["bad_samples"]["bad"] == 4 * len(by_epoch)
    a, b = (load_file(Path(c.run.out) / "final" / "weights.safetensors") for c in (straight, stopped))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)  # MAE: the encoder


def test_a_square_checkpoint_resumed_with_native_batches_goes_on_by_sample_and_says_why(
    world, monkeypatch, tmp_path, capsys
):
    """Native micro-batches are not square ones: a resume at another --patches re-reads no count of them,
    it deals the epoch's samples not consumed (each once) and names the flag (`tests.train.test_elastic`'s
    stand-in, which carries the read stage's position columns)."""
    monkeypatch.setattr(dataplan, "micro_batches", test_elastic.indexed_micro_batches)
    watch = Steps()
    stopped = test_elastic.config(tmp_path, 1, batch_size=8, micro_batch_size=4, max_steps=9, stop_at_step=3)
    test_elastic.run_in_turn(stopped, stopped.replace(stop_at_step=None, **NATIVE), watch=watch)
    out = capsys.readouterr().out
    assert "it was taken with other --patches or --max-patches" in out
    assert "the workers share the samples this epoch had not consumed, each once" in out
    epoch0 = [k for epoch, keys in watch.steps if epoch == 0 for k in keys]
    assert collections.Counter(epoch0) == collections.Counter(test_elastic.GOOD)  # each once across it


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mixup_alpha": 0.8}, "--mixup-alpha blend images pixel by pixel"),
        ({"model": "vit_r_tiny_test"}, "--patches native needs a plain ViT"),
    ],
)
def test_what_native_batches_cannot_do_is_refused_in_one_line(changes, message):
    cfg = tiny_config(**NATIVE, **changes)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
        model_config(cfg)


def test_a_compiled_native_run_trains_like_an_eager_one_with_a_graph_per_length(world, native_data, tmp_path):
    """Activation checkpointing -> per-block compile -> FSDP2 over native micro-batches: the losses and
    gradient norms of eager, and one graph per padded length (2 here: 16 and 20), not one per batch."""
    from torch._dynamo.utils import counters

    eager = config(tmp_path / "eager", max_steps=4, log_every=1, **NATIVE)
    fast = config(
        tmp_path / "fast", max_steps=4, log_every=1, compile=True, activation_checkpointing=True, **NATIVE
    )
    counters.clear()
    (_, a), (_, b) = run(eager, world), run(fast, world)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2  # compiled, and not once per micro-batch
    bf16 = world.type == "cuda"
    rel = 2e-2 if bf16 else 1e-4
    for x, y in zip(a.reports, b.reports, strict=True):
        for field in ("loss", "grad_norm", "accuracy"):
            assert y[field] == pytest.approx(x[field], rel=rel, abs=1e-6), (x["step"], field)
