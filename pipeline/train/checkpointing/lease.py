"""One live run per run directory: the lease a training run holds on its ``--out``.

A run's driver takes the lease (`acquire`) before it starts Ray: ``.vitray-lease.json`` in ``--out``,
naming the run (a random id), the driver's host and process id, and when it was last renewed. The driver
renews it every `RENEW_S` while the run lives (`Lease.keep_renewed`) and removes it at the run's end. A
second run into the same ``--out`` finds it: a live holder is a one-line refusal that names it; a dead
one's lease is taken over. Rank 0 of the run's workers reads it before every write to ``--out`` (a
checkpoint, a `metrics.jsonl` row, ``final/``: `lost`), and the run stops, writing nothing more, once it
names another run or is gone: so Ray workers that outlive a killed driver (they trained ~8 more steps
before) stop at their next write once a rerun has taken ``--out`` over.

Why a lease and not Ray's job id checked before each write: the job id tells which run wrote last, not
whether the run that holds ``--out`` still lives; a second run on another Ray cluster (or after the
first one's cluster died) could not tell a live run from a dead one. A lease names the driver and its
last renewal, so a run can judge its holder: on the same host, alive while its process is (a killed
driver's lease is taken over at once, as the kill-and-rerun tests do); elsewhere, while renewed within
`STALE_S`.

Two runs that find no lease, or the same stale one, at once both write theirs (local disk: an exclusive
create, one wins; object stores without a conditional create: the later write stands); each reads it
back and the loser is refused. Local disk and object stores alike (`pipeline.storage`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pipeline import storage

LEASE = ".vitray-lease.json"
RENEW_S = 10.0  # how often the driver renews its lease
STALE_S = 60.0  # a lease of another host not renewed for this long is a dead run's


class LeaseHeldError(ValueError):
    """``--out`` is held by another live run; the message names it."""


def _holder(record: dict[str, Any]) -> str:
    age = time.time() - float(record.get("renewed", 0))
    return (
        f"run {record.get('run')} (pid {record.get('pid')} on {record.get('host')}, renewed {age:.0f} s ago)"
    )


def is_live(record: dict[str, Any], now: float | None = None) -> bool:
    """Whether the run a lease record names still lives: its driver's process, on this host; renewed
    within `STALE_S`, on another."""
    now = time.time() if now is None else now
    fresh = now - float(record.get("renewed", 0)) < STALE_S
    if record.get("host") != socket.gethostname():
        return fresh
    try:
        os.kill(int(record.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):  # another user's process, or no pid
        return fresh
    return fresh


def read(run_dir: storage.Location | str) -> dict[str, Any] | None:
    """The lease in ``run_dir``, or None (none there, or not a lease)."""
    try:
        record = json.loads(storage.read_text(storage.as_location(run_dir).join(LEASE)))
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclass
class Lease:
    """This run's lease on ``run_dir``."""

    run_dir: storage.Location
    run: str
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def record(self) -> dict[str, Any]:
        return {"run": self.run, "host": socket.gethostname(), "pid": os.getpid(), "renewed": time.time()}

    def renew(self) -> None:
        """Write the lease again, renewed now (only while it is still this run's)."""
        current = read(self.run_dir)
        if current is None or current.get("run") == self.run:
            storage.write_text(self.run_dir.join(LEASE), json.dumps(self.record()) + "\n")

    def keep_renewed(self) -> None:
        """Renew it every `RENEW_S` from a daemon thread until `release`."""

        def renew_until_released() -> None:
            while not self._stop.wait(RENEW_S):
                with contextlib.suppress(OSError):  # a store that fails once: the next renewal tries again
                    self.renew()

        self._thread = threading.Thread(target=renew_until_released, name="vitray-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lease, if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = read(self.run_dir)
        if current is not None and current.get("run") == self.run:
            storage.remove(self.run_dir.join(LEASE))


def check_free(run_dir: storage.Location | str) -> None:
    """`LeaseHeldError` (one line, naming the holder) while another live run holds ``run_dir``; writes
    nothing, so a run refused later, by the cluster's checks, leaves no trace in ``--out``."""
    current = read(run_dir)
    if current is not None and is_live(current):
        raise _held(storage.as_location(run_dir), current)


def acquire(run_dir: storage.Location | str) -> Lease:
    """This run's lease on ``run_dir``: a `LeaseHeldError` (one line, naming the holder) while another
    live run holds it; a dead run's is taken over."""
    run_dir = storage.as_location(run_dir)
    lease = Lease(run_dir, uuid.uuid4().hex[:12])
    where = run_dir.join(LEASE)
    current = read(run_dir)
    if current is not None and is_live(current):
        raise _held(run_dir, current)
    text = json.dumps(lease.record()) + "\n"
    if current is None:
        storage.create_text(where, text)  # of two runs that found none, one writes
    else:
        storage.write_text(where, text)  # a dead run's: taken over
    now = read(run_dir)
    if now is None or now.get("run") != lease.run:  # another run took it at the same time
        raise _held(run_dir, now or {})
    return lease


def _held(run_dir: storage.Location, record: dict[str, Any]) -> LeaseHeldError:
    return LeaseHeldError(
        f"--out {run_dir.url} is in use by a live training run, {_holder(record)}; wait for it to end or "
        "stop it, then run again (a stopped run's directory is taken over)"
    )


def lost(run_dir: storage.Location | str, run: str) -> str:
    """Why this run may no longer write to ``run_dir`` (its lease names another run, or is gone), or "".
    A read that fails (a store's fault) loses nothing: the next write checks again."""
    try:
        current = read(run_dir)
    except OSError:
        return ""
    if current is not None and current.get("run") == run:
        return ""
    whose = f"taken over by {_holder(current)}" if current else "released (its driver ended)"
    return (
        f"the lease on {storage.as_location(run_dir).url} was {whose}: this run stops and writes nothing "
        "more there"
    )


def agreed_lost(run: str | None, run_dir: storage.Location | str, rank: int, group: Any) -> str:
    """Collective: why this run may no longer write to ``run_dir`` ("" while it holds lease ``run``; rank 0
    reads it, `lost`), the same on every rank. Workers of a killed driver stop here once a rerun has
    taken ``--out`` over. A run started without a lease (``run`` None: a test's trainer) checks nothing."""
    from pipeline.train.state import agree_on_error

    if run is None:
        return ""
    return agree_on_error(lost(run_dir, run) if rank == 0 else "", group)[0]
