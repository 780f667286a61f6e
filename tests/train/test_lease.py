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


# A lease file as no run writes it: its text (None: a directory of that name), and what the line says.
UNREADABLE = [
    ("", "empty"),
    ("null", "JSON null, not an object"),
    ("[]", "JSON [], not an object"),
    ('{"run": "r", "host": "h", "pid": 1}', "its renewed is missing"),
    ('{"run": "r", "host": "h", "pid": 1, "renewed": "soon"}', 'its renewed is "soon", not int or float'),
    ('{"run": "r", "host": "h", "pid": 1, "renewed": [1]}', "its renewed is [1], not int or float"),
    ('{"run": "r", "host": "h", "pid": "1", "renewed": 1}', 'its pid is "1", not int'),
    ('{"run": "r", "host": "h", "pid": -1, "renewed": 1}', "its pid is -1, not a process id"),
    ('{"run": 7, "host": "h", "pid": 1, "renewed": 1}', "its run is 7, not str"),
    ('{"run": "r", "host": "h", "pid": 1, "renewed": NaN}', "its renewed is nan, not a time"),
    ('{"run": "r", "host": "h", "pid": true, "renewed": 1}', "its pid is true, not int"),
    ("\x00\xff", "not JSON"),
    (None, "a directory"),
]


@pytest.mark.parametrize(("text", "why"), UNREADABLE, ids=[why for _, why in UNREADABLE])
def test_a_lease_file_that_does_not_read_is_one_line_naming_it_not_a_run_that_holds_out(tmp_path, text, why):
    """Before: an empty, null or [] lease passed the check as no lease, then the exclusive create failed
    on every try with "in use by ... run None (pid None on None, renewed 1795880154 s ago)"; a field of
    another type raised ValueError or TypeError, a directory IsADirectoryError."""
    run_dir = storage.as_location(str(tmp_path / "run"))
    path = tmp_path / "run" / lease.LEASE
    if text is None:
        path.mkdir(parents=True)
    else:
        path.parent.mkdir()
        path.write_text(text)
    for check in (lease.check_free, lease.acquire, lease.read):
        with pytest.raises(lease.LeaseUnreadableError) as info:
            check(run_dir)
        message = str(info.value)
        assert message.startswith(f"{path} is not a training run's lease ({why}") and "\n" not in message
        assert message.endswith("if no training run is using this --out, remove that file and run again")
    assert lease.lost(run_dir, "mine") == (
        f"the lease on {run_dir.url} does not read ({info.value.why}): this run "
        "stops and writes nothing more there"
    )
    assert path.is_dir() if text is None else path.read_text() == text  # left as it was


def test_a_pretraining_run_into_an_out_with_an_empty_lease_is_refused_before_ray(tmp_path, synthetic_shards):
    from tests.job_scripts import run_without_ray

    out = tmp_path / "run"
    out.mkdir()
    (out / lease.LEASE).write_text("")
    done = run_without_ray(
        "pretrain", "--preset", "tiny", "--data", synthetic_shards.dir, "--out", str(out), "--cpu",
        "--num-workers", "1", "--image-size", "32",
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        done.stderr
        == f"error: {out / lease.LEASE} is not a training run's lease (empty); if no training run is using this --out, remove that file and run again\n"
    )


def test_a_renewal_ahead_of_this_hosts_clock_is_fresh_within_stale_s_and_not_for_days(tmp_path):
    run_dir = storage.as_location(str(tmp_path / "run"))
    write(run_dir, run="ahead", host="another-host", pid=1, renewed=time.time() + 30)  # a clock 30 s ahead
    with pytest.raises(lease.LeaseHeldError, match=r"run ahead \(pid 1 on another-host, renewed 3\d s ahead"):
        lease.acquire(run_dir)
    write(run_dir, run="ahead", host="another-host", pid=1, renewed=time.time() + 3 * 86400)
    taken = lease.acquire(run_dir)  # before: refused as live for three days
    assert lease.read(run_dir)["run"] == taken.run
    taken.release()
