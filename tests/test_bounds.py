"""Every bound enforced: each numeric flag of every job, given NaN, inf, -1, 0, 1e21 and 10^21 on an
otherwise whole command line with ``--print-config``, is refused in one ``error:`` line with exit code 2,
or, where the value lies within the bounds the flag's help states, taken as given (or refused, in one
line, by a check that compares it with another flag). ``--print-config`` prints only a config that
validates; a wide elastic range is answered at once. No Ray, no data: the jobs' checks before any work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import re
import time
from types import ModuleType

import pytest

from pipeline import cli, settings
from pipeline.train.sections import MAX_WORKERS
from tests.job_scripts import load_job

# Each job, and the flags that make its command line whole (none of them numeric).
JOBS = {
    "pretrain": ["--data", "d", "--out", "o"],
    "finetune": ["--weights", "w", "--data", "d", "--out", "o"],
    "embed": ["--data", "d", "--weights", "w", "--out", "o", "--cpu"],
    "evaluate": ["--train", "a", "--test", "b"],
    "analyze": ["--weights", "w", "--data", "d", "--out", "o"],
    "index": ["--embeddings", "e", "--out", "o"],
    "search": ["--index", "i", "--key", "k"],
    "export": ["--weights", "w", "--to", "timm", "--out", "o"],
    "make_shards": ["--synthetic", "4", "--out", "o"],
}
VALUES = ["nan", "inf", "-1", "0", "1e21", str(10**21)]
# The parsers of numeric flags (`pipeline.cli._parser_for`; `--num-workers`'s and `--num-cpus`'s own).
NUMERIC = {"int", "float", "pair", "shot_list", "worker_count", "whole_number"}


@pytest.fixture(scope="module")
def jobs() -> dict[str, ModuleType]:
    return {name: load_job(name, f"vitray_jobs_{name}_bounds") for name in JOBS}


def call(job: ModuleType, argv: list[str]) -> tuple[int, str, str]:
    """``job.main(argv)`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = job.main(argv)
        except SystemExit as e:  # argparse's refusals
            code = e.code
    return code, out.getvalue(), err.getvalue()


def parser_of(job: ModuleType):
    """The job's parser, as its ``main`` builds it."""
    made = {}
    real = cli.main

    def capture(parser, *args, **kwargs):
        made["parser"] = parser
        return 0

    cli.main = capture
    try:
        job.main([])
    finally:
        cli.main = real
    return made["parser"]


def numeric_flags(parser) -> dict[str, tuple[object, dict, str]]:
    """option -> (its parser, its bounds, its help) for every numeric flag."""
    flags = {}
    for action in parser._actions:
        kind = getattr(action.type, "__name__", "")
        if kind in NUMERIC and action.option_strings:
            flags[action.option_strings[0]] = (kind, action.help or "")
    return flags


def numeric_flags_named(job: ModuleType) -> list[str]:
    """Every option of the job's parser."""
    return [o for a in parser_of(job)._actions for o in a.option_strings]


def bounds_of(config_type: type, option: str) -> tuple[dict, dataclasses.Field] | None:
    """The bounds of the setting behind ``option``, and its field (None: a flag that is no setting)."""
    for _, f, name in settings.flags(config_type):
        if f"--{name}" == option:
            return f.metadata.get("bounds") or {}, f
    return None


def admitted(kind: str, text: str, bounds: dict) -> bool:
    """Whether ``text`` parses as the flag's kind and lies within its bounds (finite)."""
    try:
        value = int(text) if kind in ("int", "shot_list", "worker_count", "whole_number") else float(text)
    except ValueError:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    compare = {"ge": value.__ge__, "gt": value.__gt__, "le": value.__le__, "lt": value.__lt__}
    return all(compare[name](bound) for name, bound in bounds.items())


def written(kind: str, text: str) -> str:
    """The flag's argument: a pair flag takes the value twice (``MIN,MAX``)."""
    return f"{text},{text}" if kind == "pair" else text


def config_type_of(name: str) -> type:
    from pipeline.data.make_shards import MakeShardsConfig
    from pipeline.embed.config import EmbedConfig
    from pipeline.evaluate.config import AnalyzeConfig, EvaluateConfig
    from pipeline.export import ExportConfig
    from pipeline.index.config import IndexConfig, SearchConfig
    from pipeline.train.config import TrainConfig

    return {
        "pretrain": TrainConfig, "finetune": TrainConfig, "embed": EmbedConfig, "evaluate": EvaluateConfig,
        "analyze": AnalyzeConfig, "index": IndexConfig, "search": SearchConfig, "export": ExportConfig,
        "make_shards": MakeShardsConfig,
    }[name]  # fmt: skip


def test_every_numeric_setting_of_every_job_declares_both_bounds(jobs):
    """NaN fails any bound, inf any finite one; a value no run can use fails the upper one."""
    for name, job in jobs.items():
        config_type = config_type_of(name)
        options = numeric_flags(parser_of(job))
        for _, f, option in settings.flags(config_type):
            if f"--{option}" not in options:
                continue
            bounds = f.metadata.get("bounds") or {}
            assert {"ge", "gt"} & set(bounds) and {"le", "lt"} & set(bounds), (name, option, bounds)
            assert all(math.isfinite(b) for b in bounds.values()), (name, option, bounds)
            assert settings.bounds_text(f) in options[f"--{option}"][1], (name, option)  # in its help


@pytest.mark.parametrize("name", list(JOBS))
def test_every_numeric_flag_refuses_nan_inf_and_values_past_its_bounds_in_one_line(jobs, name):
    job, base, config_type = jobs[name], JOBS[name], config_type_of(name)
    code, out, err = call(job, [*base, "--print-config"])
    assert (code, err) == (0, ""), err  # the base command line is whole
    flags = numeric_flags(parser_of(job))
    numbers = {
        f"--{o}" for _, f, o in settings.flags(config_type) if re.search(r"\b(int|float)\b", str(f.type))
    }
    assert numbers & set(numeric_flags_named(job)) <= set(flags)  # the walk misses no numeric setting
    walked = 0
    for option, (kind, _) in flags.items():
        declared = bounds_of(config_type, option)
        bounds = declared[0] if declared else {"ge": 1, "le": cli.MAX_LOCAL_CPUS}  # --num-cpus
        for text in VALUES:
            code, out, err = call(job, [*base, option, written(kind, text), "--print-config"])
            walked += 1
            where = f"{name} {option} {text}: exit {code}, {err!r}"
            if code == 0:
                assert admitted(kind, text, bounds), where  # only a value its help's bounds admit
                if declared:
                    field = declared[1].name
                    value = _find(json.loads(out), field)
                    assert (
                        value == pytest.approx(float(text))
                        or value == [float(text)] * 2
                        or value == [int(text)]
                    ), where
                continue
            assert code == 2 and out == "", where
            assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), where
            assert "Traceback" not in err, where
    assert walked == len(flags) * len(VALUES)


def _find(values: dict, field: str):
    """A field's value in a printed config, whatever section holds it."""
    if field in values:
        return values[field]
    for value in values.values():
        if isinstance(value, dict):
            found = _find(value, field)
            if found is not None:
                return found
    return None


def test_print_config_refuses_a_config_no_run_can_use(jobs):
    """Before: ``--num-workers 3-1`` was printed (``"num_workers": [3, 1]``), exit 0."""
    code, out, err = call(jobs["pretrain"], [*JOBS["pretrain"], "--num-workers", "3-1", "--print-config"])
    assert (code, out) == (2, "")
    assert (
        err.startswith("error: --num-workers 3-1 must be N or MIN-MAX with 1 <= MIN <= MAX")
        and err.count("\n") == 1
    )
    code, out, err = call(jobs["evaluate"], [*JOBS["evaluate"], "--probe-c", "0", "--print-config"])
    assert (code, out, err) == (2, "", "error: --probe-c must be in (0, 1e+09], got 0.0\n")


@pytest.mark.parametrize(
    "workers", ["1-1000000", f"1-{MAX_WORKERS}", f"2-{MAX_WORKERS}", f"64-{MAX_WORKERS}"]
)
def test_a_wide_elastic_range_is_answered_at_once(jobs, workers):
    """Before: ``--num-workers 1-1000000`` gave no answer in a minute (every size walked, an lcm taken over
    all of them, before any bound)."""
    start = time.perf_counter()
    code, out, err = call(jobs["pretrain"], [*JOBS["pretrain"], "--num-workers", workers, "--print-config"])
    assert time.perf_counter() - start < 2
    assert (code, out) == (2, "") and err.count("\n") == 1
    if workers == "1-1000000":
        assert err.startswith(
            f"error: --num-workers 1-1000000 must be N or MIN-MAX with 1 <= MIN <= MAX <= {MAX_WORKERS:,}"
        )
    else:
        assert "does not split over" in err and "in all) worker(s)" in err, err
    # A batch that splits at every size of a range passes: 27,720 is lcm(1..12).
    whole = ["--num-workers", "1-12", "--micro-batch-size", "1", "--batch-size", "27720", "--print-config"]
    assert call(jobs["pretrain"], [*JOBS["pretrain"], *whole])[0] == 0
