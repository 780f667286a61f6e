"""One live run per run directory (`pipeline.train.checkpointing.lease`): local disk, memory:// and a loopback S3."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from pipeline import storage
from pipeline.train.checkpointing import lease
from tests.flaky_s3 import FlakyS3, s3_client


def dead_pid() -> int:
    """The id of a process that has ended."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def write(run_dir: storage.Location, **record) -> None:
    storage.write_text(run_dir.join(lease.LEASE), json.dumps(record))


def check_one_live_run(run_dir: storage.Location) -> None:
    first = lease.acquire(run_dir)
    assert lease.lost(run_dir, first.run) == ""
    with pytest.raises(lease.LeaseHeldError) as held:  # the same process: alive, just renewed
        lease.acquire(run_dir)
    message = str(held.value)
    assert message.startswith(f"--out {run_dir.url} is in use by a live training run, run {first.run} (pid ")
    assert socket.gethostname() in message and "\n" not in message
    # A driver killed on this host: its lease is taken over at once, and its workers stop writing.
    write(run_dir, run="killed", host=socket.gethostname(), pid=dead_pid(), renewed=time.time())
    second = lease.acquire(run_dir)
    assert lease.lost(run_dir, "killed").startswith(
        f"the lease on {run_dir.url} was taken over by run {second.run}"
    )
    assert lease.lost(run_dir, first.run) != ""
    # Another host's run: live while it renews, taken over once it has not for STALE_S.
    write(run_dir, run="elsewhere", host="another-host", pid=1, renewed=time.time())
    with pytest.raises(
        lease.LeaseHeldError, match=r"run elsewhere \(pid 1 on another-host, renewed 0 s ago\)"
    ):
        lease.acquire(run_dir)
    write(run_dir, run="elsewhere", host="another-host", pid=1, renewed=time.time() - lease.STALE_S - 1)
    third = lease.acquire(run_dir)
    third.renew()
    assert lease.read(run_dir)["run"] == third.run
    second.release()  # not its lease any more: left alone
    assert lease.read(run_dir)["run"] == third.run
    third.release()
    assert lease.read(run_dir) is None
    assert lease.lost(run_dir, third.run).endswith(
        "was released (its driver ended): this run stops and writes nothing more there"
    )


def test_a_live_run_holds_its_directory_and_a_dead_ones_is_taken_over(tmp_path):
    check_one_live_run(storage.as_location(str(tmp_path / "run")))


def test_the_same_on_an_object_store(tmp_path):
    check_one_live_run(storage.as_location("memory://lease-test/run"))
    s3 = FlakyS3(period=3, max_faults=10).start()
    try:
        s3_client(s3.endpoint).create_bucket(Bucket="runs")
        check_one_live_run(storage.Location("s3://runs/run", s3.storage_options))
    finally:
        s3.stop()


def test_the_driver_renews_its_lease_until_it_releases_it(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_S", 0.05)
    run_dir = storage.as_location(str(tmp_path))
    held = lease.acquire(run_dir)
    first = lease.read(run_dir)["renewed"]
    held.keep_renewed()
    deadline = time.time() + 10
    while lease.read(run_dir)["renewed"] == first and time.time() < deadline:
        time.sleep(0.05)
    assert lease.read(run_dir)["renewed"] > first
    held.release()
    assert lease.read(run_dir) is None


def test_checking_that_out_is_free_writes_nothing_and_refuses_a_live_holder(tmp_path):
    """The driver's check before Ray: a run that the cluster's checks then refuse leaves no trace."""
    fresh = tmp_path / "fresh"
    lease.check_free(str(fresh))
    assert not fresh.exists()
    held = lease.acquire(str(tmp_path / "held"))
    with pytest.raises(lease.LeaseHeldError, match=f"run {held.run} "):
        lease.check_free(str(tmp_path / "held"))
    held.release()
    lease.check_free(str(tmp_path / "held"))
