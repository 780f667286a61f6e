"""Every documented way to start a job passes its arguments through a shell intact.

KubeRay's submitter runs a RayJob's entrypoint with ``bash -ce``; a user pastes the README's lines
into bash; ``ray job submit -- ...`` hands the words after ``--`` to the cluster quoted again
(``shlex.join``), so they arrive as that first shell split them. An unquoted brace range such as
``train-{000000..002047}.tar`` would become 2,048 arguments on the way. Each command line below (the
RayJob entrypoint, the README, the jobs' docstrings, the demo's cluster commands) runs through
``bash -ce`` with ``--print-config`` appended, with a ``ray`` stand-in that runs what follows ``--``,
and the job must report the ``--data`` and ``--out`` that the line spells. Nothing touches the
network: ``--print-config`` exits before any data, weights or cluster is read.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import settings
from pipeline.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOBS = ("jobs/pretrain.py", "jobs/embed.py")
IMAGE_CHECKOUT = "/home/ray/vitray/"  # where cluster/Dockerfile puts this checkout
# `ray job submit [options] -- command...` runs the command; any other `ray` use is not collected.
# The job then runs on the cluster, where RAY_ADDRESS is set (--print-config connects nowhere).
SUBMITTED = "RAY_ADDRESS=http://127.0.0.1:8265"
RAY_STAND_IN = f'ray() {{ while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done; shift; {SUBMITTED} "$@"; }}'


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    lines, pending = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((pending + line).strip())
        pending = ""
    return lines


def without_comment(line: str) -> str:
    """The line up to an unquoted ``#`` that starts a word (bash's comment rule)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def readme_commands() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```[ \t]*(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    return [("README.md", body) for lang, body in blocks if lang in ("", "sh", "bash", "shell")]


def docstring_commands() -> list[tuple[str, str]]:
    found = []
    for job in JOBS:
        found.append((job, ast.get_docstring(ast.parse((ROOT / job).read_text())) or ""))
    tree = ast.parse((ROOT / "jobs" / "demo.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "CLUSTER_COMMANDS" for t in node.targets
        ):
            found.append(("jobs/demo.py CLUSTER_COMMANDS", ast.literal_eval(node.value)))
    return found


def yaml_entrypoints() -> list[tuple[str, str]]:
    """Every ``entrypoint`` value in cluster/*.yaml, and the job commands in their comments."""
    found = []

    def walk(node, name):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "entrypoint" and isinstance(value, str):
                    found.append((f"{name} entrypoint", value))
                walk(value, name)
        elif isinstance(node, list):
            for value in node:
                walk(value, name)

    for path in sorted((ROOT / "cluster").glob("*.yaml")):
        text = path.read_text()
        walk(yaml.safe_load(text), f"cluster/{path.name}")
        comments = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
        found.append((f"cluster/{path.name} comments", comments))
    return found


def job_commands() -> list[tuple[str, str]]:
    """(where, command line) for every complete command line that starts one of the two jobs; lines
    whose arguments are elided (``python jobs/pretrain.py ...``) are no commands and are left out."""
    commands = []
    for where, text in readme_commands() + docstring_commands() + yaml_entrypoints():
        for line in logical_lines(text):
            line = without_comment(line)
            if not any(job in line for job in JOBS) or "..." in line.split():
                continue
            if "--print-config" in line or line.split()[0] not in ("python", "ray"):
                continue
            commands.append((where, line))
    return commands


COMMANDS = job_commands()


def test_the_collection_finds_every_kind_of_source():
    sources = {where.split()[0] for where, _ in COMMANDS}
    assert {"README.md", "jobs/pretrain.py", "jobs/embed.py", "jobs/demo.py"} <= sources
    assert "cluster/kuberay-rayjob.yaml entrypoint" in {where for where, _ in COMMANDS}
    # What makes the test worth having: brace ranges, sent through `ray job submit` and straight.
    assert sum("{" in line for _, line in COMMANDS) >= 4
    assert any(line.startswith("ray job submit") for _, line in COMMANDS)


def expected(line: str) -> tuple[str, dict[str, str]]:
    """(job, {field: value}) as the line spells them: shlex splits like the first shell, without
    brace expansion."""
    words = shlex.split(line)
    index = next(i for i, w in enumerate(words) if w.endswith(JOBS))
    job = next(j for j in JOBS if words[index].endswith(j))
    args = words[index + 1 :]
    values = {}
    for flag in ("--data", "--out"):
        if flag in args:
            values[flag[2:]] = args[args.index(flag) + 1]
    return job, values


@pytest.mark.parametrize(("where", "line"), COMMANDS, ids=[f"{w}: {c[:60]}" for w, c in COMMANDS])
def test_the_job_receives_its_arguments_as_written(where, line):
    job, values = expected(line)
    assert values.get("data"), f"{where}: no --data in {line!r}"
    command = line.replace(IMAGE_CHECKOUT, f"{ROOT}/") + " --print-config"
    if "entrypoint" in where:  # KubeRay runs it on the cluster's head
        command = f"{SUBMITTED} {command}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"  # `python` is this venv's
    result = subprocess.run(
        ["bash", "-ce", f"{RAY_STAND_IN}\n{command}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{where}: {line}\n{result.stderr[-2000:]}"
    config = json.loads(result.stdout)
    for field, value in values.items():
        got = printed(config, job, field)
        assert got == value, f"{where}: {job} got --{field} {got!r}, the line says {value!r}"


def printed(config: dict, job: str, option: str):
    """The value ``--option`` set in a printed config: a top-level field of the embedding config, or the
    setting behind the flag in the training config's sections (``--data`` sets ``data.shards``)."""
    if job != "jobs/pretrain.py":
        return config[option]
    path = next(path for path, _, flag in settings.flags(TrainConfig) if flag == option)
    for part in path:
        config = config[part]
    return config
