"""A pytest plugin that records, for every test, its wall seconds and the seconds the machine's CPUs were
busy meanwhile (from /proc/stat, so its subprocesses and Ray's processes count too), to see where a
suite's time goes and how much of it is waiting:

    VITRAY_CPU_PROFILE=/tmp/tests.tsv .venv/bin/python -m pytest -p tests.cpu_profile tests/system

Each row: wall seconds, busy CPU-seconds (all cores), the test's id. Linux only; off unless the variable
names a file.
"""

from __future__ import annotations

import os
import time

import pytest

ENV = "VITRAY_CPU_PROFILE"
_rows: list[tuple[str, float, float]] = []


def _cpu_seconds() -> tuple[float, float]:
    """The machine's total and idle CPU-seconds since boot."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return sum(ticks) / hz, (ticks[3] + ticks[4]) / hz  # idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get(ENV):
        yield
        return
    start, (total, idle) = time.monotonic(), _cpu_seconds()
    yield
    wall, (total_after, idle_after) = time.monotonic() - start, _cpu_seconds()
    _rows.append((item.nodeid, wall, (total_after - total) - (idle_after - idle)))


def pytest_sessionfinish(session):
    path = os.environ.get(ENV)
    if path and _rows:
        with open(path, "w") as f:
            f.writelines(f"{wall:.2f}\t{busy:.2f}\t{nodeid}\n" for nodeid, wall, busy in _rows)
