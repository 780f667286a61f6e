"""The EMA of the weights (`--ema-decay`, `pipeline.train.step.ema`): its arithmetic against a hand-computed
average, its place in checkpoints (a stopped and resumed run's EMA is a straight run's, on 2 ranks and
resharded to 1; checkpoints without it still resume), and its export `final_ema/`.

The loop runs without Ray as in `tests/train/test_loop.py`: 4 shards x 9 samples (one corrupt each),
batch 8, 4 steps an epoch. The 2-rank runs are processes sharing a gloo group (`tests/distributed.py`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline import dcp
from pipeline.model_source import load_model_source
from pipeline.train import finetune, loop
from pipeline.train.input import dataplan
from pipeline.train.state import local_shard
from pipeline.train.step.ema import WeightEMA
from pipeline.train.step.model import build_model
from pipeline.train.step.train_step import TrainStep
from tests.configs import tiny_config
from tests.distributed import spawn
from tests.train.test_head_init import fake_eval_batches
from tests.train.test_loop import SHARDS, LocalSession, config, fake_micro_batches, run, weights


@pytest.fixture
def fake_data(monkeypatch):
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)


def export(out: Path, name: str = "final_ema") -> dict[str, torch.Tensor]:
    return load_file(out / name / "weights.safetensors")


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_setting_out_of_range_is_refused_in_one_line_naming_its_flag():
    with pytest.raises(ValueError, match=r"^--ema-decay must be in \[0, 1\), got 1.0$"):
        tiny_config(ema_decay=1.0).validate()
    with pytest.raises(ValueError, match=r"^--ema-every must be from 1 to 2,147,483,647, got 0$"):
        tiny_config(ema_decay=0.9, ema_every=0).validate()
    with pytest.raises(ValueError, match=r"^--ema-every 4 needs --ema-decay"):
        tiny_config(ema_every=4).validate()


@pytest.mark.parametrize(("decay", "every"), [(0.5, 1), (0.8, 2)])
def test_three_steps_of_ema_match_a_hand_computed_average(world, decay, every):
    cfg = tiny_config()
    model = build_model(cfg, world)
    step = TrainStep(model, cfg, world)
    ema = WeightEMA(model, decay, every)
    seen = [{n: p.to_local().detach().double().clone() for n, p in model.named_parameters()}]
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        patches = torch.randint(0, 256, (8, 16, 192), dtype=torch.uint8, generator=g)
        step(i, [(patches, torch.randint(0, 4, (8,), generator=g))], global_count=8)
        ema.update(i + 1)
        seen.append({n: p.to_local().detach().double().clone() for n, p in model.named_parameters()})
    # By hand: start from the initial weights; an update every `every` steps with decay^every.
    d = decay**every
    expected = dict(seen[0])
    for s in range(every, 4, every):
        expected = {n: d * expected[n] + (1 - d) * seen[s][n] for n in expected}
    assert not torch.equal(seen[3]["head.fc.weight"], seen[0]["head.fc.weight"])  # the weights did move
    for name, value in ema.shadow.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.double(), expected[name], rtol=0, atol=1e-6, msg=name)
    assert ema.nbytes == 4 * sum(p.numel() for p in model.parameters())


def test_an_ema_of_decay_0_is_the_weights_exactly_and_loads_as_any_export(world, fake_data, tmp_path):
    out = tmp_path / "run"
    summary, _ = run(config(out, ema_decay=0.0), world)
    assert summary["error"] == ""
    assert_equal(export(out), export(out, "final"))
    meta = json.loads((out / "final_ema" / "config.json").read_text())
    assert meta["ema"] == {"decay": 0.0, "every": 1} and "ema" not in json.loads(
        (out / "final" / "config.json").read_text()
    )
    # The embedding job's loader (and fine-tuning's, and evaluation's) takes it like final/.
    source = load_model_source(str(out / "final_ema"))
    assert source.kind == "export" and source.preprocessing is not None
    assert_equal(source.state_dict, export(out))


def test_a_checkpoint_without_ema_resumes_with_the_ema_started_from_its_weights(
    world, fake_data, tmp_path, capsys
):
    stopped = config(tmp_path / "run", stop_at_step=4)
    run(stopped, world)
    assert not (tmp_path / "run" / "final_ema").exists()
    capsys.readouterr()
    summary, _ = run(stopped.replace(ema_decay=0.9), world)  # still at step 4: no step runs
    assert summary["error"] == ""
    assert "holds no EMA of the weights: the EMA starts from its weights at step 4" in capsys.readouterr().out
    assert_equal(export(tmp_path / "run"), weights(stopped, 4))


def test_a_checkpoint_with_ema_resumed_without_it_trains_as_if_there_were_none(world, fake_data, tmp_path):
    straight = config(tmp_path / "straight")
    run(straight, world)
    stopped = config(tmp_path / "stopped", stop_at_step=4, ema_decay=0.9)
    run(stopped, world)
    assert (tmp_path / "stopped" / "final_ema" / "config.json").exists()
    summary, _ = run(stopped.replace(stop_at_step=None, ema_decay=None), world)
    assert summary["error"] == "" and summary["metrics"]["step"] == 8
    assert_equal(export(tmp_path / "stopped", "final"), export(tmp_path / "straight", "final"))
    # The step-4 EMA would sit beside step-8 weights: it is taken away.
    assert not (tmp_path / "stopped" / "final_ema" / "config.json").exists()


# --- two ranks -------------------------------------------------------------------------------------
EMA = {"ema_decay": 0.9, "ema_every": 3}  # updates at steps 3 and 6: the stop at 5 falls between


def two_rank_runs(rank: int, root: str) -> None:
    """A straight 8-step run, and the same run stopped at step 5 (mid-epoch) and resumed."""
    dataplan.micro_batches = fake_micro_batches
    root_dir = Path(root)
    world = 2

    def go(cfg) -> None:
        loop_config = {"train": cfg.to_dict(), "shards": SHARDS, "data_cpus_per_worker": 1.0}
        session = LocalSession(torch.device("cpu"), Path(cfg.run.out), rank, world)
        assert loop.Trainer(loop_config, session).train()["error"] == ""

    go(config(root_dir / "straight", num_workers=world, **EMA))
    stopped = config(root_dir / "stopped", num_workers=world, stop_at_step=5, **EMA)
    go(stopped)
    if rank == 0:  # the EMA at step 5, before the resumed run replaces final_ema/
        shutil.copytree(root_dir / "stopped" / "final_ema", root_dir / "ema_at_5")
    go(stopped.replace(stop_at_step=None))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ema2")
    spawn(two_rank_runs, str(root))
    return root


def test_a_stopped_and_resumed_run_on_two_ranks_has_the_ema_of_a_straight_run(two_ranks):
    straight, resumed = export(two_ranks / "straight"), export(two_ranks / "stopped")
    assert_equal(resumed, straight)
    # Not the weights themselves, nor the EMA at step 5: it went on after the resume.
    assert not torch.equal(
        straight["head.fc.weight"], export(two_ranks / "straight", "final")["head.fc.weight"]
    )
    assert not torch.equal(straight["head.fc.weight"], export(two_ranks, "ema_at_5")["head.fc.weight"])


def test_the_ema_of_a_two_rank_checkpoint_resumes_on_one_rank(two_ranks, world, fake_data, tmp_path):
    out = tmp_path / "one"
    out.mkdir()
    shutil.copytree(two_ranks / "stopped" / dcp.checkpoint_name(5), out / dcp.checkpoint_name(5))
    summary, _ = run(config(out, num_workers=2, stop_at_step=5, **EMA), world)  # no step: export only
    assert summary["error"] == ""
    assert_equal(export(out), export(two_ranks, "ema_at_5"))


# --- the EMA scored beside the weights at every evaluation ----------------------------------------


def test_applied_puts_the_ema_in_the_model_for_the_block_and_its_own_weights_back_bit_for_bit(world):
    cfg = tiny_config()
    model = build_model(cfg, world)
    step = TrainStep(model, cfg, world)
    ema = WeightEMA(model, 0.5)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        patches = torch.randint(0, 256, (8, 16, 192), dtype=torch.uint8, generator=g)
        step(i, [(patches, torch.randint(0, 4, (8,), generator=g))], global_count=8)
        ema.update(i + 1)
    own = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    assert any(not torch.equal(own[n], ema.shadow[n]) for n in own)  # the two differ
    with ema.applied():
        for name, p in model.named_parameters():
            assert torch.equal(p.to_local(), ema.shadow[name].to(p.dtype)), name
    for name, p in model.named_parameters():
        assert torch.equal(p.to_local(), own[name]), name


def run_with_eval(cfg, device) -> dict:
    session = LocalSession(device, Path(cfg.run.out))
    loop_config = {
        "train": cfg.to_dict(),
        "shards": SHARDS,
        "eval_shards": ["mem://eval-0"],
        "data_cpus_per_worker": 1.0,
    }
    return loop.Trainer(loop_config, session).train()


def test_every_evaluation_scores_the_ema_too_and_training_goes_on_as_without_it(world, monkeypatch, tmp_path):
    """``eval_ema_accuracy`` beside ``eval_accuracy`` in the rows of evaluation steps: the EMA's weights
    scored (at the last step, the weights `final_ema/` exports), the run's own weights back after."""
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    monkeypatch.setattr(finetune, "eval_batches", fake_eval_batches)
    scored: list[tuple[int, str, dict[str, float]]] = []  # (step, weights, each parameter's sum)
    real = finetune.evaluate_in_run

    def spy(model, *args, step, weights="", **kwargs):
        scored.append(
            (
                step,
                weights,
                {n: float(local_shard(p).detach().double().sum()) for n, p in model.named_parameters()},
            )
        )
        return real(model, *args, step=step, weights=weights, **kwargs)

    monkeypatch.setattr(finetune, "evaluate_in_run", spy)
    plain = config(tmp_path / "plain", eval_every=4)
    with_ema = config(tmp_path / "ema", eval_every=4, ema_decay=0.9)
    run_with_eval(plain, world)
    summary = run_with_eval(with_ema, world)
    assert summary["error"] == ""
    rows = [json.loads(line) for line in (tmp_path / "ema" / "metrics.jsonl").read_text().splitlines()]
    scored_rows = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in scored_rows] == [4, 8]
    assert all(0 <= r["eval_ema_accuracy"] <= 1 for r in scored_rows)
    assert [(s, w) for s, w, _ in scored] == [(4, ""), (8, ""), (4, ""), (4, "EMA"), (8, ""), (8, "EMA")]
    # At the last step the EMA pass saw the exported EMA, the other pass the exported weights.
    for (_, _, seen), name in ((scored[-1], "final_ema"), (scored[-2], "final")):
        exported = {n: float(t.double().sum()) for n, t in export(tmp_path / "ema", name).items()}
        both = exported.keys() & seen.keys()  # the parameters (an export also holds the constant buffers)
        assert both == seen.keys()
        assert {n: seen[n] for n in both} == pytest.approx({n: exported[n] for n in both}), name
    assert scored[-1][2] != pytest.approx(scored[-2][2])
    assert_equal(export(tmp_path / "ema", "final"), export(tmp_path / "plain", "final"))  # training unchanged
    card = json.loads((tmp_path / "ema" / "final_ema" / "config.json").read_text())["training"]
    assert card["eval_accuracy"] == scored_rows[-1]["eval_ema_accuracy"]
