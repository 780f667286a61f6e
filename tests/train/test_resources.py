"""What a run takes from the cluster beside its workers: decode CPUs decided on the workers each epoch
(not frozen at submission, when an autoscaling cluster has no CPUs yet), and a local --out refused
where the workers would write to several disks. No Ray needed: its answers are stood in for."""

from __future__ import annotations

import json

import pytest
import ray

from pipeline.train import driver, resources
from pipeline.train.config import TrainConfig

GPU_RUN = TrainConfig().replace(
    shards="unused", out="s3://bucket/runs/h14", num_workers=16, cpus_per_worker=4.0, use_gpu=True
)


def test_the_budget_is_the_clusters_spare_cpus_shared_by_the_workers():
    # Two p5.48xlarge: 2 x 192 CPUs, 16 workers holding 4 each -> 320 spare -> 20 each.
    assert resources.decode_cpus(GPU_RUN, 16, 384.0)[0] == 20.0
    assert resources.decode_cpus(GPU_RUN, 16, 0.0)[0] == 1.0  # never below 1: a pipeline must move


def test_an_explicit_budget_wins():
    config = GPU_RUN.replace(data_cpus_per_worker=12.0)
    assert resources.decode_cpus(config, 16, 0.0) == (12.0, "--data-cpus-per-worker")
    with pytest.raises(ValueError, match="data-cpus-per-worker"):
        GPU_RUN.replace(data_cpus_per_worker=0.0).validate()


def submitted(monkeypatch, config: TrainConfig) -> dict:
    """What `driver.fit` hands TorchTrainer (no Ray, no store): {"train_loop_config", "run_config"}."""
    captured = {}

    class Trainer:  # stands in for TorchTrainer: records what the driver hands the workers
        def __init__(self, fn, *, train_loop_config, run_config, **kwargs):
            captured.update(train_loop_config=train_loop_config, run_config=run_config)

        def fit(self):
            return type("Result", (), {"return_value": {}})()

    monkeypatch.setattr("ray.train.torch.TorchTrainer", Trainer)
    claimed = []  # the run's marker goes to --out before the workers start (no store here)
    monkeypatch.setattr(driver, "claim_out", lambda config: claimed.append(config.run.out))
    # Nor the run's account of its time, which would wait out the unreachable store's retries.
    monkeypatch.setattr("pipeline.train.observe.goodput.close_session", lambda *args, **kwargs: None)
    driver.fit(config, ["s3://bucket/train-0.tar"])
    assert claimed == [config.run.out]
    return captured


def test_autoscaling_cluster_the_budget_is_not_frozen_at_submission(monkeypatch, capsys):
    """The shipped configs: a head that schedules nothing, GPU nodes with min_workers 0. At submission
    the cluster has 0 CPUs; the workers start once the GPU nodes are up, and decide then."""
    cluster = {"CPU": 0.0}
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(cluster))
    captured = submitted(monkeypatch, GPU_RUN)["train_loop_config"]  # submission: 0 CPUs in the cluster
    assert captured["data_cpus_per_worker"] is None  # no budget decided on the driver

    cluster.update(CPU=384.0, GPU=16.0)  # the autoscaler brought two 8-GPU nodes
    resources._logged_budget.clear()  # a fresh worker process
    config = TrainConfig.from_dict(captured["train"])
    assert resources.data_cpus_per_worker(config, world=16, rank=0, epoch=0) == 20.0
    assert "epoch 0: 20 decode CPUs per worker (384 CPUs in the cluster now" in capsys.readouterr().out
    cluster.update(CPU=384.0 + 4 * 88)  # decode nodes joined: the next epoch uses them
    assert resources.data_cpus_per_worker(config, world=16, rank=3, epoch=1) == 42.0
    assert capsys.readouterr().out == ""  # only rank 0 logs
    assert resources.data_cpus_per_worker(config, world=16, rank=0, epoch=2) == 42.0
    assert "epoch 2: 42 decode CPUs per worker" in capsys.readouterr().out  # changed: logged
    assert resources.data_cpus_per_worker(config, world=16, rank=0, epoch=3) == 42.0
    assert capsys.readouterr().out == ""  # unchanged: no line every epoch


def test_the_workers_get_the_storage_options_that_the_saved_config_redacts(monkeypatch):
    """--storage-options reach every write under --out: the workers' config and Ray Train's storage
    (a filesystem over the run directory's own, options included), while the config Ray Train records
    for its dashboard, and every text of the run directory, show no secret."""
    from ray.train.v2._internal.state.schema import _to_json_serializable_value

    from pipeline.train.config import worker_config

    options = {"key": "AKIA-NOT-SHOWN", "secret": "s3cr3t", "client_kwargs": {"endpoint_url": "http://s3:9"}}
    config = GPU_RUN.replace(storage_options=options)
    captured = submitted(monkeypatch, config)
    loop_config, run_config = captured["train_loop_config"], captured["run_config"]
    assert worker_config(loop_config) == config  # the real options, on every worker
    assert worker_config(loop_config).run_dir.options == options
    assert TrainConfig.from_dict(loop_config["train"]).data.storage_options is None  # redacted there
    recorded = json.dumps(_to_json_serializable_value([loop_config, run_config.storage_filesystem]))
    assert "s3cr3t" not in recorded and "AKIA" not in recorded and "s3://bucket/runs/h14" in recorded
    assert (run_config.storage_path, run_config.name) == ("bucket/runs", "h14")
    handler = run_config.storage_filesystem.handler  # pyarrow over the run directory's fsspec filesystem
    assert handler.fs.storage_options == options and handler.fs.client_kwargs["endpoint_url"] == "http://s3:9"


LOCAL_RUN = TrainConfig().replace(shards="unused", out="/data/runs/exp1", num_workers=2, use_gpu=False)
NODE = {"resources": {"CPU": 8.0}}


@pytest.mark.parametrize(
    ("config", "nodes"),
    [
        (LOCAL_RUN, [NODE]),  # one machine holding every worker: its disk is the run's
        (LOCAL_RUN.replace(out="s3://bucket/runs/exp1"), [NODE, NODE]),
        (LOCAL_RUN.replace(out="gs://bucket/runs/exp1"), [{"resources": {}}]),
        (LOCAL_RUN.replace(shared_out=True), [NODE, NODE, NODE]),  # declared: NFS, EFS, Filestore ...
    ],
)
def test_where_a_run_directory_works(config, nodes):
    assert resources.local_out_problem(config, nodes, resources.worker_resources(config)) is None


@pytest.mark.parametrize(
    ("config", "nodes", "says"),
    [
        (LOCAL_RUN, [NODE, NODE], "the cluster has 2 nodes"),
        # The shipped autoscaling configs at submission: a head with no CPUs or GPUs for tasks.
        (GPU_RUN.replace(out="/data/runs/h14"), [{"resources": {"CPU": 0.0}}], "on nodes this cluster adds"),
        (LOCAL_RUN.replace(out="file:///data/runs/exp1"), [{"resources": {"CPU": 1.0}}], "holds 1 of them"),
    ],
)
def test_a_local_out_on_several_nodes_is_refused(config, nodes, says):
    problem = resources.local_out_problem(config, nodes, resources.worker_resources(config))
    assert problem is not None and says in problem
    assert "--shared-out" in problem and "s3://" in problem  # says what to do
    assert "\n" not in problem


def test_a_shard_group_must_divide_the_workers():
    GPU_RUN.replace(shard_group_size=8).validate()
    with pytest.raises(ValueError, match="shard-group-size 6 does not divide --num-workers 16"):
        GPU_RUN.replace(shard_group_size=6).validate()
