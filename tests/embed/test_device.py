"""Where the embedding model runs: --gpu asks for GPUs whatever the cluster has at submission (after
training, an autoscaling cluster has scaled its GPU nodes down), and device and precision are part of
the output's identity, so CPU fp32 and GPU bf16 rows never share one --out. No Ray, no GPU needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from pipeline.embed import devices, job
from pipeline.embed.config import EmbedConfig

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_and_gpu_embeddings_do_not_mix_in_one_output(synthetic_shards, tiny_export_32px, tmp_path):
    cpu = EmbedConfig(data=str(synthetic_shards.dir), weights=tiny_export_32px, out=str(tmp_path / "emb"))
    plan = job.prepare(cpu)
    assert plan.header["compute"] == {"device": "cpu", "precision": "fp32"}
    plan.output.start(plan.work)  # the manifest of a CPU run is there, as after an interrupted run
    gpu = cpu.replace(use_gpu=True)
    with pytest.raises(ValueError, match=r"another configuration \(compute .*cpu.* there, .*cuda.* now\)"):
        job.prepare(gpu)
    assert job.prepare(gpu.replace(overwrite=True)).header["compute"] == {
        "device": "cuda",
        "precision": "bf16",
    }
    assert job.prepare(cpu).work.pending  # the same device again resumes


@pytest.fixture
def no_cluster_lookup(monkeypatch):
    def refuse():
        raise AssertionError("the device was decided from the cluster at submission")

    monkeypatch.setattr(ray, "cluster_resources", refuse)


CONFIG = EmbedConfig(data="d", weights="w", out="o")


def test_gpu_asks_for_gpus_without_looking_at_the_cluster(no_cluster_lookup, monkeypatch):
    monkeypatch.setattr(devices, "_local_gpus", lambda: 0)  # the driver's machine: a CPU-only head
    assert devices.choose_device(CONFIG, gpu=True, cpu=False, local=False).use_gpu is True
    assert devices.choose_device(CONFIG, gpu=False, cpu=True, local=False).use_gpu is False
    assert devices.choose_device(CONFIG, gpu=False, cpu=False, local=False) is None  # the cluster decides


def test_a_joined_cluster_without_gpus_now_says_how_to_get_them(monkeypatch, capsys):
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    assert devices.gpus_from_cluster(CONFIG).use_gpu is False
    assert "--gpu asks the autoscaler for GPUs" in capsys.readouterr().out


def test_local_runs_decide_from_this_machine(no_cluster_lookup, monkeypatch):
    monkeypatch.setattr(devices, "_local_gpus", lambda: 0)
    assert devices.choose_device(CONFIG, gpu=False, cpu=False, local=True).use_gpu is False
    with pytest.raises(ValueError, match="--gpu on a machine without a CUDA GPU"):
        devices.choose_device(CONFIG, gpu=True, cpu=False, local=True)
    monkeypatch.setattr(devices, "_local_gpus", lambda: 2)
    assert devices.choose_device(CONFIG, gpu=False, cpu=False, local=True).use_gpu is True
    with pytest.raises(ValueError, match="--gpu and --cpu"):
        devices.choose_device(CONFIG, gpu=True, cpu=True, local=True)


def test_the_command_line_takes_gpu(tmp_path):
    args = ["jobs/embed.py", "--data", "s3://b/val-{000000..000063}.tar", "--weights", "w", "--out", "o"]
    env = {**os.environ, "RAY_ADDRESS": "http://127.0.0.1:8265"}  # submitted: print-config connects nowhere
    result = subprocess.run(
        [sys.executable, *args, "--gpu", "--print-config"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["use_gpu"] is True


def test_the_forward_batch_follows_the_device_unless_given():
    config = EmbedConfig(data="x", weights="w", out="o")
    assert config.forward_batch_size() == 64  # CPU: activations in host memory
    assert config.replace(use_gpu=True).forward_batch_size() == 256  # a GPU needs more to stay busy
    assert config.replace(use_gpu=True, batch_size=32).forward_batch_size() == 32
    with pytest.raises(ValueError, match=r"^--batch-size must be from 1 to 2,147,483,647, got 0$"):
        config.replace(batch_size=0).validate()


def test_decode_nodes_reaches_the_data_stage_and_a_bad_one_is_refused_before_the_weights_load():
    import vit
    from pipeline.data.config import DataConfig
    from pipeline.embed.job import eval_data_config
    from pipeline.model_source import ModelSource

    config = EmbedConfig(data="x", weights="w", out="o", decode_nodes="vitray/role=decode")
    config.validate()
    # The weights' stored preprocessing names the training cluster's decode nodes: the flag wins.
    stored = DataConfig(decode_nodes="pool=train").to_dict()
    source = ModelSource(vit.get_config("vit_tiny_test"), {}, "", "export", "w", preprocessing=stored)
    assert eval_data_config(source, config).label_selector == {"vitray/role": "decode"}
    assert eval_data_config(source, config.replace(decode_nodes=None)).label_selector is None
    with pytest.raises(ValueError, match="--decode-nodes 'role' must be one node label KEY=VALUE"):
        config.replace(decode_nodes="role").validate()
