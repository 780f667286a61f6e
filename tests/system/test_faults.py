"""Pretraining through faults, as a user runs it: `jobs/pretrain.py` reads its shards from and writes its
run to a loopback S3 whose every 4th request fails (503, a stall past the read timeout, 500, a dropped
connection, in turn; 12 faults in the first run); its driver and the local Ray it started are SIGKILLed
once a checkpoint is registered (checkpoint 8's write held meanwhile by the saver's test hook, so that
the kill lands mid-run), and the same command is run again. In the second run every 2nd request
for a checkpoint's files fails: the restore's reads of the checkpoint it resumes from, then its saves.
The run ends with the weights of the same command run straight on a local disk (the system tests'
straight run, `tests/system/conftest.py`).

The first run reaches the store through the environment (AWS_*); the second through `--storage-options`
alone, no AWS_* variable set: its shards, marker, metrics, checkpoints (Ray Train's storage too, which
resumes the run) and final export all go where those options say, and none of the run's files holds the
secret.

Arithmetic: 4 shards x 16 samples, 2 workers x micro-batch 8, batch 16 -> 4 steps an epoch, so every
checkpoint (every 4 steps) falls on an epoch edge, and 12 steps read 192 samples.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import s3fs
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

import vit
from pipeline import dcp
from pipeline.storage import Location
from pipeline.train.checkpointing.saver import WRITE_DELAY_ENV
from tests.flaky_s3 import FAULTS, FlakyS3
from tests.system.conftest import TRAINING

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "jobs" / "pretrain.py"
BUCKET = "vitray-train-faults"
RUN = f"{BUCKET}/runs/r1"
CHECKPOINT_FILES = r"checkpoint_\d{8}"  # in a request's path or listing prefix (the snapshot file aside)
pytestmark = pytest.mark.slow


def process_group_gone(pgid: int, timeout: float = 30) -> bool:
    """True once no process is left in the group (its orphans reaped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_killed_driver_run_again_over_failing_s3_finishes_from_its_checkpoint(straight_run, tmp_path):
    shards = straight_run.shards
    s3 = FlakyS3(period=4, max_faults=12, seconds=600).start()  # 12 more for the second run
    try:
        credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1", **credentials)
        client.create_bucket(Bucket=BUCKET)
        for url in shards.urls:
            client.upload_file(url, BUCKET, f"shards/{Path(url).name}")
        # The test's own reads go to moto directly, past the faults.
        host, port = s3.upstream
        direct = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
        }
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **direct)
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": s3.endpoint,  # the job reaches the store through the faults
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # Checkpoint 8's write is held, so the run cannot reach its end (12 waits for 8 in storage)
            # before the kill that follows the first registered checkpoint: a fast run raced past it.
            WRITE_DELAY_ENV: "8:120",
        }
        secret = "vitray-second-run-secret"  # moto takes any keys
        options = {**s3.storage_options, "key": "vitray-second-run", "secret": secret}
        options_only = {k: v for k, v in env.items() if not k.startswith("AWS_") and k != WRITE_DELAY_ENV}

        def pretrain(data: str, out: str) -> list[str]:
            return [
                sys.executable, str(PRETRAIN), "--data", f"{data}/train-{{000000..000003}}.tar", "--out", out,
                *TRAINING, "--checkpoint-every", "4", "--log-every", "2", "--keep-checkpoints", "5",
            ]  # fmt: skip

        args = pretrain(f"s3://{BUCKET}/shards", f"s3://{RUN}")

        def registered() -> list[int]:
            """Steps of the checkpoints Ray Train has registered (only those are resumed from)."""
            snapshot = f"{RUN}/checkpoint_manager_snapshot.json"
            fs.invalidate_cache()
            if not fs.exists(snapshot):
                return []
            results = json.loads(fs.cat_file(snapshot))["checkpoint_results"]
            return [int(r["checkpoint_dir_name"].rsplit("_", 1)[1]) for r in results]

        s3.faulty()
        started = time.monotonic()
        log = (tmp_path / "first.log").open("w")
        job = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while time.monotonic() - started < 360 and job.poll() is None and not registered():
                time.sleep(0.2)
        finally:
            os.killpg(job.pid, signal.SIGKILL)  # the driver and the local Ray it started
            job.wait()
            log.close()
        killed_at = time.monotonic() - started
        first_log = (tmp_path / "first.log").read_text()
        assert process_group_gone(job.pid), "processes of the killed job are still running"
        at_kill = registered()
        assert at_kill and max(at_kill) < 12, f"registered {at_kill}\n{first_log[-3000:]}"
        faults_first, log_first, requests_first = dict(s3.faults), len(s3.log), s3.requests
        # No request is in flight (the first run's processes are gone): the second run's faults fall on
        # every 2nd request for a checkpoint's files, the first of which are the restore's reads.
        # 40 of them at most: enough to reach the saves after the restore.
        s3.period, s3.paths, s3.requests, s3.max_faults = 2, CHECKPOINT_FILES, 0, s3.max_faults + 40

        result = subprocess.run(
            [*args, "--storage-options", json.dumps(options)],
            cwd=ROOT, env=options_only, capture_output=True, text=True, timeout=480,
        )  # fmt: skip
        seconds = time.monotonic() - started
        s3.faulty(False)
        assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]

        # The second run resumed from the latest checkpoint registered before the kill (registration
        # lags the workers, so that may be 4 or 8) and finished.
        resumed = re.findall(r"resumed from (\S+) at step (\d+)", result.stdout)
        step = max(at_kill)
        assert [(name.rsplit("/", 1)[-1], int(at)) for name, at in resumed] == [
            (dcp.checkpoint_name(step), step)
        ], result.stdout[-3000:]
        # The restore read that checkpoint's files through failing requests, and the last checkpoint's
        # save (its uploads and the listings that check them) went through failing ones too.
        second = s3.log[log_first:]
        restore = [
            (kind, method) for kind, method, path in second if f"/{dcp.checkpoint_name(step)}/" in path
        ]
        assert restore and {method for _, method in restore} <= {"GET", "HEAD"}, second
        assert [path for _, _, path in second if dcp.checkpoint_name(12) in path], second
        assert "finished at step 12:" in result.stdout
        assert "samples read: 192, skipped as bad: 0" in result.stdout

        # metrics.jsonl: one history, every logged step once.
        rows = [json.loads(line) for line in fs.cat_file(f"{RUN}/metrics.jsonl").decode().splitlines()]
        assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
        assert rows[-1]["samples_seen"] == 192 and all(math.isfinite(r["loss"]) for r in rows)

        # Every checkpoint complete; final/ whole, readable, and equal to the last checkpoint's model.
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(RUN))
        assert [n for n in names if re.fullmatch(r"checkpoint_\d+", n)] == [
            dcp.checkpoint_name(n) for n in (4, 8, 12)
        ]
        for name in (dcp.checkpoint_name(n) for n in (4, 8, 12)):
            assert dcp.is_complete(Location(f"s3://{RUN}/{name}", direct)), name
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{RUN}/final")) == [
            "config.json",
            "weights.safetensors",
        ]
        exported = json.loads(fs.cat_file(f"{RUN}/final/config.json"))
        assert exported["training"]["step"] == 12 and exported["training"]["finished"]
        weights = load_safetensors(fs.cat_file(f"{RUN}/final/weights.safetensors"))
        config = vit.ViTConfig.from_dict(exported["model"])
        last = dcp.load_model_state(Location(f"s3://{RUN}/{dcp.checkpoint_name(12)}", direct), config)
        assert weights.keys() == last.keys()
        for key in weights:
            assert torch.equal(weights[key], last[key]), key
        fs.invalidate_cache()
        assert not [p for p in fs.find(RUN) if secret.encode() in fs.cat_file(p)]
    finally:
        s3.stop()

    # The same command, run straight on a local disk, ends with the same weights, bit for bit.
    healthy = load_file(straight_run.out / "final" / "weights.safetensors")
    assert healthy.keys() == weights.keys()
    for key in healthy:
        assert torch.equal(healthy[key], weights[key]), f"{key} differs from the run on a healthy store"

    print(
        f"faults: {dict(s3.faults)} ({faults_first} before the kill, in {requests_first} requests); "
        f"second run: {s3.log[log_first:]}; registered at the kill: {at_kill}; "
        f"killed after {killed_at:.0f} s, finished after {seconds:.0f} s"
    )
    # Faults of every kind in the first run, 3 of each; in the second, of every kind too.
    assert faults_first == dict.fromkeys(FAULTS, 3), faults_first
    assert {kind for kind, _, _ in second} == set(FAULTS), second
