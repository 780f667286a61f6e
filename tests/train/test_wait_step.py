"""The host benchmark's device-shaped step (`jobs/benchmarks/host.py`): it stands for a real step in
what the run's checkpoints see, in a one-rank world (gloo)."""

from __future__ import annotations

import torch

from pipeline.train.model import build_model
from pipeline.train.objective import objective_for
from tests.configs import tiny_config
from tests.job_scripts import load_job


def test_the_wait_step_leaves_the_optimizer_state_of_a_first_step_and_the_weights(
    world, monkeypatch, tmp_path
):
    """Its run's first checkpoint must not be the one to make the optimizer's state (seconds of host time
    in DCP's state dict, which a real run spends in its first step), and no weight moves."""
    host = load_job("benchmarks/host")
    monkeypatch.setenv(host.STEPS_ENV, f"50,{tmp_path}")
    config = tiny_config(out=str(tmp_path / "run"))
    model = build_model(config, world)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = host.wait_step_class()(model, config, world, objective_for(config))
    assert len(step.optimizer.state) == len(before)  # each parameter's moments, as after a step
    for name, p in model.named_parameters():
        assert torch.equal(whole(p), whole(before[name])), name
        assert p.grad is None


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (FSDP's are DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
