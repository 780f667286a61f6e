"""CPU seconds of a whole process tree by kind of process (driver, Ray's daemons and workers, others),
read from /proc: what a data pipeline costs, whatever else the machine is running."""

from __future__ import annotations

import os
from pathlib import Path


def process_tree_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process and all its descendants, by kind of process.

    Read from /proc (user + system, plus reaped children), so it counts Ray's daemons and workers and
    DataLoader workers alike, and it does not depend on what else the machine is running.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    parent, used, names = {}, {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry)
        parent[pid] = int(fields[1])
        used[pid] = (sum(int(f) for f in fields[11:13]) / ticks, sum(int(f) for f in fields[13:15]) / ticks)
        names[pid] = cmd
    me, out = os.getpid(), {}
    for pid, (own, reaped) in used.items():
        p = pid
        while p not in (me, 0, 1) and p in parent:
            p = parent[p]
        if p == me:
            kind = _kind(pid, me, names[pid])
            out[kind] = out.get(kind, 0.0) + own
            # Children that exited and were reaped: DataLoader workers (ours), Ray workers (raylet's).
            reaped_kind = "subprocesses" if pid == me else kind
            out[reaped_kind] = out.get(reaped_kind, 0.0) + reaped
    return out


def _kind(pid: int, me: int, cmd: str) -> str:
    if pid == me:
        return "driver"
    if cmd.startswith("ray::"):
        return "ray workers"
    base = os.path.basename(cmd.split()[0]) if cmd.split() else "?"
    if "raylet" in base or "gcs_server" in base:
        return base
    return "ray daemons" if "ray" in cmd.lower() else "subprocesses"


RAY_KINDS = ("ray workers", "raylet", "gcs_server", "ray daemons")
