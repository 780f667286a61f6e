"""The job scripts (``jobs/<name>.py``) loaded as modules of a test's process, to call their ``main``
with the test's arguments and capture what they print."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def load_job(name: str, module_name: str | None = None) -> ModuleType:
    """``jobs/<name>.py`` loaded afresh under ``module_name`` (``vitray_jobs_<name>`` unless given): a name
    no package has, so it shadows nothing in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(module_name or f"vitray_jobs_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
