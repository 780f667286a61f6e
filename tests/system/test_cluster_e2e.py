"""The two jobs on real Ray clusters: submitted to a `ray start --head` through the job CLI (token
authentication on), and pretraining with its workers on two nodes of one machine that join after the
job was submitted."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from contextlib import closing
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import dcp

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_env() -> dict[str, str]:
    """This venv's `ray` and `python` first on PATH, token authentication on for server and client."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([BIN / "ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    return env


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from pipeline.data.synthetic import write_synthetic_shards

    out = tmp_path_factory.mktemp("cluster_shards")
    return write_synthetic_shards(out, 64, samples_per_shard=16, image_size=32, num_classes=4, seed=2)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on free loopback ports with its own temp dir; its dashboard address. Stopped by
    signalling its process group, so no other Ray instance on the machine is touched."""
    env = ray_env()
    dashboard = free_port()
    # Short: Ray's Unix socket paths under it must stay within 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    command = [
        BIN / "ray", "start", "--head", "--block", "--num-cpus=8", f"--temp-dir={temp_dir}",
        f"--port={free_port()}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}", f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}",
    ]  # fmt: skip
    log_path = tmp_path_factory.mktemp("ray_head") / "head.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed at teardown)
    head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert head.poll() is None, log_path.read_text()[-2000:]
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                pytest.fail("the dashboard answered without a token: authentication is off")
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):  # up, and refusing requests without the token
                    break
            except OSError:
                pass
            time.sleep(1)
        else:
            pytest.fail("the Ray head did not come up in 120 s")
        yield address, env
    finally:
        for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(address: str, env: dict[str, str], *entrypoint: str) -> subprocess.CompletedProcess:
    command = [
        BIN / "ray", "job", "submit", "--address", address, "--working-dir", ROOT,
        "--runtime-env", ROOT / "cluster" / "runtime_env.yaml", "--", *entrypoint,
    ]  # fmt: skip
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_pretraining_and_embedding_as_submitted_ray_jobs(ray_head, shards, tmp_path):
    address, env = ray_head
    run, out = tmp_path / "run", tmp_path / "embeddings"
    result = submit(
        address, env, "python", "jobs/pretrain.py", "--preset", "tiny", "--data", str(shards.dir),
        "--out", str(run), "--max-steps", "8", "--warmup-steps", "2", "--checkpoint-every", "4",
        "--log-every", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout + result.stderr
    assert "finished at step 8" in result.stdout
    assert dcp.is_complete(run / dcp.checkpoint_name(8))

    result = submit(
        address, env, "python", "jobs/embed.py", "--data", str(shards.dir), "--weights", str(run / "final"),
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = pq.read_table(out)
    assert table.num_rows == len(shards.keys)
    assert sorted(table.column("key").to_pylist()) == sorted(shards.keys)


def test_job_submission_without_the_token_is_refused(ray_head):
    address, env = ray_head
    env = {**env, "RAY_AUTH_MODE": "disabled"}
    result = submit(address, env, "python", "-c", "print('should not run')")
    assert result.returncode != 0
    assert "should not run" not in result.stdout
    assert "authentication" in (result.stdout + result.stderr).lower()


# The shipped autoscaling configs in small: a head without CPUs for tasks, and two worker nodes that
# join only after the job was submitted (once its workers are waiting for resources). Then, on the same
# three nodes, the job again with an --out only one node's disk would hold: refused before any work.
AUTOSCALING = textwrap.dedent(
    """
    import json, subprocess, sys, time
    import ray
    from ray.cluster_utils import Cluster

    runs = json.loads(sys.argv[1])
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    try:
        job = subprocess.Popen([sys.executable, "jobs/pretrain.py", "--address", cluster.address, *runs["train"]])
        ray.init(address=cluster.address)
        deadline = time.time() + 180
        while time.time() < deadline and job.poll() is None:
            if any(pg["state"] == "PENDING" for pg in ray.util.placement_group_table().values()):
                break
            time.sleep(0.5)
        print("cluster CPUs when the workers asked:", ray.cluster_resources().get("CPU", 0), flush=True)
        cluster.add_node(num_cpus=3)
        cluster.add_node(num_cpus=3)
        code = job.wait(timeout=480)
        refused = subprocess.run(
            [sys.executable, "jobs/pretrain.py", "--address", cluster.address, *runs["refused"]],
            capture_output=True, text=True, timeout=300,
        )
        print("refused:", refused.returncode, (refused.stderr.strip().splitlines() or [""])[-1], flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    sys.exit(code)
    """
)


def test_workers_on_two_nodes_that_came_after_submission(shards, tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    # Two nodes of one machine share its disk, which --shared-out declares.
    common = ["--preset", "tiny", "--data", str(shards.dir), "--max-steps", "4", "--warmup-steps", "1"]
    runs = {
        "train": [
            *common, "--out", str(run), "--shared-out", "--placement-strategy", "STRICT_SPREAD",
            "--checkpoint-every", "2", "--log-every", "2",
        ],
        "refused": [*common, "--out", str(local)],
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", AUTOSCALING, json.dumps(runs)],
        env=ray_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=720,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "cluster CPUs when the workers asked: 0" in result.stdout
    # 6 CPUs joined, 2 workers hold 1 each: 4 spare, 2 per worker (a budget frozen at submission: 1).
    assert "epoch 0: 2 decode CPUs per worker (6 CPUs in the cluster now, 2 workers x 1" in result.stdout
    # FSDP2's collectives and the checkpoint gathering crossed the node boundary.
    assert "2 workers on 2 node(s)" in result.stdout
    assert dcp.is_complete(run / dcp.checkpoint_name(4))
    assert "finished at step 4" in result.stdout

    # A local --out without --shared-out on the same cluster: exit 2 and one line, nothing written.
    refused = re.search(r"^refused: (\d+) (.*)$", result.stdout, re.M)
    assert refused, result.stdout[-3000:]
    code, error = int(refused[1]), refused[2]
    assert code == 2 and error.startswith("error: --out "), error
    assert "the cluster has 3 nodes" in error and "--shared-out" in error, error
    assert not local.exists()  # refused before the workers started
