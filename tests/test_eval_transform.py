"""The evaluation transform has one home, `DataConfig.for_eval`: the embedding, analyze and fine-tuning
jobs take their eval configs from it, each equal to what that job settled on before it had one; its knobs
are declared once, `EvalTransform`, the section each of those jobs' flags come from."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vit
from pipeline import settings
from pipeline.data.config import DataConfig, EvalOverrides, EvalTransform
from pipeline.embed.config import EmbedConfig
from pipeline.embed.config import parser as embed_parser
from pipeline.embed.identity import PREPROCESSING_IDENTITY
from pipeline.embed.job import eval_data_config as embed_eval_config
from pipeline.evaluate import inspection
from pipeline.evaluate.config import AnalyzeConfig, analyze_parser
from pipeline.model_source import ModelSource, load_model_source
from pipeline.train import finetune, presets
from pipeline.train.config import TrainConfig

# What a training run stored: its own crop share, eval filter, label key and class count.
TRAINED = DataConfig(
    image_size=64,
    patch_size=16,
    crop_fraction=0.9,
    eval_interpolation="bilinear",
    label_key="json:label",
    num_classes=10,
    seed=7,
)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A vit_tiny_test export (32 px, patch 8) whose config.json carries `TRAINED` as preprocessing."""
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", num_classes=4)
    path = tmp_path_factory.mktemp("export")
    vit.save_pretrained(path, model.state_dict(), model.config, extra={"preprocessing": TRAINED.to_dict()})
    return str(path)


@pytest.fixture
def made(monkeypatch):
    """Every config `DataConfig.for_eval` returns, in order."""
    out: list[DataConfig] = []
    original = DataConfig.for_eval.__func__

    def spy(cls, *args, **kwargs):
        out.append(original(cls, *args, **kwargs))
        return out[-1]

    monkeypatch.setattr(DataConfig, "for_eval", classmethod(spy))
    return out


def test_the_model_sizes_replace_the_stored_ones_and_the_rest_is_the_training_runs():
    config = DataConfig.for_eval(TRAINED.to_dict(), image_size=32, patch_size=8)
    assert config == dataclasses.replace(TRAINED, image_size=32, patch_size=8)
    assert DataConfig.for_eval(TRAINED, image_size=32, patch_size=8) == config  # a DataConfig base alike


def test_crop_share_filter_and_other_fields_override_where_given():
    given = EvalOverrides(crop_fraction=0.5, eval_interpolation="nearest")
    config = DataConfig.for_eval(TRAINED.to_dict(), image_size=32, patch_size=8, transform=given, seed=1)
    assert (config.crop_fraction, config.eval_interpolation, config.seed) == (0.5, "nearest", 1)
    assert config.label_key == "json:label"
    # a knob the section leaves unset (None) keeps the model's own
    kept = DataConfig.for_eval(
        TRAINED, image_size=32, patch_size=8, transform=EvalOverrides(crop_fraction=0.5)
    )
    assert (kept.crop_fraction, kept.eval_interpolation) == (0.5, "bilinear")


def test_without_stored_preprocessing_the_defaults_apply_and_bad_sizes_are_one_line():
    assert DataConfig.for_eval(None, image_size=32, patch_size=8) == DataConfig(image_size=32, patch_size=8)
    assert DataConfig.for_eval({}, image_size=32, patch_size=8) == DataConfig(image_size=32, patch_size=8)
    with pytest.raises(ValueError, match="not divisible by patch_size 8"):
        DataConfig.for_eval(None, image_size=30, patch_size=8)


def test_the_embedding_jobs_eval_config_comes_from_it(export, made):
    source = load_model_source(export)
    flags = EmbedConfig(
        data="x", weights=export, out="y", max_bad_fraction=0.2, storage_options={"anon": True}
    )
    config = embed_eval_config(source, flags)
    assert made == [config]
    assert config == dataclasses.replace(
        TRAINED,
        image_size=32,
        patch_size=8,
        require_labels=False,
        num_classes=None,
        max_bad_fraction=0.2,
        storage_options={"anon": True},
    )
    flagged = embed_eval_config(
        source, flags.replace(crop_fraction=0.5, interpolation="nearest", label_key=None)
    )
    assert (flagged.crop_fraction, flagged.eval_interpolation, flagged.label_key) == (0.5, "nearest", None)


def test_the_analyze_jobs_eval_config_comes_from_it(export, synthetic_shards, monkeypatch, made):
    taken = []

    def eval_patches(shards, config, count):  # stop where the images would be decoded
        taken.append(config)
        raise InterruptedError

    monkeypatch.setattr(inspection, "eval_patches", eval_patches)
    with pytest.raises(InterruptedError):
        inspection.analyze(
            AnalyzeConfig(weights=export, data=synthetic_shards.dir, out="unused", cpu=True), log=str
        )
    assert made == taken
    assert taken[0] == dataclasses.replace(
        TRAINED, image_size=32, patch_size=8, label_key=None, require_labels=False
    )


def test_a_model_source_gives_the_jobs_that_run_it_their_eval_config_one_way(
    export, synthetic_shards, monkeypatch, made
):
    """The embedding and analyze jobs take a model's eval config from its source (`ModelSource.eval_data`),
    as the search job's image query does (tests/index): the one call that reads the stored preprocessing."""
    through: list[DataConfig] = []
    real = ModelSource.eval_data

    def eval_data(self, *args, **kwargs):
        through.append(real(self, *args, **kwargs))
        return through[-1]

    monkeypatch.setattr(ModelSource, "eval_data", eval_data)
    monkeypatch.setattr(inspection, "eval_patches", lambda *args: (_ for _ in ()).throw(InterruptedError))
    source = load_model_source(export)
    embed_eval_config(source, EmbedConfig(data="x", weights=export, out="y"))
    with pytest.raises(InterruptedError):
        inspection.analyze(
            AnalyzeConfig(weights=export, data=synthetic_shards.dir, out="unused", cpu=True), log=str
        )
    assert len(through) == 2 and through == made  # each config made by the source, none made beside it


def test_fine_tunings_eval_config_comes_from_it(made):
    run = TrainConfig().replace(
        model="vit_tiny_test", image_size=32, num_classes=4, crop_ratio=(0.5, 2.0), seed=3
    )
    config = finetune.eval_data_config(run, patch_size=8)
    assert made == [config]
    assert config == dataclasses.replace(run.data_for(8), max_bad_fraction=1.0)


def _eval_flags(parser) -> dict[str, tuple]:
    """The parser's flags over `EvalTransform`'s knobs: option -> (help, choices, metavar)."""
    options = {f"--{settings.flag_name(f)}" for f in dataclasses.fields(EvalOverrides)}
    options |= {f"--{settings.flag_name(f)}" for f in dataclasses.fields(EvalTransform)}
    return {
        option: (action.help, action.choices, action.metavar)
        for action in parser._actions
        for option in action.option_strings
        if option in options
    }


def test_the_jobs_that_read_a_model_take_its_eval_knobs_from_the_one_declaration():
    knobs = [f.name for f in dataclasses.fields(EvalTransform)]
    assert knobs == [f.name for f in dataclasses.fields(EvalOverrides)]
    assert all(issubclass(kind, EvalOverrides) for kind in (EmbedConfig, AnalyzeConfig))
    assert issubclass(DataConfig, EvalTransform)
    embed, analyze = _eval_flags(embed_parser()), _eval_flags(analyze_parser())
    assert list(embed) == ["--crop-fraction", "--interpolation"]  # the flags embed always had
    assert embed == analyze  # the same flags, help, choices
    for f, option in zip(dataclasses.fields(EvalTransform), embed, strict=True):
        help_text, choices, _ = embed[option]
        assert help_text.startswith(settings.help_of(f)) and "none: the model's own" in help_text
        assert tuple(choices or ()) == tuple(f.metadata["choices"] or ())
    # fine-tuning (and pretraining) evaluate with DataConfig's own: the same knobs, with their defaults
    tuned = _eval_flags(presets.finetune_parser())
    assert list(tuned) == ["--crop-fraction", "--eval-interpolation"]
    for f, option in zip(dataclasses.fields(EvalTransform), tuned, strict=True):
        assert tuned[option][0].startswith(settings.help_of(f))


def test_a_knob_added_to_the_section_is_a_flag_a_bound_and_an_override_of_the_jobs():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Grown(EvalTransform):
        eval_margin: float = settings.setting(0.0, "a knob added for this test", ge=0, le=1)

    overrides = settings.optional(
        Grown, "GrownOverrides", unset="the model's own", flag=lambda o: o.removeprefix("eval-")
    )
    assert [settings.flag_name(f) for f in dataclasses.fields(overrides)][-1] == "margin"
    with pytest.raises(ValueError, match=r"^--margin must be in \[0, 1\], got -1.0$"):
        settings.check(overrides(eval_margin=-1.0))
    assert overrides().eval_margin is None  # the model's own unless given
    # each knob of the section is part of what an embedding output is of
    assert {f.name for f in dataclasses.fields(EvalTransform)} <= set(PREPROCESSING_IDENTITY)
