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

A lease file that does not read as one (empty, ``null``, a list, a field missing or of another type, a
directory) is no run's and no "no lease" either: a run is refused before Ray in one line that names the
file and says to remove it once no run uses ``--out`` (`LeaseUnreadableError`), and a run whose lease has
become such a file stops at its next write. A renewal time is judged by the clock of the host that
reads it: more than `STALE_S` ahead of it (a clock set wrong, a file written by hand) is not fresh, so a
lease dated days ahead blocks nothing for days.
"""

from __future__ import annotations

import contextlib
import json
import math
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


# A lease record's fields and the JSON types each must have (`read`).
FIELDS: dict[str, tuple[type, ...]] = {"run": (str,), "host": (str,), "pid": (int,), "renewed": (int, float)}


class LeaseHeldError(ValueError):
    """``--out`` is held by another live run; the message names it."""


class LeaseUnreadableError(ValueError):
    """``--out`` holds a lease file that does not read as a lease; the message names it and what to do.
    ``why``: what is wrong with it, in words."""

    def __init__(self, where: storage.Location, why: str):
        self.why = why
        super().__init__(
            f"{where.url} is not a training run's lease ({why}); if no training run is using this --out, "
            "remove that file and run again"
        )


def _holder(record: dict[str, Any]) -> str:
    age = time.time() - record["renewed"]
    when = f"renewed {age:.0f} s ago" if age > -1 else f"renewed {-age:.0f} s ahead of this host's clock"
    return f"run {record['run']} (pid {record['pid']} on {record['host']}, {when})"


def is_live(record: dict[str, Any], now: float | None = None) -> bool:
    """Whether the run a lease record (`read`) names still lives: its driver's process, on this host;
    renewed within `STALE_S` of this host's clock (either way: a renewal further ahead is a clock or a
    record that is wrong, not a live run's), on any."""
    now = time.time() if now is None else now
    fresh = abs(now - record["renewed"]) < STALE_S
    if record["host"] != socket.gethostname():
        return fresh
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):  # another user's process, or no such pid
        return fresh
    return fresh


def read(run_dir: storage.Location | str) -> dict[str, Any] | None:
    """The lease in ``run_dir``, or None where there is none. A file there that is no lease (`FIELDS`) is
    a `LeaseUnreadableError`; a store that fails raises its OSError."""
    where = storage.as_location(run_dir).join(LEASE)
    try:
        text = storage.read_text(where)
    except FileNotFoundError:
        return None
    except IsADirectoryError as e:
        raise LeaseUnreadableError(where, "a directory") from e
    except UnicodeDecodeError as e:
        raise LeaseUnreadableError(where, "not text") from e
    try:
        record = json.loads(text)
    except ValueError as e:
        raise LeaseUnreadableError(where, "empty" if not text.strip() else "not JSON") from e
    if not isinstance(record, dict):
        raise LeaseUnreadableError(where, f"JSON {json.dumps(record)[:40]}, not an object")
    for name, kinds in FIELDS.items():
        value = record.get(name)
        if not isinstance(value, kinds) or isinstance(value, bool):
            got = "missing" if name not in record else f"{json.dumps(value)[:40]}"
            raise LeaseUnreadableError(
                where, f"its {name} is {got}, not {' or '.join(k.__name__ for k in kinds)}"
            )
    if not math.isfinite(record["renewed"]):
        raise LeaseUnreadableError(where, f"its renewed is {record['renewed']}, not a time")
    if record["pid"] < 1:  # 0 and below name process groups, or every process, to os.kill
        raise LeaseUnreadableError(where, f"its pid is {record['pid']}, not a process id")
    return record


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
        """Write the lease again, renewed now (only while it is still this run's: a file there that does
        not read is left as it is, and the run's next write stops it, `lost`)."""
        try:
            current = read(self.run_dir)
        except LeaseUnreadableError:
            return
        if current is None or current["run"] == self.run:
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
        with contextlib.suppress(LeaseUnreadableError):  # no lease of this run's: nothing to remove
            current = read(self.run_dir)
            if current is not None and current["run"] == self.run:
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
    if now is None or now["run"] != lease.run:  # another run took it at the same time
        raise _held(run_dir, now)
    return lease


def _held(run_dir: storage.Location, record: dict[str, Any] | None) -> LeaseHeldError:
    if record is None:  # taken by a run that started at the same time, and already released
        return LeaseHeldError(
            f"--out {run_dir.url} was taken by another training run started at the same time; run again"
        )
    return LeaseHeldError(
        f"--out {run_dir.url} is in use by a live training run, {_holder(record)}; wait for it to end or "
        "stop it, then run again (a stopped run's directory is taken over)"
    )


def lost(run_dir: storage.Location | str, run: str) -> str:
    """Why this run may no longer write to ``run_dir`` (its lease names another run, or is gone), or "".
    A read that fails (a store's fault) loses nothing: the next write checks again."""
    where = storage.as_location(run_dir).url
    try:
        current = read(run_dir)
    except OSError:
        return ""
    except LeaseUnreadableError as e:
        return f"the lease on {where} does not read ({e.why}): this run stops and writes nothing more there"
    if current is not None and current["run"] == run:
        return ""
    whose = f"taken over by {_holder(current)}" if current else "released (its driver ended)"
    return f"the lease on {where} was {whose}: this run stops and writes nothing more there"


def agreed_lost(run: str | None, run_dir: storage.Location | str, rank: int, group: Any) -> str:
    """Collective: why this run may no longer write to ``run_dir`` ("" while it holds lease ``run``; rank 0
    reads it, `lost`), the same on every rank. Workers of a killed driver stop here once a rerun has
    taken ``--out`` over. A run started without a lease (``run`` None: a test's trainer) checks nothing."""
    from pipeline.train.state import agree_on_error

    if run is None:
        return ""
    return agree_on_error(lost(run_dir, run) if rank == 0 else "", group)[0]
