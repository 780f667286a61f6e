"""``--head-init probe`` (LP-FT): the new head starts where a linear probe of the pretrained features ends.

- Two ranks as processes, the model sharded by FSDP2: after `fit_probe_head` the model's logits are those
  of `pipeline.linear_probe.fit_linear_probe` fit on the same images' features, on every rank; a sample
  of one class is refused on every rank in one line.
- One process, the worker loop without Ray (tests/train/test_loop.py's fakes): the probe is fit once,
  when the run starts; a run stopped and resumed fits none on resume and ends equal to a straight run.
- The flag: its values, and the presets that set it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import vit
from pipeline.linear_probe import fit_linear_probe
from pipeline.train import finetune, presets
from pipeline.train.config import TrainConfig
from pipeline.train.input import dataplan
from pipeline.train.step.model import build_model
from tests.configs import tiny_config
from tests.distributed import spawn
from tests.train.test_loop import assert_same_weights, fake_micro_batches, run

ROOT = Path(__file__).resolve().parents[2]
CLASSES = 4


def rank_batches(rank: int, num_labels: int) -> list[dict[str, np.ndarray]]:
    """Rank 0 holds two batches, rank 1 one (so rank 1 idles once); labels drawn from ``num_labels``."""
    c = vit.create_model("vit_tiny_test", num_classes=CLASSES).config
    g = np.random.default_rng(rank)
    return [
        {
            "patches": g.integers(0, 256, (6, c.num_patches, c.patch_dim), dtype=np.uint8),
            "label": g.integers(0, num_labels, 6),
        }
        for _ in range(2 - rank)
    ]


def _probe_head(rank: int) -> None:
    config = tiny_config(model_overrides={"head": "finetune"})
    model = build_model(config, torch.device("cpu"))
    c = vit.create_model("vit_tiny_test", num_classes=CLASSES).config
    idle = (torch.zeros(1, c.num_patches, c.patch_dim, dtype=torch.uint8),)  # the model's inputs
    # Labels 0-2 of 4 classes: class 3 is in no batch.
    probe, images, _ = finetune.fit_probe_head(
        model, iter(rank_batches(rank, 3)), idle, torch.device("cpu"), None, CLASSES
    )
    assert images == 18 and model.training

    # The model's weights, whole, in a plain model: its features of every rank's images, and the probe
    # the project's probe code fits on them.
    plain = vit.create_model("vit_tiny_test", num_classes=CLASSES, head="finetune")
    plain.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    plain.eval()
    batches = rank_batches(0, 3) + rank_batches(1, 3)
    patches = torch.from_numpy(np.concatenate([b["patches"] for b in batches]))
    labels = np.concatenate([b["label"] for b in batches])
    with torch.no_grad():
        features = plain.embed(patches).numpy()
        expected = fit_linear_probe(features, labels)
        np.testing.assert_allclose(probe.weight, expected.weight)
        logits = plain(patches).numpy()
        # The head's logits are the probe's; the class no image shows gets zero weights and the
        # lowest fitted bias.
        np.testing.assert_allclose(logits[:, :3], expected.logits(features), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(logits[:, 3], expected.bias.min(), rtol=1e-5)
        # The sharded model computes the same on this rank's own images.
        mine = torch.from_numpy(np.concatenate([b["patches"] for b in rank_batches(rank, 3)]))
        model.eval()
        torch.testing.assert_close(model(mine), plain(mine), rtol=1e-4, atol=1e-4)

    # One class in every rank's images: every rank refuses, in one line.
    with pytest.raises(finetune.HeadInitError) as refused:
        finetune.fit_probe_head(model, iter(rank_batches(rank, 1)), idle, torch.device("cpu"), None, CLASSES)
    message = str(refused.value)
    assert "two classes" in message and "--head-init zero" in message and "\n" not in message


def test_the_head_starts_where_the_probe_ends_under_fsdp2_on_two_ranks():
    spawn(_probe_head)


# --- in the worker loop ---------------------------------------------------------------------------


def fake_eval_batches(shards, config, size, data_cpus) -> Iterator[dict[str, np.ndarray]]:
    """`finetune.eval_batches` without Ray: the same rows for the same shards, every time."""
    n, dim = (config.image_size // config.patch_size) ** 2, config.patch_size**2 * 3
    for url in shards:
        g = np.random.default_rng(int(url.rsplit("-", 1)[1]))
        yield {"patches": g.integers(0, 256, (size, n, dim), dtype=np.uint8), "label": g.integers(0, 4, size)}


@pytest.fixture
def probe_calls(monkeypatch) -> list[int]:
    """Fakes for the training and the probe's data; the number of probe fits, per run, as they happen."""
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    monkeypatch.setattr(finetune, "eval_batches", fake_eval_batches)
    calls: list[int] = []
    real = finetune.fit_probe_head

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(finetune, "fit_probe_head", counted)
    return calls


def finetune_config(out: Path, weights: Path, **changes) -> TrainConfig:
    config = tiny_config(
        out=str(out), micro_batch_size=4, max_steps=8, log_every=2, checkpoint_every=4, weights=str(weights)
    )
    return finetune.resolve_pretrained(config.replace(head_init="probe", optimizer="sgd", **changes))


def test_a_resumed_run_keeps_its_probe_head_and_ends_equal_to_a_straight_run(world, probe_calls, tmp_path):
    weights = tmp_path / "pretrained"
    source = vit.create_model("vit_tiny_test", image_size=32)
    vit.save_pretrained(weights, source.state_dict(), source.config)

    straight = finetune_config(tmp_path / "straight", weights)
    run(straight, world)
    assert len(probe_calls) == 1
    stopped = finetune_config(tmp_path / "stopped", weights, stop_at_step=4)
    run(stopped, world)
    assert len(probe_calls) == 2
    _, session = run(stopped.replace(stop_at_step=None), world)
    assert len(probe_calls) == 2, "a resume fit the probe again"
    assert session.reports[-1]["step"] == 8
    assert_same_weights(straight, stopped, 8)


# --- the flag -------------------------------------------------------------------------------------


def test_the_finetuning_presets_start_from_a_probe_head_and_pretraining_from_none():
    assert presets.finetune().arch.head_init == presets.finetune_small().arch.head_init == "probe"
    assert presets.finetune_mae().arch.head_init == "probe"
    assert presets.tiny().arch.head_init == "zero"  # no --weights: nothing to probe
    assert presets.finetune_small().data.scale == (0.6, 1.0)
    with pytest.raises(ValueError, match="--head-init must be one of zero, probe, got 'linear'"):
        tiny_config(head_init="linear").validate()


def test_a_bad_head_init_is_refused_in_one_line_before_any_ray():
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "finetune.py"), "--weights", "w", "--data", "d", "--out", "o",
         "--head-init", "linear"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    error = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "--head-init" in error[0] and "'linear'" in error[0], result.stderr
    config = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "finetune.py"), "--weights", "w", "--data", "d", "--out", "o",
         "--head-init", "probe", "--print-config"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert TrainConfig.from_dict(json.loads(config.stdout)).arch.head_init == "probe"
