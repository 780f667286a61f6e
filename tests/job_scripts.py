"""The job scripts (``jobs/<name>.py``) loaded as modules of a test's process, to call their ``main``
with the test's arguments and capture what they print."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
from pathlib import Path
from types import ModuleType
from unittest import mock

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def load_job(name: str, module_name: str | None = None) -> ModuleType:
    """``jobs/<name>.py`` loaded afresh under ``module_name`` (``vitray_jobs_<name>`` unless given): a name
    no package has, so it shadows nothing in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(module_name or f"vitray_jobs_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_without_ray(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python jobs/<name>.py args`` run in this process with Ray out of reach: its exit code, stdout and
    stderr, as a subprocess would give them. For the checks a job makes before any cluster work: a job that
    reaches for Ray ends with an error line naming Ray. (A subprocess spends seconds importing torch; each
    job's command-line test still runs it once as its own process.)"""
    from pipeline import cli

    def no_ray(*_args, **_kwargs):
        raise AssertionError("the job reached for Ray")

    out, err = io.StringIO(), io.StringIO()
    no_cluster = mock.patch.object(cli, "connect_ray", no_ray)
    with no_cluster, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = load_job(name, f"vitray_jobs_{name}_without_ray").main(list(args))
        except SystemExit as e:  # argparse's own: --help, a usage error
            code = e.code
    return subprocess.CompletedProcess([name, *args], code, out.getvalue(), err.getvalue())
