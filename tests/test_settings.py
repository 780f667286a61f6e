"""Settings: each config field is one declaration (`pipeline.settings.setting`), from which the flags,
their help, the names validation messages give and the JSON form all come."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import cli, settings
from pipeline.data.config import DataConfig
from pipeline.embed.config import EmbedConfig
from pipeline.embed.config import parser as embed_parser
from pipeline.evaluate.config import AnalyzeConfig, EvaluateConfig, analyze_parser, evaluate_parser
from pipeline.train import presets
from pipeline.train.config import DERIVED_DATA_FIELDS, TrainConfig
from tests.configs import tiny_config

# Fields that are no flags, by config: each derived from another setting or chosen by the job.
NOT_FLAGS = {
    TrainConfig: {"arch.model_overrides", *(f"data.{name}" for name in DERIVED_DATA_FIELDS)},
    EmbedConfig: {"use_gpu"},  # --gpu / --cpu, or what the cluster has
    EvaluateConfig: set(),
    AnalyzeConfig: set(),
}
PARSERS = {
    TrainConfig: presets.pretrain_parser,
    EmbedConfig: embed_parser,
    EvaluateConfig: evaluate_parser,
    AnalyzeConfig: analyze_parser,
}
# The flags of a job that set no field of its config.
JOB_FLAGS = {"help", "preset", "address", "num_cpus", "print_config", "verbose", "cpu", "gpu"}


@pytest.mark.parametrize("kind", list(PARSERS), ids=lambda k: k.__name__)
def test_fields_and_flags_match_one_to_one(kind):
    fields = {".".join(path) for path, _ in settings.leaves(kind)}
    flagged = {".".join(path) for path, _, _ in settings.flags(kind)}
    assert fields - flagged == NOT_FLAGS[kind]
    parser = PARSERS[kind]()
    dests = {a.dest for a in parser._actions} - (JOB_FLAGS - {path[-1] for path, _ in settings.leaves(kind)})
    excluded = set(presets.NOT_PRETRAIN_FLAGS) if kind is TrainConfig else set()  # fine-tuning's --weights
    assert dests == {path.rsplit(".", 1)[-1] for path in flagged} - excluded
    for action in parser._actions:  # every flag has its help, taken from the field's doc line
        assert action.help, action.option_strings


def test_every_setting_has_a_doc_line_and_a_unique_flag():
    for kind in PARSERS:
        for path, f in settings.leaves(kind):
            assert settings.help_of(f), (kind.__name__, path)
        options = [o for _, _, o in settings.flags(kind)]
        assert len(options) == len(set(options)), kind.__name__


def test_finetune_takes_no_model_or_objective_flag_and_needs_weights():
    parser = presets.finetune_parser()
    options = {o for a in parser._actions for o in a.option_strings}
    assert "--model" not in options and "--objective" not in options and "--mask-ratio" not in options
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", "d", "--out", "o"])  # --weights missing


def test_a_bool_setting_is_a_pair_of_switches_and_none_clears_an_optional_one():
    parse = presets.pretrain_parser().parse_args
    resolve = presets.resolve
    assert resolve(parse(["--no-hflip"])).data.hflip is False
    assert resolve(parse(["--hflip"])).data.hflip is True
    assert resolve(parse(["--cpu"])).cluster.use_gpu is False
    assert resolve(parse(["--label-key", "none"])).data.label_key is None
    assert resolve(parse(["--stop-at-step", "7"])).run.stop_at_step == 7
    assert resolve(parse(["--storage-options", '{"anon": true}'])).data.storage_options == {"anon": True}


def test_validation_messages_name_the_flag_the_field_makes():
    assert settings.flag(TrainConfig, "scale") == "--crop-scale"
    assert settings.flag(TrainConfig, "shards") == "--data"
    with pytest.raises(ValueError, match=r"^--micro-batch-size must be from 1 to 2,147,483,647, got 0$"):
        tiny_config(micro_batch_size=0).validate()
    with pytest.raises(ValueError, match=r"^--placement-strategy must be one of PACK, SPREAD"):
        tiny_config(placement_strategy="ANYWHERE").validate()
    with pytest.raises(ValueError, match="no training data: pass --data"):
        tiny_config(data="").validate()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"min_lr": 0.5, "lr": 0.002},
            "--min-lr 0.5 must be in [0, --lr 0.002]: the schedule decays from --lr",
        ),
        ({"min_lr": -1e-5}, "--min-lr must be in [0, 100], got -1e-05"),
        ({"weight_decay": -0.1}, "--weight-decay must be in [0, 10], got -0.1"),
        ({"weight_decay": float("nan")}, "--weight-decay must be in [0, 10], got nan"),
        ({"weight_decay": float("inf")}, "--weight-decay must be in [0, 10], got inf"),
        ({"betas": (1.5, 0.9)}, "--betas must each be in [0, 1), got 1.5,0.9"),
        ({"betas": (0.9, 1.0)}, "--betas must each be in [0, 1), got 0.9,1"),
        ({"keep_checkpoints": 0}, "--keep-checkpoints must be from 1 to 2,147,483,647, got 0"),
        ({"stop_at_step": 0}, "--stop-at-step must be from 1 to 2,147,483,647, got 0"),
        ({"image_size": 0}, "--image-size must be from 1 to 65,536, got 0"),
        ({"num_classes": 0}, "--num-classes must be at least 1, got 0"),
    ],
)
def test_settings_no_run_can_use_are_refused_in_one_line_that_names_the_flag(changes, message):
    with pytest.raises(ValueError) as info:
        tiny_config(**changes).validate()
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_the_edges_of_those_settings_are_taken():
    config = tiny_config(min_lr=0.002, lr=0.002, weight_decay=0.0, betas=(0.0, 0.999), keep_checkpoints=1)
    config.replace(stop_at_step=1).validate()
    assert (config.optim.min_lr, config.optim.betas, config.run.keep_checkpoints) == (0.002, (0.0, 0.999), 1)


def test_replace_takes_field_or_flag_names_across_sections():
    config = tiny_config(lr=0.5, crop_scale=(0.5, 1.0), data="x", eval_data="y", seed=3, objective="mae")
    assert (config.optim.lr, config.data.scale, config.run.shards, config.run.eval_shards) == (
        0.5, (0.5, 1.0), "x", "y"
    )  # fmt: skip
    # the data section follows the sections that own its derived fields
    assert (config.data.seed, config.data.mask_ratio, config.data.require_labels) == (3, 0.75, False)
    with pytest.raises(ValueError, match="has no setting 'lrr'"):
        tiny_config(lrr=1)


def test_presets_derive_from_one_another():
    tiny, small = presets.tiny(), presets.small()
    changed = {
        ".".join(path)
        for path, _ in settings.leaves(TrainConfig)
        if settings.get(tiny, path) != settings.get(small, path)
    }
    assert changed == {
        "arch.model", "data.scale", "optim.batch_size", "optim.micro_batch_size", "optim.warmup_steps",
        "optim.max_steps", "data.shuffle_buffer", "run.log_every", "run.checkpoint_every",
        "task.decoder_dim", "task.decoder_depth",
    }  # fmt: skip
    assert presets.vit_h14_224() == presets.vit_b16_224().replace(
        model="vit_h14", micro_batch_size=64, lr=3e-4, weight_decay=0.1, log_every=20, checkpoint_every=1000
    )


def test_json_round_trips_tuples_sections_and_redacts_secrets():
    config = tiny_config(
        crop_scale=(0.2, 1.0), storage_options={"key": "AKIA", "client_kwargs": {"region_name": "x"}}
    )
    saved = json.loads(json.dumps(config.to_dict()))
    assert saved["version"] == TrainConfig.CONFIG_VERSION
    assert saved["data"]["storage_options"] == {"key": "***", "client_kwargs": "***"}  # names alone
    again = TrainConfig.from_dict(saved)
    assert again.data.scale == (0.2, 1.0) and isinstance(again.data.scale, tuple)
    assert again.data.storage_options is None  # a redacted secret is never taken for the real one
    assert again == config.replace(storage_options=None)
    # A URL is saved without what may be a credential in it (a password, a SAS token).
    signed = tiny_config(data="https://user:pw@acct.blob.core.windows.net/c/x.tar?sv=1&sig=abc").to_dict()
    assert "https://acct.blob.core.windows.net/c/x.tar" in json.dumps(signed)
    assert "pw@" not in json.dumps(signed) and "sig=abc" not in json.dumps(signed)


def test_unknown_keys_and_newer_versions_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^TrainConfig version 1 has unknown field\(s\) modle$"):
        TrainConfig.from_dict({"modle": "vit_b16"})
    saved = tiny_config().to_dict()
    saved["optim"]["lrr"] = 1
    with pytest.raises(
        ValueError, match=r"^OptimConfig has no field\(s\) lrr; remove them or update vitray$"
    ):
        TrainConfig.from_dict(saved)
    with pytest.raises(ValueError, match=r"version 3 is newer than this vitray reads \(2\)"):
        TrainConfig.from_dict({**tiny_config().to_dict(), "version": 3})
    with pytest.raises(ValueError, match=r"^DataConfig has no field\(s\) scal"):
        DataConfig.from_dict({"scal": [0.1, 1]})


def test_a_flat_config_saved_by_an_older_run_loads_as_the_same_run():
    # The --print-config of `jobs/pretrain.py --preset tiny --data ... --out ...` before sections (version 1).
    rows = json.loads((Path(__file__).parent / "system" / "cli_before.json").read_text())
    row = next(r for r in rows if r["job"] == "pretrain" and r["argv"][:2] == ["--preset", "tiny"])
    flat = row["config"]
    assert "version" not in flat and "crop_scale" in flat
    # prefetch_steps: a default changed since; the run keeps the value it saved
    expected = presets.tiny().replace(
        data=flat["data"], out=flat["out"], prefetch_steps=flat["prefetch_steps"]
    )
    assert flat["prefetch_steps"] == 2 and TrainConfig.from_dict(flat) == expected


def test_a_config_without_version_is_not_a_dataclass_detail():
    # Configs without CONFIG_VERSION carry none in JSON.
    assert "version" not in settings.to_dict(DataConfig())
    assert dataclasses.is_dataclass(settings.from_dict(DataConfig, settings.to_dict(DataConfig())))


@dataclasses.dataclass(frozen=True)
class Bounded:
    """A config whose settings declare bounds (`settings.check`)."""

    name: str = settings.setting(help="what it is called", required=True)
    count: int = settings.setting(1, "how many", ge=1)
    share: float = settings.setting(0.5, "a share", gt=0, le=1)
    below: float | None = settings.setting(None, "an optional value under one", lt=1)
    sizes: tuple[int, ...] = settings.setting((1, 2), "sizes", ge=1)
    kind: str = settings.setting("a", "which kind", choices=("a", "b"))
    knob: int = settings.setting(3, "a field that is no flag", flag=None, ge=0, le=2**31 - 1)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"name": ""}, "--name is required: what it is called"),
        ({"count": 0}, "--count must be at least 1, got 0"),
        ({"share": 0.0}, "--share must be in (0, 1], got 0.0"),
        ({"share": float("nan")}, "--share must be in (0, 1], got nan"),
        ({"below": 1.0}, "--below must be less than 1, got 1.0"),
        ({"sizes": (1, 0)}, "--sizes must each be at least 1, got 1,0"),
        ({"kind": "c"}, "--kind must be one of a, b, got 'c'"),
        ({"knob": -1}, "Bounded: knob must be from 0 to 2,147,483,647, got -1"),
    ],
)
def test_a_declared_bound_refuses_in_one_line_naming_the_flag_value_and_bound(changes, message):
    with pytest.raises(ValueError) as info:
        settings.check(Bounded(**{"name": "x", **changes}))
    assert str(info.value) == message


def test_values_on_the_bounds_and_an_unset_optional_pass():
    settings.check(Bounded(name="x", count=1, share=1.0, below=None, sizes=(1,), kind="b", knob=0))
    settings.check(Bounded(name="x", below=-5.0))


def test_the_bounds_are_in_the_flags_help_and_the_options_reference():
    parser = argparse.ArgumentParser()
    cli.add_settings(parser, Bounded, defaults=Bounded(name=""))
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--count"] == "how many; at least 1 (default: 1)"
    assert helps["--share"] == "a share; in (0, 1] (default: 0.5)"
    assert "--knob" not in helps
    reference = (Path(__file__).parents[1] / "docs" / "options.md").read_text()
    assert (
        "neighbours in the k-NN vote (cosine similarity, one vote each); from 1 to 2,147,483,647 |"
        in reference
    )


def test_the_jobs_refuse_a_value_outside_a_bound_before_any_work(tmp_path):
    from pipeline.export import ExportConfig
    from pipeline.index.config import IndexConfig

    cases = [
        (EvaluateConfig(train="a", test="b", probe_c=0.0), "--probe-c must be in (0, 1e+09], got 0.0"),
        (
            EvaluateConfig(train="a", test="b", shots=(5, 0)),
            "--shots must each be from 1 to 2,147,483,647, got 5,0",
        ),
        (AnalyzeConfig(weights="w", data="d", out=""), "--out is required: directory for the PNGs"),
        (EmbedConfig(data="d", weights="w", out="o", crop_fraction=1.5), "--crop-fraction must be in (0, 1]"),
        (
            EmbedConfig(data="d", weights="w", out="o", dtype="int8"),
            "--dtype must be one of float32, float16",
        ),
        (ExportConfig(weights="w", to="onnx", out="o"), "--to must be one of timm, hf, got 'onnx'"),
        (IndexConfig(embeddings="e", out="o", ray_tasks=-1), "--ray-tasks must be from 0 to 65,536, got -1"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError) as info:
            config.validate()
        assert str(info.value).startswith(message), (str(info.value), message)


def configs_of_settings() -> list[type]:
    """Every dataclass of ``pipeline`` with a field declared by `settings.setting` (its doc line in the
    field's metadata), the sections a job's config is made of included."""
    import importlib
    import pkgutil

    import pipeline

    found = set()
    for module in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
        for value in vars(importlib.import_module(module.name)).values():
            declared = isinstance(value, type) and dataclasses.is_dataclass(value)
            if declared and any("help" in f.metadata for f in dataclasses.fields(value)):
                found.add(value)
    return sorted(found, key=lambda kind: (kind.__module__, kind.__name__))


def test_every_config_takes_its_validation_and_json_from_the_one_base():
    # The sections `settings.optional` makes (EvalOverrides) are taken by configs that have the base.
    kinds = [kind for kind in configs_of_settings() if kind.__name__ != "EvalOverrides"]
    assert len(kinds) >= 15 and TrainConfig in kinds and DataConfig in kinds
    without = [kind.__name__ for kind in kinds if not issubclass(kind, settings.Settings)]
    assert not without, f"configs not made on settings.Settings: {without}"
    again = [
        f"{kind.__name__}.{name}"
        for kind in kinds
        for name in ("to_dict", "from_dict", "replace")
        if name in vars(kind)
    ]
    assert not again, f"written again instead of taken from settings.Settings: {again}"
    assert TrainConfig.from_dict(tiny_config().to_dict()) == tiny_config()
    assert DataConfig().replace(crop_fraction=0.5).crop_fraction == 0.5
    with pytest.raises(ValueError, match=r"^--crop-fraction must be in \(0, 1\], got 2"):
        EmbedConfig(data="x", weights="w", out="o", crop_fraction=2.0).validate()
