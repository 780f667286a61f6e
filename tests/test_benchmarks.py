"""The benchmarks' options run at a tiny size on CPU: `train --compare-timm --trace` and `embed
--compare-timm`. timm is not installed here (it needs torchvision, which has no build beside the CPU
torch), so a stand-in module named timm, whose `create_model` builds a ViT of the asked shape from
vitray's own parts, takes its place: what is tested is the benchmark's logic (the shape it asks for,
the alternation, the report), not timm."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from torch import nn

import vit

TINY = ["--model", "vit_tiny_test", "--image-size", "32", "--num-classes", "4"]


class StandInViT(nn.Module):
    """timm's VisionTransformer interface, as the benchmarks use it: float images in, logits out."""

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        self.model = vit.create_model(
            "vit_tiny_test",
            image_size=kwargs["img_size"],
            patch_size=kwargs["patch_size"],
            embed_dim=kwargs["embed_dim"],
            depth=kwargs["depth"],
            num_heads=kwargs["num_heads"],
            mlp_dim=round(kwargs["mlp_ratio"] * kwargs["embed_dim"]),
            num_classes=kwargs["num_classes"],
            head="finetune",
        )
        self.checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.checkpointing = enable

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        assert images.is_floating_point() and images.dim() == 4
        return self.model(images)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(images)


@pytest.fixture
def fake_timm(monkeypatch):
    built: list[StandInViT] = []

    def create_model(name: str, pretrained: bool = False, **kwargs) -> StandInViT:
        assert not pretrained
        built.append(StandInViT(**kwargs))
        return built[-1]

    module = types.ModuleType("timm")
    module.create_model = create_model
    module.__spec__ = types.SimpleNamespace(name="timm")  # what importlib.util.find_spec looks at
    monkeypatch.setitem(sys.modules, "timm", module)
    return built


def test_train_compares_with_timm_alternating_and_writes_a_trace(fake_timm, tmp_path, capsys):
    from jobs.benchmarks import train

    trace = tmp_path / "step.json"
    figures = train.main(
        [*TINY, "--micro-batch-size", "2", "--configs", "eager,ac-ops+fused", "--warmup", "1",
         "--iters", "2", "--compare-timm", "--trace", str(trace), "--json", str(tmp_path / "t.json")]
    )  # fmt: skip
    out = capsys.readouterr().out
    # timm's model has vitray's shape, and checkpointing as each configuration says.
    assert [m.kwargs["depth"] for m in fake_timm] == [2, 2]
    assert [m.checkpointing for m in fake_timm] == [False, True]
    assert fake_timm[0].kwargs["embed_dim"] == 64 and fake_timm[0].kwargs["mlp_ratio"] == 2.0
    configs = [r["config"] for r in figures["results"]]
    assert configs == ["eager", "timm (eager)", "ac-ops+fused", "timm (ac-ops+fused)"]
    assert all(r["images_per_s"] > 0 for r in figures["results"])
    assert [r["optimizer"] for r in figures["results"]] == ["foreach", "foreach", "fused", "foreach"]
    assert set(figures["vitray_over_timm"]) == {"eager", "ac-ops+fused"}
    assert "timm (ac-ops+fused)" in out and "vitray / timm images/s, eager:" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events), "the trace holds no operator"
    assert json.loads((tmp_path / "t.json").read_text())["vitray_over_timm"].keys() == {
        "eager",
        "ac-ops+fused",
    }


def test_train_without_timm_says_so_in_one_line_and_still_measures(monkeypatch, capsys):
    import importlib.util

    from jobs.benchmarks import train

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "timm" else real(name, *a)
    )
    figures = train.main([*TINY, "--micro-batch-size", "2", "--configs", "eager", "--warmup", "1", "--iters", "1",
                          "--compare-timm"])  # fmt: skip
    assert "timm is not installed: --compare-timm skipped" in capsys.readouterr().out
    assert [r["config"] for r in figures["results"]] == ["eager"]


def test_train_refuses_an_unknown_switch_before_building_anything():
    from jobs.benchmarks import train

    with pytest.raises(SystemExit, match="unknown switch 'compiled' in --configs 'compiled\\+ac'"):
        train.main([*TINY, "--configs", "compiled+ac"])


def test_embed_model_only_compares_with_timm_forward_features(fake_timm, tmp_path, capsys):
    from jobs.benchmarks import embed

    figures = embed.main(
        [*TINY[:4], "--batch-size", "2", "--iters", "2", "--model-only", "--compare-timm",
         "--json", str(tmp_path / "e.json")]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert fake_timm[0].kwargs["num_classes"] == 0 and fake_timm[0].kwargs["depth"] == 2
    assert figures["model_only_images_per_s"] > 0 and figures["vitray_over_timm_model_only"] > 0
    assert "model only, timm forward_features" in out and "vitray / timm (model only)" in out
    assert "shards of" not in out  # --model-only writes no shards
    assert json.loads((tmp_path / "e.json").read_text())["vitray_over_timm_model_only"] > 0
