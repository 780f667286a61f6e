"""The two jobs on a real Ray cluster of nodes on one machine: submitted through the job CLI with token
authentication on, pretraining's workers on two nodes that join after the job was submitted; then, on
the same cluster, --decode-nodes: a decode node joins, labelled as the shipped cluster configs label
their CPU-only decode nodes (docs/scaling.md), and the read + decode tasks of a dataset run on it alone,
never on the unlabelled nodes beside it, however many CPUs those have free."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import dcp
from tests.distributed import free_ports

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


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


def submit_command(address: str) -> list[str]:
    """`ray job submit` of a vitray job as the README gives it, up to its entrypoint."""
    return [
        str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT),
        "--runtime-env", str(ROOT / "cluster" / "runtime_env.yaml"), "--",
    ]  # fmt: skip


# The shipped autoscaling configs in small, as a user drives them: a head without CPUs for tasks (its
# job server behind token authentication), a submission without the token refused, then pretraining
# submitted through the job CLI, whose workers wait until two worker nodes join; the embedding job
# submitted on the grown cluster; on the same three nodes, pretraining with an --out only one node's
# disk would hold: refused before any work. Then a decode node joins (1 CPU, labelled) beside the two
# unlabelled nodes of 3, and the driver reads a dataset twice: with the label selector, then without it
# (where the unlabelled nodes take tasks too: the check can see it). Where each read task ran comes
# from Ray's state API (the dashboard's), by node ID: every node here has the same IP address.
CLUSTER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time, urllib.error, urllib.request
    import ray
    from ray.cluster_utils import Cluster

    runs = json.loads(sys.argv[1])

    def submit(*entrypoint, **kwargs):
        return subprocess.Popen([*runs["submit"], *entrypoint], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, **kwargs)

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1",
        "dashboard_port": int(runs["dashboard"].rsplit(":", 1)[1]), **runs["head_ports"]})
    try:
        deadline = time.time() + 120
        while True:  # the job server is up once it refuses a request without the token
            try:
                urllib.request.urlopen(runs["dashboard"] + "/api/version", timeout=2)
                sys.exit("the dashboard answered without a token: authentication is off")
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):
                    break
            except OSError:
                pass
            if time.time() > deadline:
                sys.exit("the job server did not come up in 120 s")
            time.sleep(0.5)
        unauthenticated = submit("python", "-c", "print('should not run')",
                                 env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        print("without the token:", unauthenticated.wait(timeout=120),
              unauthenticated.stdout.read().replace("\\n", " "), flush=True)

        train = submit("python", "jobs/pretrain.py", *runs["train"])
        # Ray's forwarded lines off: written from another thread, they could split this script's
        # lines, which the test parses.
        # Its own tasks (the dataset reads below) import the pipeline from this checkout; the submitted
        # jobs bring theirs with --working-dir.
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
        deadline = time.time() + 180
        while time.time() < deadline and train.poll() is None:
            if any(pg["state"] == "PENDING" for pg in ray.util.placement_group_table().values()):
                break
            time.sleep(0.5)
        print("cluster CPUs when the workers asked:", ray.cluster_resources().get("CPU", 0), flush=True)
        cluster.add_node(num_cpus=3)
        cluster.add_node(num_cpus=3)
        print(train.communicate(timeout=480)[0], flush=True)
        print("train job exit:", train.returncode, flush=True)
        embed = submit("python", "jobs/embed.py", *runs["embed"])
        print(embed.communicate(timeout=300)[0], flush=True)
        print("embed job exit:", embed.returncode, flush=True)
        refused = subprocess.run(
            [sys.executable, "jobs/pretrain.py", "--address", cluster.address, *runs["refused"]],
            capture_output=True, text=True, timeout=300,
        )
        print("refused:", refused.returncode, (refused.stderr.strip().splitlines() or [""])[-1], flush=True)

        from ray.util.state import list_tasks
        from pipeline.data.config import DataConfig
        from pipeline.data.dataset import build_dataset

        decode = cluster.add_node(num_cpus=1, labels={"vitray/role": "decode"})
        cluster.wait_for_nodes()
        mine, earlier = ray.get_runtime_context().get_job_id(), set()  # read tasks of the runs before
        for run, label in (("labelled", "vitray/role=decode"), ("any", None)):
            config = DataConfig(image_size=32, patch_size=8, decode_nodes=label)
            rows = build_dataset(runs["decode"], config, train=False).take_all()
            deadline = time.time() + 60
            while True:  # task events reach the state API a little after the tasks end
                finished = [t for t in list_tasks(filters=[("job_id", "=", mine)], limit=10_000, detail=True,
                                                  raise_on_missing_output=False)
                            if t.state == "FINISHED" and t.task_id not in earlier and "Read" in t.name]
                tasks = {t.task_id: t.node_id for t in finished}
                if len(tasks) >= len(runs["decode"]) or time.time() > deadline:
                    break
                time.sleep(1)
            earlier |= set(tasks)
            print(run, json.dumps({"rows": len(rows), "errors": sum(bool(r["error"]) for r in rows),
                                   "nodes": sorted(set(tasks.values())), "tasks": len(tasks),
                                   "names": sorted({t.name for t in finished})}), flush=True)
        print("decode node", decode.node_id, flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    """
)


HEAD_PORTS = (
    "dashboard_agent_listen_port",
    "metrics_agent_port",
    "metrics_export_port",
    "runtime_env_agent_port",
)


def head_ports(*more: str) -> dict[str, int]:
    """A distinct free port for each of the head's agents (`HEAD_PORTS`) and each name in ``more``."""
    names = [*HEAD_PORTS, *more]
    return dict(zip(names, free_ports(len(names)), strict=True))


def test_jobs_submitted_with_the_token_to_a_cluster_whose_nodes_join_and_decode_on_the_labelled_node(
    shards, tmp_path, subtests
):
    """One cluster, two scenarios (each named where it fails): the jobs submitted through the job CLI, and
    --decode-nodes on a labelled node joined after them."""
    from pipeline.data.synthetic import write_synthetic_shards

    run, local, out = tmp_path / "run", tmp_path / "local", tmp_path / "embeddings"
    # 12 shards of 4: a read task each, enough that the unlabelled nodes take some when they may.
    decoded = write_synthetic_shards(
        tmp_path / "decode", 48, samples_per_shard=4, image_size=32, num_classes=4, seed=3
    )
    ports = head_ports("dashboard")
    dashboard = f"http://127.0.0.1:{ports.pop('dashboard')}"
    # Two nodes of one machine share its disk, which --shared-out declares.
    common = ["--preset", "tiny", "--data", str(shards.dir), "--max-steps", "4", "--warmup-steps", "1"]
    runs = {
        "dashboard": dashboard,
        # Free ports for the head's agents: the defaults may be held by another Ray on the machine
        # (the tests' own), and a head whose job agent cannot bind takes no job.
        "head_ports": ports,
        "submit": submit_command(dashboard),
        "train": [
            *common, "--out", str(run), "--shared-out", "--placement-strategy", "STRICT_SPREAD",
            "--checkpoint-every", "2", "--log-every", "2",
        ],
        "embed": ["--data", str(shards.dir), "--weights", str(run / "final"), "--out", str(out)],
        "refused": [*common, "--out", str(local)],
        "decode": decoded.urls,
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", CLUSTER, json.dumps(runs)],
        # The nodes of one machine share one session directory, where each node's runtime-env agent, on
        # its first use of the job's --working-dir package, removes and unpacks it again: a worker that
        # another node starts meanwhile fails its `cd` there, and the raylet waits out its registration
        # (60 s by default; seen as a 51 s checkpoint stall). Each node of a real cluster has a disk of its own.
        env=ray_env() | {"RAY_worker_register_timeout_seconds": "20"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    console = result.stdout
    assert result.returncode == 0, console[-3000:] + result.stderr[-3000:]

    with subtests.test(msg="jobs submitted with the token to a cluster whose nodes join after submission"):
        # Without the token the job server refuses the submission, and nothing runs.
        unauthenticated = re.search(r"^without the token: (\d+) (.*)$", console, re.M)
        assert unauthenticated and int(unauthenticated[1]) != 0, console[-3000:]
        assert "should not run" not in unauthenticated[2] and "authentication" in unauthenticated[2].lower()

        # Pretraining as a submitted job: its workers asked while the cluster had no CPUs for them.
        assert "train job exit: 0" in console, console[-4000:]
        assert "succeeded" in console
        assert "cluster CPUs when the workers asked: 0" in console
        # 6 CPUs joined, 2 workers hold 1 each: 4 spare, 2 per worker (a budget frozen at submission: 1).
        assert "epoch 0: 2 decode CPUs per worker (6 CPUs in the cluster now, 2 workers x 1" in console
        # FSDP2's collectives and the checkpoint gathering crossed the node boundary.
        assert "2 workers on 2 node(s)" in console
        assert dcp.is_complete(run / dcp.checkpoint_name(4))
        assert "finished at step 4" in console

        # The embedding job, submitted on the grown cluster: one row per image.
        assert "embed job exit: 0" in console, console[-4000:]
        table = pq.read_table(out)
        assert sorted(table.column("key").to_pylist()) == sorted(shards.keys)

        # A local --out without --shared-out on the same cluster: exit 2 and one line, nothing written.
        refused = re.search(r"^refused: (\d+) (.*)$", console, re.M)
        assert refused, console[-3000:]
        code, error = int(refused[1]), refused[2]
        assert code == 2 and error.startswith("error: --out "), error
        assert "the cluster has 3 nodes" in error and "--shared-out" in error, error
        assert not local.exists()  # refused before the workers started

    with subtests.test(msg="--decode-nodes: read and decode on the labelled node only"):
        reads = {m[1]: json.loads(m[2]) for m in re.finditer(r"^(labelled|any) (\{.*\})$", console, re.M)}
        decode = re.search(r"^decode node (\w+)$", console, re.M)
        assert decode and reads.keys() == {"labelled", "any"}, console[-3000:]
        for read in reads.values():
            assert read["rows"] == 48 and read["errors"] == 0, read
            assert read["tasks"] == len(decoded.urls), read  # one read task per shard, each seen
            # Read and decode fused into one task: decode ran where the read ran.
            assert read["names"] == ["ReadTarShard->MapBatches(preprocess_batch)"], read
        # With the label: every read + decode task on the decode node.
        assert reads["labelled"]["nodes"] == [decode[1]], (reads, decode[1])
        # Without it the unlabelled nodes take tasks too: the check above can fail.
        assert set(reads["any"]["nodes"]) - {decode[1]}, (reads, decode[1])


def test_the_ports_a_head_is_given_are_distinct():
    # Ports chosen one socket at a time repeat: about 1 draw of 5 in 1,500 held one port twice, and a
    # head given one port for two agents does not start.
    for _ in range(20_000):  # one port chosen at a time: about 13 draws of these 20,000 repeat
        ports = head_ports("dashboard_port")
        assert len(set(ports.values())) == len(ports), ports
