"""A pretraining job SIGKILLed while an asynchronous checkpoint is in flight, run again: it resumes from
the checkpoint before it, exactly, and ends with the history and the weights of a straight run saved
synchronously (the system tests' straight run, `tests/system/conftest.py`).

The jobs run as on a cluster: `jobs/pretrain.py --address` of the tests' shared local Ray. The killed job's driver is SIGKILLed; Ray ends the job's workers with it (checked).
The save in flight is made certain by the saver's test hook (`pipeline.train.checkpointing.saver.WRITE_DELAY_ENV`):
the background write of checkpoint 8 is held for 10 minutes on every rank. Training goes on past step 8
meanwhile (row 10 is logged), then waits at step 12 for save 8 (one save in flight at most); the job is
killed once row 10 is there and checkpoint 4 registered.

Arithmetic: 4 shards x 16 samples, 2 workers x micro-batch 8, batch 16 -> 4 steps an epoch; 12 steps,
a checkpoint every 4 (each on an epoch edge), a row every 2.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline import dcp
from pipeline.train.checkpointing.saver import WRITE_DELAY_ENV
from pipeline.train.driver import read_metrics
from tests.system.conftest import TRAINING
from tests.system.test_pretrain import train_workers
from tests.train.test_loop import untimed

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def command(address: str, shards: list[str], out: Path) -> list[str]:
    return [
        sys.executable, str(ROOT / "jobs" / "pretrain.py"), "--address", address, "--data", ",".join(shards), "--out", str(out),
        *TRAINING, "--checkpoint-every", "4", "--log-every", "2", "--keep-checkpoints", "5",
    ]  # fmt: skip


def registered(out: Path) -> list[int]:
    """Steps of the checkpoints Ray Train has registered (only those are resumed from)."""
    snapshot = out / "checkpoint_manager_snapshot.json"
    if not snapshot.is_file():
        return []
    try:
        results = json.loads(snapshot.read_text())["checkpoint_results"]
    except (json.JSONDecodeError, KeyError):  # being rewritten
        return []
    return [int(r["checkpoint_dir_name"].rsplit("_", 1)[1]) for r in results]


def logged(out: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(str(out))]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_a_job_killed_with_a_save_in_flight_resumes_from_the_checkpoint_before_exactly(
    ray_session, straight_run, tmp_path
):
    address = ray_session.get_runtime_context().gcs_address

    shards, straight = straight_run.shards, straight_run.out
    env = dict(os.environ)
    # The hook reaches the job's workers as `ray job submit --runtime-env-json` would pass it.
    held = {"runtime_env": {"env_vars": {WRITE_DELAY_ENV: "8:600"}}}
    killed = tmp_path / "killed"

    started = time.monotonic()
    log = (tmp_path / "killed.log").open("w")
    job = subprocess.Popen(
        command(address, shards.urls, killed),
        cwd=ROOT, env={**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(held)}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        while time.monotonic() - started < 240 and job.poll() is None:
            if 10 in logged(killed) and 4 in registered(killed):
                break
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job's driver
        job.wait()
        log.close()
    deadline = time.monotonic() + 60
    while train_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not train_workers(), "the killed job's training workers are still running"
    output = (tmp_path / "killed.log").read_text()
    # What the kill left: training went past step 8 without waiting for its write (row 8's stall is the
    # copy alone, the write was held for 600 s), checkpoint 8 neither written nor registered.
    rows = read_metrics(str(killed))
    # Row 12, the last step's, may be there too: a checkpoint's row is stored before its save, which
    # here waits behind the held write of checkpoint 8.
    assert [r["step"] for r in rows] in ([2, 4, 6, 8, 10], [2, 4, 6, 8, 10, 12]), output[-3000:]
    assert rows[3]["checkpoint_stall_s"] < 30 and "checkpoint stall" in output
    assert registered(killed) == [4]
    assert not dcp.is_complete(killed / dcp.checkpoint_name(8))
    assert dcp.latest_complete(killed).url == str(killed / dcp.checkpoint_name(4))

    again = subprocess.run(
        command(address, shards.urls, killed), cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", again.stdout)
    assert [(Path(where).name, int(step)) for where, step in resumed] == [(dcp.checkpoint_name(4), 4)]
    assert "finished at step 12:" in again.stdout
    seconds = time.monotonic() - started

    # One history, the straight run's; every checkpoint complete; the straight run's weights.
    assert untimed(read_metrics(str(killed))) == untimed(read_metrics(str(straight)))
    assert registered(killed) == registered(straight) == [4, 8, 12]
    for step in (4, 8, 12):
        assert dcp.is_complete(killed / dcp.checkpoint_name(step))
    a, b = (load_file(run / "final" / "weights.safetensors") for run in (straight, killed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    print(f"two jobs in {seconds:.0f} s")
