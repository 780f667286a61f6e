"""The command line is frozen: every documented command line and every flag of the jobs resolve to the
configuration they resolved to before the training config became sections.

``cli_before.json`` holds, for each command line of the README, the jobs' docstrings, the demo and the
cluster YAMLs, and for each flag of every job given alone with a sample value, the ``--print-config``
output of the flat configuration it replaced. The test resolves the same words with today's parsers and
compares field by field (a flat field's new home is the setting of the same name; ``data``,
``eval_data``, ``crop_scale`` and ``crop_ratio`` are the settings behind those flags). Lines that needed
a GPU to print (``jobs/embed.py --gpu``) are not in the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import cli, settings
from pipeline.embed.config import EmbedConfig
from pipeline.embed.config import parser as embed_parser
from pipeline.evaluate.config import AnalyzeConfig, EvaluateConfig, analyze_parser, evaluate_parser
from pipeline.redaction import redacted
from pipeline.train import presets
from pipeline.train.config import TrainConfig

BEFORE = json.loads((Path(__file__).parent / "cli_before.json").read_text())
# Flat training fields whose setting has another name now (the flag is unchanged).
RENAMED = {"data": "shards", "eval_data": "eval_shards", "crop_scale": "scale", "crop_ratio": "ratio"}
# The same for the other jobs: embed's --interpolation sets the eval-transform section's field, named as
# training's (`pipeline.data.config.EvalTransform`), and so does analyze's.
JOB_RENAMED = {"interpolation": "eval_interpolation"}
# Defaults changed on purpose since, (before, now), each with its reason: a command line that does not
# set the flag resolves to the new default.
CHANGED_DEFAULTS = {
    # The next epoch's pipeline starts this many steps ahead (BENCHMARKS.md, "The product path on one
    # GPU"): 2 left 39% of a short-epoch run waiting for data, 8 left 1%.
    "prefetch_steps": (2, 8),
}


def resolve(job: str, argv: list[str]):
    if job == "pretrain":
        return presets.resolve(presets.pretrain_parser().parse_args(argv))
    if job == "finetune":
        return presets.resolve(presets.finetune_parser().parse_args(argv), objective="supervised")
    kind, parser = {
        "embed": (EmbedConfig, embed_parser),
        "evaluate": (EvaluateConfig, evaluate_parser),
        "analyze": (AnalyzeConfig, analyze_parser),
    }[job]
    return kind(**cli.overrides(parser().parse_args(argv), kind))


def flattened(config) -> dict:
    if not isinstance(config, TrainConfig):
        values = json.loads(json.dumps(settings.to_dict(config)))
        return {next((o for o, n in JOB_RENAMED.items() if n == k), k): v for k, v in values.items()}
    values = json.loads(json.dumps(settings.to_dict(config)))
    return {name: _at(values, path) for name, path in _paths().items()}


def _paths() -> dict:
    owners = settings.paths(TrainConfig)
    return {old: owners[RENAMED.get(old, old)] for old in _old_fields()}


def _old_fields() -> set[str]:
    return {key for row in BEFORE if row["job"] in ("pretrain", "finetune") for key in row["config"]}


def _at(values: dict, path: tuple[str, ...]):
    for part in path:
        values = values[part]
    return values


def test_the_file_covers_every_job_and_the_documented_lines():
    jobs = {row["job"] for row in BEFORE}
    assert jobs == {"pretrain", "finetune", "embed", "evaluate", "analyze"}
    assert sum(row["where"] == "README.md" for row in BEFORE) >= 8
    assert sum(row["where"].startswith("flag ") for row in BEFORE) >= 100


@pytest.mark.parametrize(
    "row", BEFORE, ids=[f"{r['job']} {r['where']} {' '.join(r['argv'])[:50]}" for r in BEFORE]
)
def test_a_command_line_resolves_as_before(row):
    now = flattened(resolve(row["job"], row["argv"]))
    before = dict(row["config"])
    if row["job"] == "embed":  # chosen from --gpu / --cpu and the cluster when the job runs
        before.pop("use_gpu"), now.pop("use_gpu")
    # Storage options print as the names of those set (`pipeline.redaction`): no output or log holds a
    # credential, whatever its option's name.
    if "storage_options" in before:
        before["storage_options"] = redacted(before["storage_options"])
    for key, (old, new) in CHANGED_DEFAULTS.items():
        if before.get(key) == old and now.get(key) == new and f"--{key.replace('_', '-')}" not in row["argv"]:
            before[key] = new
    differences = {k: (v, now.get(k, "<missing>")) for k, v in before.items() if now.get(k, "<missing>") != v}
    assert not differences, f"{row['job']} {row['argv']}: (before, now) {differences}"
