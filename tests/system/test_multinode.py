"""Through node loss on a real Ray cluster of three nodes on one machine (one cluster for the module, in a
subprocess, token authentication on): pretraining with ``--num-workers 1-3`` loses a node mid-epoch (its
processes killed), goes on with two workers from the latest checkpoint, grows back to three once a node
joins again, and trains every sample of each epoch once; then the embedding job loses a node while it
runs and still writes every key exactly once.

Each node holds 3 CPUs and each worker asks for 2 (``--cpus-per-worker``): one worker a node, whatever
Ray counts, and one CPU a node for its decode (``--data-cpus-per-worker 1``). Batch 12 of micro-batches
of 2 splits over 1, 2 and 3 workers; 12 shards of 6 samples: 6 steps an epoch, a checkpoint every step.
The keys a run trains are recorded by its workers (the worker loop wrapped), a file per rank and attempt;
a step an attempt trained after the checkpoint the next attempt resumed from was trained again there, so
the run's history is, step by step, the last attempt's. After three steps of two workers the run waits at
its next step (a file the wrapped loop checks) until a group of three has started, so that the run cannot
end before Ray Train's check sees the node that joined.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.train.audit import AuditConfig, audit_run
from pipeline.train.observe.goodput import BUCKETS
from tests.system.test_cluster_e2e import head_ports, ray_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = 24  # four epochs of 6 steps or so: room for a loss, a restart, a join and a resize
LOSS_AT = 3  # the node goes once the run has stepped past this step: inside epoch 0

CLUSTER = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    from pathlib import Path
    import ray
    from ray.cluster_utils import Cluster

    runs = json.loads(sys.argv[1])
    keys_dir = Path(runs["keys"])
    hold = keys_dir.parent / "hold"
    began = time.time()

    def event(what, **fields):
        # To a file of their own, a line in one write: on stdout, Ray's forwarded lines, written from
        # another thread, can split a line.
        line = json.dumps({"t": round(time.time() - began, 1), "what": what, **fields})
        with open(keys_dir.parent / "events.jsonl", "a") as f:
            f.write(line + "\\n")
        print("event", line, flush=True)

    def recording_loop(loop_config):
        # The worker loop, each step's keys written before it trains (a file per rank and attempt).
        import json, time
        import torch.distributed as dist
        from pipeline.train import loop

        rank, world = dist.get_rank(), dist.get_world_size()
        attempt = [f"{time.time():.3f}"]
        dist.broadcast_object_list(attempt, 0)
        path = keys_dir / f"{attempt[0]}-{world}-{rank}.jsonl"
        path.touch()

        class Recorder(loop.StepWatch):
            def taken(self, step):
                while hold.exists():  # the run waits for a node to join, rather than ending first
                    time.sleep(0.2)
                row = {"step": step.step, "epoch": step.epoch, "keys": list(step.keys)}
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\\n")

        return loop.train_loop_per_worker(loop_config, Recorder())

    def attempts():
        worlds = {}
        for p in keys_dir.glob("*.jsonl"):
            started, world, _ = p.stem.split("-")
            worlds[started] = int(world)
        return [worlds[k] for k in sorted(worlds)]

    def rows_of_last():
        last = max((p.stem.split("-")[0] for p in keys_dir.glob("*.jsonl")), default=None)
        return min(len(p.read_text().splitlines()) for p in keys_dir.glob(f"{last}-*.jsonl"))

    def last_step():
        rows = [json.loads(l) for p in keys_dir.glob("*.jsonl") for l in p.read_text().splitlines() if l]
        return max((r["step"] for r in rows), default=0)

    def wait(condition, seconds, what):
        deadline = time.time() + seconds
        while not condition():
            if time.time() > deadline:
                event("timed out", waiting_for=what)
                return False
            time.sleep(0.5)
        return True

    def driver_node_removable(cluster):
        # A node with a worker that is not the driver's (the train controller lives on the driver's).
        here = ray.get_runtime_context().get_node_id()
        return [n for n in cluster.worker_nodes if n.node_id != here][0]

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 3, "include_dashboard": True, "dashboard_host": "127.0.0.1", **runs["head_ports"]})
    try:
        cluster.add_node(num_cpus=3)
        cluster.add_node(num_cpus=3)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        from pipeline.train.config import TrainConfig
        from pipeline.train.driver import fit

        config = TrainConfig.from_dict(runs["config"])
        result = {}

        def train():
            began = time.time()
            try:
                result["summary"] = fit(config, runs["shards"], worker_loop=recording_loop)
            except Exception as e:
                result["failed"] = f"{type(e).__name__}: {e}"
            result["wall"] = time.time() - began  # what the run's account of its time must add up to

        trainer = threading.Thread(target=train)
        trainer.start()
        event("started")
        if wait(lambda: last_step() > runs["loss_at"], 300, "the first steps"):
            lost = driver_node_removable(cluster)
            cluster.remove_node(lost, allow_graceful=False)
            event("node removed", at_step=last_step(), attempts=attempts())
            # Three steps (and checkpoints) of the smaller group, then it waits at its next step until
            # Ray Train's check has seen the node that joins and started a group of three.
            if wait(lambda: attempts()[-1:] == [2] and rows_of_last() >= 3, 300, "a group of two"):
                hold.touch()
                event("shrunk", at_step=last_step(), attempts=attempts())
                cluster.add_node(num_cpus=3)
                event("node added", at_step=last_step())
                if wait(lambda: attempts()[-1:] == [3], 300, "a group of three again"):
                    event("grown", at_step=last_step(), attempts=attempts())
        hold.unlink(missing_ok=True)
        trainer.join(timeout=600)
        summary = result.get("summary") or {}
        event("trained", result={k: (v if k == "failed" else v.get("error")) for k, v in result.items()
                                 if k != "wall"},
              attempts=attempts(), alive=trainer.is_alive(), wall=result.get("wall"),
              goodput=summary.get("goodput"))

        # The embedding job as a user runs it, against the same cluster, losing a node while it runs.
        out = Path(runs["embeddings"])
        embed = subprocess.Popen(
            [sys.executable, "jobs/embed.py", "--address", cluster.address, *runs["embed"]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if wait(lambda: len(list(out.glob("*.parquet"))) >= 1 or embed.poll() is not None, 300,
                "the first embeddings"):
            committed, running = len(list(out.glob("*.parquet"))), embed.poll() is None
            cluster.remove_node(driver_node_removable(cluster), allow_graceful=False)
            event("embed node removed", committed=committed, running=running)
        print(embed.communicate(timeout=400)[0], flush=True)
        event("embedded", exit=embed.returncode)
    finally:
        ray.shutdown()
        cluster.shutdown()
    """
)


def history(keys_dir: Path) -> dict[int, tuple[int, list[str]]]:
    """Step -> (epoch, every rank's keys) as the run's history holds it: the attempts in the order they
    began, each one's steps replacing those an earlier attempt trained from the same step on."""
    attempts: dict[str, dict[int, tuple[int, list[str]]]] = collections.defaultdict(dict)
    for path in keys_dir.glob("*.jsonl"):
        started = path.stem.split("-")[0]
        for line in path.read_text().splitlines():
            row = json.loads(line)
            epoch, keys = attempts[started].get(row["step"], (row["epoch"], []))
            attempts[started][row["step"]] = (epoch, keys + row["keys"])
    steps: dict[int, tuple[int, list[str]]] = {}
    for started in sorted(attempts, key=float):
        first = min(attempts[started])
        steps = {step: v for step, v in steps.items() if step < first} | attempts[started]
    return steps


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    from pipeline.data.synthetic import write_synthetic_shards
    from tests.configs import tiny_config

    root = tmp_path_factory.mktemp("multinode")
    shards = write_synthetic_shards(
        root / "shards", 72, samples_per_shard=6, image_size=32, num_classes=4, seed=4
    )
    # The embedding job's: more shards, so that it is still running when the node goes.
    embed_shards = write_synthetic_shards(
        root / "embed_shards", 240, samples_per_shard=5, image_size=32, num_classes=4, seed=5
    )
    config = tiny_config(
        data=",".join(shards.urls), out=str(root / "run"), shared_out=True, num_workers=(1, 3),
        cpus_per_worker=2, data_cpus_per_worker=1, batch_size=12, micro_batch_size=2, max_steps=STEPS,
        checkpoint_every=1, log_every=1, shuffle_buffer=8, prefetch_steps=1, max_failures=3,
        placement_strategy="SPREAD",
    )  # fmt: skip
    (root / "keys").mkdir()
    runs = {
        "head_ports": head_ports("dashboard_port"),
        "config": config.to_dict(),
        "shards": shards.urls,
        "keys": str(root / "keys"),
        "loss_at": LOSS_AT,
        "embeddings": str(root / "embeddings"),
        "embed": [
            "--data", str(embed_shards.dir), "--weights", str(root / "run" / "final"), "--out",
            str(root / "embeddings"), "--batch-size", "4",
        ],
    }  # fmt: skip
    env = ray_env() | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "VITRAY_RESIZE_CHECK_S": "2",  # Ray Train's check for room to grow, every 60 s by default
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",  # a group asked of a node that just died
        "RAY_raylet_start_wait_time_s": "180",  # a node starting on a 2-core machine under load
        # A removed node is marked dead after 3 failed health checks 1 s apart (Ray's default: 5 checks
        # 3 s apart): the run and the embedding job wait that long before they go on without it.
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", CLUSTER, json.dumps(runs)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    console = result.stdout
    written = root / "events.jsonl"
    events = (
        {e["what"]: e for e in map(json.loads, written.read_text().splitlines())} if written.exists() else {}
    )
    (root / "console.txt").write_text(console + result.stderr)
    print(f"multi-node module: {time.perf_counter() - started:.0f} s; events: {events}; console: {root}")
    assert result.returncode == 0, console[-4000:] + result.stderr[-4000:]
    return {
        "console": console,
        "events": events,
        "root": root,
        "shards": shards,
        "embed_shards": embed_shards,
    }


def test_training_goes_on_through_a_node_loss_and_grows_back_when_a_node_joins(cluster_run):
    console, events = cluster_run["console"], cluster_run["events"]
    assert events["trained"]["result"] == {"summary": ""}, (events, console[-4000:])
    # 3 workers, a node killed inside epoch 1: 2 workers; a node back: 3 again, and the run finishes.
    assert events["node removed"]["at_step"] > LOSS_AT and events["node removed"]["attempts"] == [3]
    assert "shrunk" in events and "grown" in events, (events, console[-4000:])
    worlds = events["trained"]["attempts"]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3, worlds
    # One line per resize: the sizes, why, and the step it resumed at, with the global batch kept.
    shrunk = re.search(r"workers: from 3 to 2 \(1 lost: a node left or a worker died\); resuming at step (\d+), "
                       r"the batch kept at 12 = 2 x 2 x 3 accumulation \(was x 2\)", console)  # fmt: skip
    grown = re.search(
        r"workers: from 2 to 3 \(room for 1 more: nodes joined\); resuming at step (\d+)", console
    )
    assert shrunk and grown, console[-6000:]
    assert int(shrunk[1]) <= int(grown[1]) < STEPS

    steps = history(cluster_run["root"] / "keys")
    assert sorted(steps) == list(range(1, STEPS + 1))  # every step trained, in the history once
    by_epoch = collections.defaultdict(list)
    for epoch, keys in steps.values():
        by_epoch[epoch] += keys
    every = collections.Counter(cluster_run["shards"].keys)
    # An epoch's steps vary with the resizes (its streams' tails): the last may be cut by --max-steps.
    *complete, last = sorted(by_epoch)
    assert complete == list(range(len(complete))) and len(complete) >= 3, sorted(by_epoch)
    for epoch in complete:  # every sample of each epoch trained once, none twice
        assert collections.Counter(by_epoch[epoch]) == every, epoch
    assert not collections.Counter(by_epoch[last]) - every  # none twice, none unknown
    rows = [
        json.loads(line) for line in (cluster_run["root"] / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    # Where its time went adds up to the wall clock of the run (within a second: the driver's clock read
    # around the run and inside it), none of it below zero, and shows the node loss's work trained again.
    goodput, wall = events["trained"]["goodput"], events["trained"]["wall"]
    assert sum(goodput[f"{b}_s"] for b in BUCKETS) == pytest.approx(wall, abs=1.0), (goodput, wall)
    assert (
        goodput["wall_s"] == pytest.approx(wall, abs=1.0) and min(goodput[f"{b}_s"] for b in BUCKETS) > -1e-6
    )
    assert goodput["lost_steps"] >= 1 and goodput["lost_s"] > 0 and goodput["attempts"] >= 3, goodput
    assert goodput["startup_s"] > 0 and goodput["productive_s"] > 0 and goodput["checkpoint_s"] > 0, goodput
    assert (cluster_run["root"] / "run" / "goodput.png").stat().st_size > 10_000
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one history, no step twice
    assert (cluster_run["root"] / "run" / "final" / "weights.safetensors").exists()
    report = audit_run(AuditConfig(run=str(cluster_run["root"] / "run")))  # what its ledger holds, too
    assert report.ok and report.finished == len(complete), report.format()


def test_the_embedding_job_writes_every_key_once_through_a_node_loss(cluster_run):
    console, events = cluster_run["console"], cluster_run["events"]
    shards = cluster_run["embed_shards"]
    removed = events.get("embed node removed")
    assert removed and removed["running"] and removed["committed"] < len(shards.urls), (
        events,
        console[-4000:],
    )
    assert events["embedded"]["exit"] == 0, console[-4000:]
    out = cluster_run["root"] / "embeddings"
    keys = pq.read_table(out).column("key").to_pylist()
    assert sorted(keys) == sorted(shards.keys)  # every key, no duplicate row
    manifest = json.loads((out / "_manifest.json").read_text())
    assert sum(s["rows"] for s in manifest["shards"].values()) == len(keys)
    assert sorted(manifest["shards"]) == sorted(shards.urls)
