"""Where a run's time went (`pipeline.train.observe.goodput`): the worker loop in one process over the fake
stream of `tests.train.test_loop`, each run a session the test opens and closes as the driver does
(`close_session`). A run stopped and continued, then one that fails and resumes: every row's account adds
up to its wall clock, the second session's start-up is counted as such, the failure's steps and restart as
lost, and the attempts are drawn. The account's classification is checked on records made by hand too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipeline.storage import Location
from pipeline.train import loop
from pipeline.train.checkpointing import preemption
from pipeline.train.checkpointing.preemption import Preempted
from pipeline.train.observe.goodput import (
    BUCKETS,
    FIGURE_FILE,
    Account,
    Clock,
    Record,
    close_session,
    format_account,
    new_session,
)
from tests.train.test_loop import SHARDS, LocalSession, config, fake_micro_batches


@pytest.fixture
def fake_data(monkeypatch):
    from pipeline.train.input import dataplan

    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)


def session_run(cfg, device, *, fail: bool = False) -> tuple[dict, dict | None]:
    """One session of the run: its Trainer as the driver starts it, then closed as the driver closes it;
    (the summary, the session's account). ``fail``: the attempt raises (a preemption) and the session
    closes without a summary."""
    session = new_session()
    loop_config = {"train": cfg.to_dict(), "shards": SHARDS, "data_cpus_per_worker": 1.0, "session": session}
    summary = None
    try:
        summary = loop.Trainer(loop_config, LocalSession(device, Path(cfg.run.out))).train()
    except Preempted:
        assert fail
    return summary or {}, close_session(Location(cfg.run.out), session, summary, price=2.0)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_rows_account_adds_up_and_a_failure_shows_as_lost_steps_and_time(
    world, fake_data, monkeypatch, tmp_path
):
    out = tmp_path / "run"
    cfg = config(out, log_every=1, checkpoint_every=2, price_per_device_hour=2.0)
    started = time.time()
    _, first = session_run(cfg.replace(stop_at_step=3), world)  # a clean stop
    assert first is not None and first["startup_s"] > 0 and first["lost_s"] == 0 and first["attempts"] == 1
    time.sleep(1.0)  # between the sessions: no part of the run's wall clock
    monkeypatch.setenv(preemption.TEST_HOOK, "7")  # the next session's attempt stops at step 7 ...
    monkeypatch.setattr(preemption, "TEST_HOOK_DEADLINE_S", 0.0)  # ... with no checkpoint of it
    _, failed = session_run(cfg, world, fail=True)
    assert failed is None  # no summary: its account is the next attempt's to make
    monkeypatch.delenv(preemption.TEST_HOOK)
    _, last = session_run(cfg, world)
    ended = time.time()

    record = json.loads((out / "goodput.json").read_text())
    assert [a["kind"] for a in record["attempts"]] == ["startup", "startup", "lost"]
    assert [a["resumed_step"] for a in record["attempts"]] == [None, 3, 6]  # checkpoints 2, 4, 6 ... and 3
    # The second session continued a clean stop at its checkpoint: its own start-up, the gap left out.
    assert record["attempts"][1]["from"] == pytest.approx(record["sessions"][0]["ended"])
    # The third resumed from checkpoint 6 after the second stepped to 7: one step trained again.
    assert record["attempts"][2]["lost_steps"] == 1 and last["lost_steps"] == 1
    assert last["lost_s"] > 0 and last["lost_cost"] == pytest.approx(2.0 * last["lost_device_s"] / 3600)
    gap = record["sessions"][1]["started"] - record["sessions"][0]["ended"]
    assert gap >= 1.0 and last["wall_s"] == pytest.approx(ended - started - gap, abs=0.5)

    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, 9))
    for r in logged:  # each bucket's seconds add up to the wall clock, none below zero
        g = r["goodput"]
        assert sum(g[f"{b}_s"] for b in BUCKETS) == pytest.approx(g["wall_s"], abs=1e-6), r["step"]
        assert sum(g[f"{b}_share"] for b in BUCKETS) == pytest.approx(1.0)
        assert min(g[f"{b}_s"] for b in BUCKETS) > -1e-6, g
    walls = [r["goodput"]["wall_s"] for r in logged]
    assert walls == sorted(walls) and logged[-1]["time"] <= ended
    assert logged[6]["goodput"]["lost_steps"] == 1 and logged[5]["goodput"]["lost_steps"] == 0
    assert last["checkpoint_s"] > 0 and last["productive_s"] > 0 and last["startup_s"] > first["startup_s"]
    assert (out / FIGURE_FILE).stat().st_size > 10_000 and last["figure"] == FIGURE_FILE
    line = format_account(last)
    assert line.startswith("where the time went (0:00:") and "3 attempt(s)): productive " in line
    assert "(1 step(s) trained again); lost " in line


def spent(account: Account) -> dict[str, float]:
    return {bucket: s for bucket, s in account.seconds.items() if s}


def record(**sessions) -> Record:
    return Record(origin=100.0, sessions=list(sessions.values()))


def clock(rec: Record, tmp_path: Path, session: dict, step: int | None, row: dict | None) -> Clock:
    rec.write(Location(str(tmp_path)))
    return Clock(Location(str(tmp_path)), session, started=0.0, workers=4, resumed_step=step, resumed_row=row)


def test_the_start_of_an_attempt_is_start_up_or_lost_by_what_came_before(tmp_path):
    row = {"time": 160.0, "goodput": {"productive_s": 50.0, "startup_s": 10.0, "attempt": 0}}
    first = {"session": "a", "started": 101.0, "first_step_at": 110.0, "resumed_step": None, "step": 70}
    # The same session, after a failure: from the checkpoint's row (step 60) on, all lost; 10 steps again.
    rec = record(a={"id": "a", "started": 100.0})
    rec.attempts.append(first)
    prior, since, kind, again = clock(rec, tmp_path, {"id": "a", "started": 100.0}, 60, row).start_of_attempt(
        200
    )
    assert (spent(prior), since, kind, again) == ({"productive": 50.0, "startup": 10.0}, 160.0, "lost", 10)
    # A new session after one that ended cleanly at that checkpoint: its start-up; the gap is no time of it.
    done = {"id": "a", "started": 100.0, "ended": 170.0, "clean": True, "step": 60,
            "account": Account({"productive": 50.0, "startup": 10.0, "checkpoint": 10.0}).row(70.0)}  # fmt: skip
    rec = record(a=done, b={"id": "b", "started": 500.0})
    rec.attempts.append(first)
    c = clock(rec, tmp_path, {"id": "b", "started": 500.0}, 60, row)
    prior, since, kind, again = c.start_of_attempt(520.0)
    assert (prior.seconds["checkpoint"], since, kind, again) == (10.0, 170.0, "startup", 0)
    assert rec.wall(520.0) == 520.0 - 100.0 - 330.0
    c.first_step()
    assert c.prior.seconds["startup"] == pytest.approx(10.0 + (c.first - 500.0))
    # The same after a session that failed: its steps after the checkpoint and its restart, lost; the gap
    # after its end still left out.
    rec = record(a={**done, "clean": False, "step": 70}, b={"id": "b", "started": 500.0})
    rec.attempts.append(first)
    prior, since, kind, again = clock(rec, tmp_path, {"id": "b", "started": 500.0}, 60, row).start_of_attempt(
        520
    )
    assert (since, kind, again) == (160.0, "lost", 10)
    # The run's first attempt, and a restart with no checkpoint: start-up, then all after it lost.
    rec = record(a={"id": "a", "started": 100.0})
    assert (
        clock(rec, tmp_path, {"id": "a", "started": 100.0}, None, None).start_of_attempt(120)[2] == "startup"
    )
    rec.attempts.append({**first, "step": 5})
    prior, since, kind, again = clock(
        rec, tmp_path, {"id": "a", "started": 100.0}, None, None
    ).start_of_attempt(150)
    assert (spent(prior), since, kind, again) == ({"startup": 10.0}, 110.0, "lost", 5)


def test_an_account_is_each_bucket_and_its_share_idle_what_is_left():
    account = Account({"productive": 60.0, "lost": 20.0}, lost_steps=3)
    account.add("lost", 10.0, workers=8)
    row = account.row(100.0, price=3.6)
    assert (row["productive_share"], row["lost_s"], row["idle_s"], row["idle_share"]) == (
        0.6,
        30.0,
        10.0,
        0.1,
    )
    assert row["lost_device_s"] == 80.0 and row["lost_cost"] == pytest.approx(0.08)
    assert Account.from_row(row).row(100.0) == {k: v for k, v in row.items() if k != "lost_cost"}


def test_the_waits_kept_are_those_after_the_last_row_and_other_ranks_keep_none(tmp_path):
    """A step's data wait is counted every step: rank 0 keeps only the waits no row has summed yet, and
    a rank without the run's record (every other rank) none, however long the run."""
    c = clock(record(a={"id": "a", "started": 100.0}), tmp_path, {"id": "a", "started": 100.0}, None, None)
    c.first_step()
    now = time.perf_counter()
    for i in range(1000):
        c.spent("data_wait", now + i, now + i + 0.5)
    account = c.account(now + 600)  # a row's window ending after the first 600 waits
    assert account.seconds["data_wait"] == pytest.approx(300.0)
    assert account.seconds["productive"] == pytest.approx(now + 600 + c.offset - c.first - 300.0)
    assert len(c.waits) == 400
    assert c.account(now + 2000).seconds["data_wait"] == pytest.approx(500.0) and not c.waits
    other = Clock(
        None, {"id": "a", "started": 100.0}, started=0.0, workers=4, resumed_step=None, resumed_row=None
    )
    other.first_step()
    for i in range(1000):
        other.spent("data_wait", now + i, now + i + 0.5)
    assert not other.waits
