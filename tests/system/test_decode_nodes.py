"""--decode-nodes on a Ray cluster of three nodes on one machine: the read + decode tasks of a dataset run on
the node that carries the label, never on the unlabelled node beside it, however many CPUs that one has
free (the shipped cluster configs label their CPU-only decode nodes so; docs/scaling.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.system.test_cluster_e2e import head_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# A head without CPUs (the shipped configs' head schedules nothing), a decode node labelled as the
# cluster configs label theirs, and a larger unlabelled node. The dataset is read twice: with the label
# selector, then without it (where the unlabelled node takes tasks too: the check below can see it).
# Where each task ran comes from Ray's state API (the dashboard's), by node ID: every node here has the
# same IP address.
CLUSTER = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_tasks
    from pipeline.data.config import DataConfig
    from pipeline.data.dataset import build_dataset

    shards, ports = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1", **ports})
    try:
        decode = cluster.add_node(num_cpus=1, labels={"vitray/role": "decode"})
        other = cluster.add_node(num_cpus=3)
        # Ray's forwarded lines off: written from another thread, they could split this script's
        # lines, which the test parses.
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        earlier = set()  # task IDs of the runs before
        for run, label in (("labelled", "vitray/role=decode"), ("any", None)):
            config = DataConfig(image_size=32, patch_size=8, decode_nodes=label)
            rows = build_dataset(shards, config, train=False).take_all()
            deadline = time.time() + 60
            while True:  # task events reach the state API a little after the tasks end
                finished = [t for t in list_tasks(limit=10_000, detail=True, raise_on_missing_output=False)
                            if t.state == "FINISHED" and t.task_id not in earlier and "Read" in t.name]
                tasks = {t.task_id: t.node_id for t in finished}
                if len(tasks) >= len(shards) or time.time() > deadline:
                    break
                time.sleep(1)
            earlier |= set(tasks)
            print(run, json.dumps({"rows": len(rows), "errors": sum(bool(r["error"]) for r in rows),
                                   "nodes": sorted(set(tasks.values())), "tasks": len(tasks),
                                   "names": sorted({t.name for t in finished})}), flush=True)
        print("decode node", decode.node_id, "other node", other.node_id, flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    """
)


def test_decode_runs_on_the_labelled_node_only(tmp_path):
    from pipeline.data.synthetic import write_synthetic_shards

    shards = write_synthetic_shards(tmp_path, 48, samples_per_shard=4, image_size=32, num_classes=4, seed=3)
    # Free ports for the head's agents: the defaults may be held by another Ray on the machine.
    ports = head_ports("dashboard_port")
    result = subprocess.run(
        [sys.executable, "-c", CLUSTER, json.dumps(shards.urls), json.dumps(ports)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    console = result.stdout
    assert result.returncode == 0, console[-3000:] + result.stderr[-3000:]
    runs = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in console.splitlines()
            if line.startswith(("labelled ", "any "))}  # fmt: skip
    decode, other = (
        console.split("decode node ", 1)[1].split()[0],
        console.split("other node ", 1)[1].split()[0],
    )
    for run in runs.values():
        assert run["rows"] == 48 and run["errors"] == 0, run
        assert run["tasks"] == len(shards.urls), run  # one read task per shard, each seen
        # Read and decode fused into one task: decode ran where the read ran.
        assert run["names"] == ["ReadTarShard->MapBatches(preprocess_batch)"], run
    # With the label: every read + decode task on the decode node.
    assert runs["labelled"]["nodes"] == [decode], (runs, decode, other)
    # Without it the larger unlabelled node takes tasks too: the check above can fail.
    assert other in runs["any"]["nodes"], (runs, decode, other)
