"""Where a run's wall-clock time went, over every attempt of it: goodput and its badput, each bucket in
seconds and as a share of the run.

A run is sessions (one per `jobs/pretrain.py` command: the driver's time, from the job's start to its end)
and attempts (Ray Train's worker groups, restarted after a failure, a preemption, a resize). Its wall clock
runs from its first session's start to now, less the gaps between a session that ended (its driver said
so) and the next one: a run submitted again a day later has not spent the day. The time falls into:

- ``startup``: from a session's start (Ray, the workers, the model, the data pipeline, compilation) to its
  first step's end, where it starts afresh or continues a run that ended cleanly at its last checkpoint;
- ``lost``: work lost to failures: the steps trained again after a resume (from the time of the checkpoint
  resumed from to the failure) and the time from the failure to the resumed attempt's first step's end,
  gaps after a session that ended left out; ``lost_steps`` counts the steps trained again;
- ``data_wait``, ``checkpoint`` (a save's stall, the last save and the export), ``evaluation`` (and probes):
  the training thread of rank 0 waiting on each, after the attempt's first step;
- ``productive``: the rest of the attempts' time after their first step: the steps;
- ``idle``: what is left (a session's end after its last attempt, and whatever no attempt covered).

Rank 0's `Clock` keeps the account of its attempt: the intervals its training thread spent waiting, taken at
the loop's seams (`spent`: a new source of time, such as a probe, is one more call with its bucket), and
the attempt's start classified at its first step (`Clock.first_step`) from the record of the run's
sessions and attempts, ``<out>/goodput.json``, and the row of the checkpoint it resumed from. Every
`metrics.jsonl` row carries the run's account as of its window's end (``goodput``, and its wall-clock
``time``), so TensorBoard and W&B plot it (``train/goodput/<bucket>_share``), and a resumed run continues
from the row of its checkpoint: what came after that row was lost, whatever it was. The driver closes a
session (`close_session`): the account at its end goes into the record and the run's summary, and the
attempts are drawn on one time axis (`plot_attempts`, ``goodput.png``). With ``--price-per-device-hour``,
the lost time in money: its seconds times the attempt's workers.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline import storage

GOODPUT_FILE = "goodput.json"
FIGURE_FILE = "goodput.png"
# The buckets, in the order a summary names them; idle is what is left of the wall clock.
BUCKETS = ("productive", "data_wait", "checkpoint", "evaluation", "startup", "lost", "idle")
NAMES = {
    "productive": "productive",
    "data_wait": "data wait",
    "checkpoint": "checkpoints",
    "evaluation": "evaluation",
    "startup": "start-up",
    "lost": "lost to failures",
    "idle": "idle",
}
WAITS = ("data_wait", "checkpoint", "evaluation")  # what `Clock.spent` takes


@dataclass
class Account:
    """Seconds per bucket but idle, the steps trained again, and the lost seconds times the workers."""

    seconds: dict[str, float] = field(default_factory=dict)
    lost_steps: int = 0
    lost_device_s: float = 0.0

    def add(self, bucket: str, seconds: float, workers: int = 0) -> None:
        self.seconds[bucket] = self.seconds.get(bucket, 0.0) + seconds
        if bucket == "lost":
            self.lost_device_s += seconds * workers

    def copy(self) -> Account:
        return Account(dict(self.seconds), self.lost_steps, self.lost_device_s)

    def row(self, wall: float, price: float | None = None) -> dict[str, Any]:
        """A `metrics.jsonl` row's ``goodput``: each bucket's seconds and share of ``wall`` (idle: what is
        left of it), the steps trained again, and with ``price`` the lost time's cost."""
        seconds = {b: self.seconds.get(b, 0.0) for b in BUCKETS if b != "idle"}
        seconds["idle"] = wall - sum(seconds.values())
        out: dict[str, Any] = {"wall_s": wall}
        for bucket in BUCKETS:
            out[f"{bucket}_s"] = seconds[bucket]
            out[f"{bucket}_share"] = seconds[bucket] / wall if wall > 0 else 0.0
        out["lost_steps"] = self.lost_steps
        out["lost_device_s"] = self.lost_device_s
        if price is not None:
            out["lost_cost"] = price * self.lost_device_s / 3600
        return out

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Account:
        """The account a row's ``goodput`` holds (idle, being what is left, comes back with the wall)."""
        seconds = {b: float(row.get(f"{b}_s", 0.0)) for b in BUCKETS if b != "idle"}
        return cls(seconds, int(row.get("lost_steps", 0)), float(row.get("lost_device_s", 0.0)))


@dataclass
class Record:
    """``<out>/goodput.json``: the run's origin, its sessions and its attempts (module docstring). A
    session: ``id``, ``started``, and once its driver closed it ``ended``, ``clean`` (no error), ``step``
    (the last step it trained to) and its final ``account``. An attempt (one that reached its first step):
    its ``session``, ``started`` (the worker loop's start), ``first_step_at``, ``resumed_step``, ``workers``,
    ``from`` (where its start is counted from), ``kind`` (startup or lost), and, as it goes, ``step`` and
    ``seen`` (its last logged step and when)."""

    origin: float
    sessions: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, run_dir: storage.Location, origin: float) -> Record:
        """The run's record, or a new one beginning at ``origin``."""
        where = run_dir.join(GOODPUT_FILE)
        if not storage.exists(where):
            return cls(origin)
        values = json.loads(storage.read_text(where))
        return cls(float(values["origin"]), list(values["sessions"]), list(values["attempts"]))

    def write(self, run_dir: storage.Location) -> None:
        text = json.dumps(
            {"origin": self.origin, "sessions": self.sessions, "attempts": self.attempts}, indent=1
        )
        storage.write_text(run_dir.join(GOODPUT_FILE), text + "\n")

    def session(self, session_id: str, started: float) -> dict[str, Any]:
        """The session ``session_id``, added (started at ``started``) if the record lacks it."""
        for one in self.sessions:
            if one["id"] == session_id:
                return one
        self.sessions.append({"id": session_id, "started": started})
        return self.sessions[-1]

    def gaps(self) -> Iterator[tuple[float, float]]:
        """The stretches no session covered after one that ended: left out of the wall clock."""
        ordered = sorted(self.sessions, key=lambda s: s["started"])
        for before, after in itertools.pairwise(ordered):
            if before.get("ended") is not None and after["started"] > before["ended"]:
                yield before["ended"], after["started"]

    def left_out(self, start: float, end: float) -> float:
        """Seconds of the gaps between ``start`` and ``end``."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.gaps())

    def wall(self, at: float) -> float:
        """The run's wall clock at time ``at``: from its origin, the gaps left out."""
        return at - self.origin - self.left_out(self.origin, at)


def new_session(started: float | None = None) -> dict[str, Any]:
    """A driver's session for the workers' ``loop_config``: its id and when the job started."""
    return {"id": uuid.uuid4().hex[:12], "started": time.time() if started is None else started}


class Clock:
    """Rank 0's account of its attempt, and of the run up to it (module docstring). Times are the
    training thread's `time.perf_counter`; the record's and the rows' are wall-clock (`time.time`)."""

    def __init__(
        self,
        run_dir: storage.Location | None,
        session: dict[str, Any],
        *,
        started: float,
        workers: int,
        resumed_step: int | None,
        resumed_row: dict[str, Any] | None,
        price: float | None = None,
    ):
        self.offset = time.time() - time.perf_counter()  # wall-clock time = perf_counter + offset
        self.run_dir, self.session, self.workers, self.price = run_dir, session, workers, price
        self.resumed_step, self.resumed_row = resumed_step, resumed_row
        self.started = started
        self.record = Record.read(run_dir, session["started"]) if run_dir is not None else None
        self.first: float | None = None  # the first step's end (wall-clock), once it is done
        self.prior = Account()  # the run's account at the first step's end
        # The waits since the first step, rank 0's: those ended by the latest time accounted, summed per
        # bucket; the later ones (end, bucket, seconds), in the order they ended. Bounded by a log line's
        # steps, however long the run.
        self.waited = Account()
        self.waits: collections.deque[tuple[float, str, float]] = collections.deque()
        self.attempt: dict[str, Any] | None = None
        self.index = -1  # the attempt's place in the record
        self.begun = 0  # the latest step begun (its forward and backward queued)

    def began(self, step: int) -> None:
        """Step ``step``'s forward and backward are queued: a failure from here trains it again."""
        self.begun = step

    def spent(self, bucket: str, start: float, end: float) -> None:
        """The training thread waited from ``start`` to ``end`` (`time.perf_counter`) on ``bucket`` (one of
        `WAITS`); before the attempt's first step it is start-up time, counted there. Other ranks keep no
        account."""
        if self.record is not None and self.first is not None and end + self.offset > self.first:
            self.waits.append((end + self.offset, bucket, end - start))

    def first_step(self) -> None:
        """The attempt's first step is done: the time before it classified (start-up or lost) and the
        attempt added to the record."""
        self.first = now = time.time()
        if self.record is None:
            return
        record, session = self.record, self.session
        record.session(session["id"], session["started"])
        prior, since, kind, lost_steps = self.start_of_attempt(now)
        self.prior = prior.copy()
        self.prior.add(kind, now - since - record.left_out(since, now), self.workers)
        self.prior.lost_steps += lost_steps
        self.attempt = {
            "session": session["id"], "started": self.started, "first_step_at": now,
            "resumed_step": self.resumed_step, "workers": self.workers, "from": since, "kind": kind,
            "lost_steps": lost_steps, "step": self.resumed_step or 0, "seen": now,
        }  # fmt: skip
        record.attempts.append(self.attempt)
        self.index = len(record.attempts) - 1

    def start_of_attempt(self, now: float) -> tuple[Account, float, str, int]:
        """(The run's account before this attempt, the time it stands at, the bucket of the time from
        there to this attempt's first step, the steps trained again)."""
        record, session, step = self.record, self.session, self.resumed_step
        assert record is not None
        ours = [a for a in record.attempts if a["session"] == session["id"]]
        kept = (self.resumed_row or {}).get("goodput")
        if step and kept is not None and "time" in (self.resumed_row or {}):
            before = [
                s for s in record.sessions if s["id"] != session["id"] and s["started"] < session["started"]
            ]
            last = max(before, key=lambda s: s["started"], default=None)
            if not ours and last and last.get("clean") and last.get("step") == step and last.get("account"):
                # A run that ended cleanly at this checkpoint, continued: a session's start-up.
                return Account.from_row(last["account"]), float(last["ended"]), "startup", 0
            writer = int(kept.get("attempt", -1))
            begun = record.attempts[writer]["started"] if 0 <= writer < len(record.attempts) else 0.0
            again = sum(
                max(0, a.get("step", 0) - max(step, a.get("resumed_step") or 0))
                for a in record.attempts
                if a["started"] >= begun
            )
            return Account.from_row(kept), float(self.resumed_row["time"]), "lost", again
        if not record.attempts:  # the run's first attempt to step (or the first the record knows)
            return Account(), record.origin, "startup", 0
        # Restarted with no checkpoint row to continue from: all after the first attempt's first step lost.
        first = record.attempts[0]
        prior = Account()
        prior.add(
            "startup",
            first["first_step_at"] - record.origin - record.left_out(record.origin, first["first_step_at"]),
        )
        again = sum(max(0, a.get("step", 0) - (a.get("resumed_step") or 0)) for a in record.attempts)
        return prior, float(first["first_step_at"]), "lost", again

    def account(self, at: float) -> Account:
        """The run's account at ``at`` (`time.perf_counter`): what came before this attempt's first step,
        the waits since that had ended by then, and the steps the rest (`productive`). Called at times that
        only grow (each row's window ends after the last one's)."""
        at += self.offset
        account = self.prior.copy()
        if self.first is None or at <= self.first:
            return account
        while self.waits and self.waits[0][0] <= at:
            _, bucket, seconds = self.waits.popleft()
            self.waited.add(bucket, seconds)
        for bucket, seconds in self.waited.seconds.items():
            account.add(bucket, seconds)
        account.add("productive", at - self.first - sum(self.waited.seconds.values()))
        return account

    def row(self, step: int, at: float) -> dict[str, Any]:
        """What a `metrics.jsonl` row of ``step``, its window ending at ``at`` (`time.perf_counter`), adds:
        its wall-clock ``time`` and the run's ``goodput`` then."""
        when = at + self.offset
        if self.record is None or self.attempt is None:
            return {"time": when}
        self.attempt.update(step=max(step, self.begun), seen=when)
        goodput = self.account(at).row(self.record.wall(when), self.price)
        return {"time": when, "goodput": {**goodput, "attempt": self.index}}

    def store(self) -> None:
        """Rank 0: the record into ``<out>/goodput.json`` (where the metrics are stored, at their cadence)."""
        if self.record is not None and self.run_dir is not None:
            self.record.write(self.run_dir)

    def at_end(self, store: bool = True) -> dict[str, Any]:
        """The run's account now (the attempt's end: its last save and export counted), for the summary;
        the record stored with it unless not ``store``."""
        if self.record is None or self.attempt is None:
            return {}
        at = time.perf_counter()
        self.attempt.update(seen=at + self.offset)
        if store:
            self.store()
        return {
            **self.account(at).row(self.record.wall(at + self.offset), self.price),
            "time": at + self.offset,
        }


def close_session(
    run_dir: storage.Location,
    session: dict[str, Any],
    summary: dict[str, Any] | None,
    *,
    price: float | None = None,
    figure: bool = True,
) -> dict[str, Any] | None:
    """The driver, once its run has returned (``summary``: the workers', None where it failed): the session
    ended now, its account (the attempt's at its end, the rest of the session idle) into the record, and the
    attempts drawn into ``goodput.png`` (where matplotlib is installed). Returns the account (a row's form,
    plus ``attempts``), or None when no attempt of the run reached a first step."""
    ended = time.time()
    record = Record.read(run_dir, session["started"])
    mine = record.session(session["id"], session["started"])
    clean = summary is not None and not summary.get("error")
    last = (summary or {}).get("goodput") or {}
    step = ((summary or {}).get("metrics") or {}).get("step") or (
        (summary or {}).get("resumed_from") or {}
    ).get("step")
    mine.update(ended=ended, clean=clean, step=step)
    account = None
    if last:
        account = Account.from_row(last).row(record.wall(ended), price)
        account["attempts"] = len(record.attempts)
        mine["account"] = account
    if figure and account is not None:
        drawn = write_figure(run_dir, record, account)
        # The drawing is the session's time too (idle: no attempt runs): the account closes after it, the
        # figure's shares less than its seconds apart from these.
        ended = time.time()
        mine["ended"] = ended
        account = {**Account.from_row(last).row(record.wall(ended), price), "attempts": account["attempts"]}
        account["figure"] = drawn
        mine["account"] = account
    record.write(run_dir)
    return account


def format_account(account: dict[str, Any]) -> str:
    """``where the time went (0:12:34, 3 attempts): productive 71.2%, ...``: the summary's line."""
    parts = ", ".join(f"{NAMES[b]} {100 * account[f'{b}_share']:.1f}%" for b in BUCKETS)
    lost = f"{account['lost_steps']} step(s) trained again"
    money = (
        f"; lost {account['lost_cost']:,.2f} at the price given"
        if account.get("lost_cost") is not None
        else ""
    )
    head = f"where the time went ({_hms(account['wall_s'])}, {account.get('attempts', 1)} attempt(s))"
    drawn = f"; drawn in {account['figure']}" if account.get("figure") else ""
    return f"{head}: {parts} ({lost}){money}{drawn}"


def _hms(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


COLOURS = {
    "productive": "#4c9a2a", "data_wait": "#e0a526", "checkpoint": "#3b75af", "evaluation": "#8e6bb8",
    "startup": "#9a9a9a", "lost": "#c8443a", "idle": "#dddddd",
}  # fmt: skip


def write_figure(run_dir: storage.Location, record: Record, account: dict[str, Any]) -> str | None:
    """``goodput.png`` under the run directory (`plot_attempts`), where matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    from pipeline.train.observe.metrics import METRICS_FILE

    where = run_dir.join(METRICS_FILE)
    text = storage.read_text(where) if storage.exists(where) else ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    with storage.staged_file(run_dir.join(FIGURE_FILE)) as path:
        plot_attempts(record, rows, account, path)
    return FIGURE_FILE


def plot_attempts(record: Record, rows: list[dict[str, Any]], account: dict[str, Any], path: str) -> str:
    """The attempts on one time axis (the run's wall clock, gaps between sessions left out), one lane each:
    its start (start-up grey; red after a failure: the restart), its steps (green) up to where a later
    attempt resumed from (hatched red after it: trained again), its checkpoints as ticks; below, the
    account's shares."""
    from matplotlib.figure import Figure

    wall = account["wall_s"]
    unit, per = (
        ("seconds", 1.0) if wall < 180 else ("minutes", 60.0) if wall < 3 * 3600 else ("hours", 3600.0)
    )

    def x(t: float) -> float:
        return record.wall(t) / per

    attempts = record.attempts
    fig = Figure(figsize=(9, 2.4 + 0.45 * len(attempts)), dpi=120)
    lanes, shares = fig.subplots(2, 1, gridspec_kw={"height_ratios": [max(len(attempts), 2), 1]})
    for i, a in enumerate(attempts):
        y = len(attempts) - 1 - i
        seen = a.get("seen", a["first_step_at"])
        cut = next(
            (
                b["from"]
                for b in attempts[i + 1 :]
                if b["kind"] == "lost" and a["first_step_at"] <= b["from"] < seen
            ),
            seen,
        )
        # A restart's lost time begins where the attempt before ended (before that, that one's lane shows it).
        begin = (
            max(a["from"], attempts[i - 1].get("seen", a["from"])) if i and a["kind"] == "lost" else a["from"]
        )
        bars = [(begin, a["first_step_at"], a["kind"], None), (a["first_step_at"], cut, "productive", None)]
        bars.append((cut, seen, "lost", "//"))
        for start, end, bucket, hatch in bars:
            if end > start:
                lanes.barh(
                    y, x(end) - x(start), left=x(start), color=COLOURS[bucket], height=0.6, hatch=hatch
                )
        saved = [
            r["time"]
            for r in rows
            if r.get("checkpoint_stall_s") is not None and (r.get("goodput") or {}).get("attempt") == i
        ]
        lanes.plot([x(t) for t in saved], [y] * len(saved), "|", color="black", markersize=12)
    lanes.set_yticks(range(len(attempts)))
    labels = [
        f"attempt {i + 1} ({a['workers']} worker{'s' if a['workers'] != 1 else ''})"
        for i, a in enumerate(attempts)
    ]
    lanes.set_yticklabels(labels[::-1], fontsize=8)
    lanes.set_xlabel(
        f"{unit} of the run's wall clock; ticks: checkpoints; hatched: steps trained again", fontsize=8
    )
    lanes.set_xlim(0, wall / per * 1.01)
    left = 0.0
    for bucket in BUCKETS:
        share = account[f"{bucket}_share"]
        label = f"{NAMES[bucket]} {100 * share:.1f}%"
        shares.barh(0, share, left=left, color=COLOURS[bucket], label=label)
        left += share
    shares.set_xlim(0, 1)
    shares.set_yticks([])
    shares.set_title("share of the wall clock", fontsize=8)
    shares.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.suptitle(
        f"Where the run's time went: {_hms(wall)} over {len(attempts)} attempt(s), "
        f"{account['lost_steps']} step(s) trained again",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
