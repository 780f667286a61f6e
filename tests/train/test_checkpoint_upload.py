"""Checkpoint files onto an object store: each file checked once uploaded, sent again when missing,
an error when it stays missing; and Ray Train's checkpoint upload goes that way (not through pyarrow's
copy_files, which can drop a file and report success). On a loopback S3 (moto), some of it failing."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs
import pytest
import s3fs

from pipeline import storage
from tests.flaky_s3 import FlakyS3, s3_client

BUCKET = "vitray-upload"
FILES = {
    "__0_0.distcp": b"x" * 300_000,
    ".metadata": b"m" * 500,
    "train_state.json": b"{}",
    "config.json": b"{}",
}


@pytest.fixture
def s3():
    s3 = FlakyS3(period=2, max_faults=20).start()
    s3_client(s3.endpoint).create_bucket(Bucket=BUCKET)
    yield s3
    s3.stop()


def local_checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    return directory


def uploaded(s3: FlakyS3, prefix: str) -> dict[str, bytes]:
    host, port = s3.upstream  # past the faults
    fs = s3fs.S3FileSystem(
        skip_instance_cache=True, key="testing", secret="testing",
        client_kwargs={"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
    )  # fmt: skip
    return {Path(p).name: fs.cat_file(p) for p in fs.find(f"{BUCKET}/{prefix}")}


def test_every_file_arrives_whole_through_failing_requests(s3, tmp_path):
    s3.faulty()
    storage.upload_dir(local_checkpoint(tmp_path), s3.location(f"s3://{BUCKET}/run/a"), backoff_s=0.1)
    s3.faulty(False)
    assert sum(s3.faults.values()) > 0
    assert uploaded(s3, "run/a") == FILES


def test_an_upload_that_fails_past_the_clients_retries_is_sent_again(tmp_path):
    """The client's own retries off and the first 2 uploads (PUT requests) answered with 500: the first
    file's put fails outright, and the checked upload's next round must send it."""
    s3 = FlakyS3(period=1, max_faults=2, kinds=("500",), methods=("PUT",)).start()
    try:
        options = {**s3.storage_options, "config_kwargs": {**s3.storage_options["config_kwargs"],
                   "retries": {"mode": "standard", "max_attempts": 1}}}  # fmt: skip
        s3_client(s3.endpoint).create_bucket(Bucket=BUCKET)
        s3.faulty()
        storage.upload_dir(
            local_checkpoint(tmp_path), storage.Location(f"s3://{BUCKET}/run/f", options), backoff_s=0.05
        )
        assert s3.faults["500"] == 2
        assert uploaded(s3, "run/f") == FILES
    finally:
        s3.stop()


def test_a_listing_that_fails_is_tried_again_in_the_next_round(s3, tmp_path, monkeypatch):
    real, calls = storage.list_files, []

    def list_files(where):
        calls.append(where)
        if len(calls) == 1:
            raise OSError("503 Slow Down")  # the store did not answer the check
        return real(where)

    monkeypatch.setattr(storage, "list_files", list_files)
    storage.upload_dir(local_checkpoint(tmp_path), s3.location(f"s3://{BUCKET}/run/l"), backoff_s=0.05)
    assert len(calls) == 2
    assert uploaded(s3, "run/l") == FILES


def dropping(monkeypatch, name: str, times: int) -> list[str]:
    """Make s3fs's put_file return without uploading `name`, `times` times (what pyarrow's copy_files
    did after a part upload failed); returns the names it was asked to put."""
    real, calls = s3fs.S3FileSystem.put_file, []

    def put_file(self, lpath, rpath, *args, **kwargs):
        calls.append(Path(lpath).name)
        if Path(lpath).name == name and calls.count(name) <= times:
            return None
        return real(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "put_file", put_file)
    return calls


def test_a_silently_dropped_file_is_sent_again(s3, tmp_path, monkeypatch):
    calls = dropping(monkeypatch, "train_state.json", times=1)
    storage.upload_dir(local_checkpoint(tmp_path), s3.location(f"s3://{BUCKET}/run/b"), backoff_s=0.1)
    assert calls.count("train_state.json") == 2
    assert uploaded(s3, "run/b") == FILES


def test_a_file_that_never_arrives_is_an_error_and_the_commit_file_is_not_sent(s3, tmp_path, monkeypatch):
    calls = dropping(monkeypatch, "train_state.json", times=100)
    with pytest.raises(OSError, match=r"could not upload train_state.json to s3://.* in 3 tries"):
        storage.upload_dir(
            local_checkpoint(tmp_path), s3.location(f"s3://{BUCKET}/run/c"),
            commit_last="config.json", attempts=3, backoff_s=0.1,
        )  # fmt: skip
    assert "config.json" not in calls and "config.json" not in uploaded(s3, "run/c")


def test_ray_train_uploads_a_checkpoint_to_s3_through_the_checked_upload(s3, tmp_path, monkeypatch):
    """The run directory's endpoint and keys in its storage options alone (none in the environment)."""
    import ray.train

    from pipeline.train import driver, session

    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    calls = dropping(monkeypatch, ".metadata", times=1)  # before the filesystem is made
    run_dir = s3.location(f"s3://{BUCKET}/runs/r")
    storage_path, name, arrow_s3 = driver.ray_storage(run_dir)  # what the driver gives Ray Train
    assert (storage_path, name) == (f"{BUCKET}/runs", "r")
    store = SimpleNamespace(storage_filesystem=arrow_s3, experiment_fs_path=f"{storage_path}/{name}")
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: store))
    reports = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kwargs: reports.append(kwargs))
    rank = session.RaySession.__new__(session.RaySession)  # its report alone, outside a Ray Train worker
    rank.run_dir = run_dir
    rank.report({"step": 4}, str(local_checkpoint(tmp_path)), name="checkpoint_000004")
    (kwargs,) = reports
    upload = kwargs["checkpoint_upload_fn"]
    assert upload is not None  # without it, Ray Train copies with pyarrow's copy_files
    persisted = upload(kwargs["checkpoint"], kwargs["checkpoint_dir_name"])
    assert persisted.path == f"{BUCKET}/runs/r/checkpoint_000004" and persisted.filesystem is arrow_s3
    assert calls.count(".metadata") == 2 and uploaded(s3, "runs/r/checkpoint_000004") == FILES
    # Ray Train reads it back through the same filesystem (a resume): the options reach the store.
    assert arrow_s3.get_file_info(f"{persisted.path}/config.json").size == len(FILES["config.json"])


def test_a_local_run_directory_keeps_ray_trains_own_copy(tmp_path, monkeypatch):
    import ray.train

    from pipeline.train import session

    store = SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem(), experiment_fs_path=str(tmp_path))
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: store))
    reports = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kwargs: reports.append(kwargs))
    rank = session.RaySession.__new__(session.RaySession)
    rank.run_dir = storage.Location(str(tmp_path))
    rank.report({"step": 4}, str(local_checkpoint(tmp_path)), name="checkpoint_000004")
    assert reports[0]["checkpoint_upload_fn"] is None


def test_an_asynchronous_save_is_uploaded_beside_training_once_written(tmp_path, monkeypatch):
    """`RaySession.report` with ``written``: Ray Train's upload thread waits for DCP's write, uploads each
    file whole into the run directory, and only then says so; reports without a checkpoint never wait."""
    import ray.train

    from pipeline.train import session

    run = tmp_path / "run"
    store = SimpleNamespace(storage_filesystem=pyarrow.fs.LocalFileSystem(), experiment_fs_path=str(run))
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: store))
    reports = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kwargs: reports.append(kwargs))
    rank = session.RaySession.__new__(session.RaySession)
    rank.run_dir = storage.Location(str(run))
    assert rank.report({"step": 3}) is None
    assert reports.pop()["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.ASYNC
    written = Future()
    done = rank.report({"step": 4}, str(local_checkpoint(tmp_path)), "checkpoint_000004", written=written)
    (kwargs,) = reports
    assert kwargs["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.ASYNC
    assert kwargs["delete_local_checkpoint_after_upload"] is False  # the saver removes its files
    with ThreadPoolExecutor(1) as upload_thread:  # Ray Train's
        persisted = upload_thread.submit(
            kwargs["checkpoint_upload_fn"], kwargs["checkpoint"], "checkpoint_000004"
        )
        time.sleep(0.5)
        assert not persisted.done() and not done.done() and not (run / "checkpoint_000004").exists()
        written.set_result(None)  # DCP's write is done
        assert persisted.result(timeout=30).path == str(run / "checkpoint_000004")
    assert done.result(timeout=1) is None
    assert {p.name: p.read_bytes() for p in (run / "checkpoint_000004").iterdir()} == FILES
    # A write that failed is never uploaded, and the saver learns why.
    failed = Future()
    (tmp_path / "b").mkdir()
    done = rank.report(
        {"step": 8}, str(local_checkpoint(tmp_path / "b")), "checkpoint_000008", written=failed
    )
    failed.set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        reports[-1]["checkpoint_upload_fn"](reports[-1]["checkpoint"], "checkpoint_000008")
    with pytest.raises(OSError, match="disk full"):
        done.result(timeout=1)
    assert not (run / "checkpoint_000008").exists()
