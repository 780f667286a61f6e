"""A hang, diagnosed (`pipeline.train.observe.watchdog`): the worker loop on 2 ranks as processes (gloo,
no Ray), over the stand-in stream of `tests.train.test_elastic`, with ``--hang-timeout`` of a few seconds.

One run hangs twice: in its first attempt worker 1's shard read never returns (its stream blocks at
step 5's input, so worker 0 waits at the steps' agreement); resumed from checkpoint 3, worker 1 enters at
step 8 a collective that worker 0 never enters (worker 0 waits in the step's forward and backward). Each
time every worker's stacks go to one file under ``--out``, one line names worker 1 and where it stands, and
both processes end (exit code `HANG_EXIT`); resumed again from checkpoint 6, the run ends with the weights
of the same run straight, its audit passes, and its account of time shows the hangs as lost. The bound's
default and the line's wording are checked without processes.

Arithmetic (`tests.train.test_elastic`): 56 good samples an epoch, batch 24 over 2 workers of 6
micro-batches a step: 3 steps an epoch, 9 steps; a checkpoint every 3, each at an epoch's end (saved there
at once: a checkpoint inside an epoch is saved at the next step's boundary, which a hang never reaches).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline import dcp
from pipeline.train.observe import watchdog
from pipeline.train.observe.watchdog import FACTOR, FLOOR_S, HANG_EXIT, default_bound, hang_line
from tests.distributed import spawn

BOUND = 4.0  # seconds: far above a step of the stand-in run, even on a loaded machine


def _runs(rank: int, root: str, runs: list[tuple[str, dict, tuple]]) -> None:
    """Each of ``runs`` (directory, config changes, what blocks worker 1) in turn on 2 ranks. What blocks:
    () nothing; ("read", epoch, n): its stream before the n-th micro-batch of that epoch, for ever;
    ("collective", step): a receive from worker 0, which never sends, as the step's input is taken."""
    from pipeline.train import loop
    from pipeline.train.input import dataplan
    from tests.train.test_elastic import SIZES, config, indexed_micro_batches
    from tests.train.test_loop import LocalSession

    for name, changes, block in runs:

        def stream(*args, epoch, rank, block=block, **kwargs):
            for n, micro_batch in enumerate(indexed_micro_batches(*args, epoch=epoch, rank=rank, **kwargs)):
                if rank == 1 and block[:2] == ("read", epoch) and n == block[2]:
                    threading.Event().wait()  # a shard read that never returns
                yield micro_batch

        class Collective(loop.StepWatch):
            def taken(self, step, block=block):
                if rank == 1 and block == ("collective", step.step):
                    dist.recv(torch.zeros(1), src=0)  # worker 0 never sends

        dataplan.micro_batches = stream
        cfg = config(Path(root) / name, 2, checkpoint_every=3, **changes)
        session = LocalSession(torch.device("cpu"), Path(cfg.run.out), rank, 2)
        loop_config = {"train": cfg.to_dict(), "shards": list(SIZES), "data_cpus_per_worker": 1.0}
        assert loop.Trainer(loop_config, session, Collective()).train()["error"] == ""
        dist.barrier()  # every rank's checkpoint files are in place before a resume reads them


def hung(attempt, *args) -> None:
    """Run ``attempt``, which must end in a hang: a worker's process exits with `HANG_EXIT` (the first one
    that ends is reported; the others end with it)."""
    with pytest.raises(Exception, match=f"exit code {HANG_EXIT}"):
        attempt(*args)


def test_a_hung_worker_is_named_its_stacks_written_and_the_resumed_run_ends_as_a_straight_one(
    tmp_path, capfd
):
    from tests.train.test_audit import audited, sized
    from tests.train.test_elastic import SIZES

    quick = {"hang_timeout": BOUND}
    read, collective = ("read", 1, 6), ("collective", 8)  # step 5's input (6 micro-batches a step); step 8
    hung(spawn, _runs, str(tmp_path), [("straight", {}, ()), ("run", quick, read)])
    first = capfd.readouterr().out
    hung(spawn, _runs, str(tmp_path), [("run", quick, collective)])
    second = capfd.readouterr().out
    spawn(_runs, str(tmp_path), [("run", {}, ())])
    third = capfd.readouterr().out

    lines = [re.search(r"^hang: .*$", out, re.M) for out in (first, second)]
    assert all(lines) and "hang: " not in third, (first[-3000:], second[-3000:])
    read_line, collective_line = (m[0] for m in lines)
    assert re.search(
        rf"no worker finished a step in \d+ s \(bound 4 s: --hang-timeout 4\): worker 1 at step 5, input for "
        r"\d+ s \(.*\) did not arrive where worker\(s\) 0 wait: step 5, agreement; every worker's stacks in "
        rf"{tmp_path}/run/hangs/step_00000005_\S+\.txt; the attempt fails",
        read_line,
    ), read_line
    assert re.search(
        r"worker 1 at step 8, agreement for \d+ s \(.*\) did not arrive where worker\(s\) 0 wait: step 8, "
        r"forward/backward",
        collective_line,
    ), collective_line
    files = sorted((tmp_path / "run" / "hangs").iterdir())
    assert [f.name[:13] for f in files] == ["step_00000005", "step_00000008"]
    for f, stuck in zip(
        files, ("threading.py", "recv"), strict=True
    ):  # where worker 1's training thread waits
        text = f.read_text()
        workers = re.split(r"^=== ", text, flags=re.M)[1:]
        assert [w.split(" ", 2)[1] for w in workers] == ["0", "1"]
        assert all(" (training)\n" in w for w in workers)  # every thread, the training one named
        assert stuck in workers[1].split(" (training)\n", 1)[1].split("\n--- ", 1)[0], workers[1][:3000]
        assert "vitray-watchdog" in workers[0]

    # Resumed from checkpoint 6, the run ends as the straight one, bit for bit.
    assert "resumed from" in third and "at step 6" in third
    straight, resumed = (
        dcp.load_model_state(str(tmp_path / name / dcp.checkpoint_name(9)), _model_config())
        for name in ("straight", "run")
    )
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    report = audited(tmp_path / "run", list(SIZES), sized(SIZES))
    assert report.ok and report.finished == 2, report.format()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert rows[-1]["goodput"]["lost_s"] > 2 * BOUND  # both hangs, and the restarts after them


def _model_config():
    from pipeline.train.step.model import model_config
    from tests.train.test_elastic import config

    return model_config(config(Path("unused"), 2))


def test_the_bound_is_the_setting_or_a_multiple_of_the_median_step_never_under_the_floor():
    assert default_bound([], None) == (FLOOR_S, f"at least {FLOOR_S:g} s until steps are timed")
    assert default_bound([0.5] * 10, None)[0] == FLOOR_S  # 20 x 0.5 s is under the floor
    slow = [100.0, 40.0, 40.0]  # a step of 40 s (the odd one does not move the median)
    assert default_bound(slow, None) == (
        FACTOR * 40.0,
        f"{FACTOR} x the median step of 40.00 s, at least 600 s",
    )
    assert default_bound(slow, 5.0) == (5.0, "--hang-timeout 5")
    # An attempt's first step (compilation) is given the floor whatever the setting.
    assert default_bound([], 5.0, stepped=False) == (
        FLOOR_S,
        f"--hang-timeout 5, at least {FLOOR_S:g} s for an attempt's first step",
    )
    assert (
        default_bound([], 900.0, stepped=False)[0] == 900.0 and default_bound([], 0.0, stepped=False)[0] > 1e9
    )
    assert default_bound(slow, 0.0)[0] == float("inf")


def test_a_watchdog_fires_only_once_no_step_finished_within_the_bound(tmp_path, monkeypatch):
    """In-process, with a store of its own: steps finishing keep it quiet, a pause is not counted, and
    once the steps stop it writes this rank's stacks and calls its ``fail``."""
    monkeypatch.setattr(watchdog, "FLOOR_S", 0.3)
    failed = threading.Event()
    store = dist.HashStore()
    dog = watchdog.Watchdog(0, 1, _location(tmp_path), None, store=store, fail=failed.set, gather_s=1)
    try:
        for step in range(1, 12):  # 11 steps of 0.05 s: the median's 20 x is 1 s
            dog.at("forward/backward", step)
            threading.Event().wait(0.05)
            dog.finished(step)
        bound = dog.bound()[0]
        assert bound == pytest.approx(FACTOR * 0.05, rel=0.5), bound
        with dog.paused():
            threading.Event().wait(bound + 0.5)  # over the bound, but paused
        assert not failed.is_set()
        dog.at("input", 12)
        assert failed.wait(10) and dog.fired
    finally:
        dog.close()
    (written,) = (tmp_path / "run" / "hangs").iterdir()
    assert written.read_text().startswith("=== worker 0 (pid ")


def _location(tmp_path: Path):
    from pipeline.storage import Location

    return Location(str(tmp_path / "run"))


def test_the_line_names_the_workers_behind_or_says_every_one_is_at_the_same_seam():
    def report(rank, step, seam):
        return {"rank": rank, "step": step, "seam": seam, "for_s": 30.0, "frames": ["a.py:f", "b.py:g"]}

    behind = hang_line(
        [report(0, 5, "agreement"), report(1, 5, "input"), report(2, 5, "agreement")], 4, 31, 30, "x", "F", 3
    )
    assert (
        "worker 1 at step 5, input for 30 s (a.py:f < b.py:g) did not arrive where worker(s) 0, 2 wait: step 5, "
        "agreement; worker(s) 3 sent no stacks; every worker's stacks in F; the attempt fails, and Ray Train "
        "restarts it from its latest checkpoint within --max-failures 3"
    ) in behind
    level = hang_line(
        [report(0, 7, "forward/backward"), report(1, 7, "forward/backward")], 2, 31, 30, "x", "F", 0
    )
    assert "every worker is at step 7, forward/backward: worker 0 at step 7" in level
