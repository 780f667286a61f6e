"""cluster/: the launcher configs pass Ray's own schema, the RayJob carries what KubeRay requires,
and nothing in them opens the cluster up or holds a credential."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
LAUNCHER_CONFIGS = ["aws.yaml", "gcp.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def pinned(package: str) -> str:
    match = re.search(rf"^{package}==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert match, f"{package} is not pinned in constraints.txt"
    return match.group(1)


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_passes_rays_schema(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    # What `ray up` does: fill the provider's defaults in, then validate against ray-schema.json.
    validate_config(prepare_config(load(name)))


def test_the_schema_check_catches_a_broken_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("aws.yaml")
    config["available_node_types"]["gpu_8x_h100"]["max_workers"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_shape(name):
    config = load(name)
    types = config["available_node_types"]
    assert config["head_node_type"] == "head"
    assert types["head"]["resources"] == {"CPU": 0}
    gpu, cpu = types["gpu_8x_h100"], types["cpu_decode"]
    node = gpu["node_config"]
    assert node.get("InstanceType") == "p5.48xlarge" or (
        node.get("machineType") == "a3-highgpu-8g" and node["guestAccelerators"][0]["acceleratorCount"] == 8
    )
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] and 0 <= cpu["min_workers"] <= cpu["max_workers"]
    assert config["max_workers"] >= gpu["max_workers"] + cpu["max_workers"]
    assert any("-c constraints.txt" in c and "pip install" in c for c in config["setup_commands"])


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_keeps_the_dashboard_local_and_auth_on(name):
    config = load(name)
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    for command in (
        c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c
    ):
        assert "RAY_AUTH_MODE=token" in command
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_rayjob_carries_what_kuberay_requires():
    job = load("kuberay-rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert "jobs/pretrain.py" in spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True and isinstance(spec["ttlSecondsAfterFinished"], int)
    assert spec["submissionMode"] in {"K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode"}
    yaml.safe_load(spec["runtimeEnvYAML"])
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == pinned("ray")
    assert cluster["authOptions"] == {"mode": "token"}
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        # The CRD types rayStartParams as a map of strings: a bare number is rejected by the API server.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c["name"] and c["image"] for c in containers)
    for worker in cluster["workerGroupSpecs"]:
        assert worker["groupName"]
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
    gpu, decode = (group_named(cluster, name) for name in ("gpu-8x", "cpu-decode"))
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "nvidia.com/gpu" not in decode["template"]["spec"]["containers"][0]["resources"]["limits"]


def group_named(cluster: dict, name: str) -> dict:
    return next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == name)


def decode_label() -> dict[str, str]:
    """The label `--decode-nodes` takes in its doc line's example, as Ray's label selector."""
    from pipeline import settings
    from pipeline.data.config import DataConfig

    example = settings.help_of(next(f for f in dataclasses.fields(DataConfig) if f.name == "decode_nodes"))
    label = re.search(r"e\.g\. (\S+=\S+)", example)[1]
    return DataConfig(decode_nodes=label).label_selector


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_decode_nodes_carry_the_label_that_decode_nodes_steers_to(name):
    """The CPU-only decode nodes carry the label of --decode-nodes' example, which Ray accepts as node
    labels (the launcher passes them to `ray start`); the GPU nodes do not carry it, so a job that passes
    --decode-nodes decodes on the decode nodes alone (tests/system/test_cluster_e2e.py)."""
    from ray._private.label_utils import validate_label_key, validate_label_value, validate_node_labels

    types = load(name)["available_node_types"]
    labels = types["cpu_decode"]["labels"]
    assert labels == decode_label()
    validate_node_labels(labels)
    for key, value in labels.items():
        assert validate_label_key(key) is None
        validate_label_value(value)
    for other in ("head", "gpu_8x_h100"):
        assert not set(types[other].get("labels", {}).items()) & set(labels.items()), other


def test_the_rayjobs_decode_pods_carry_the_label_and_the_job_asks_for_them_only_when_they_exist():
    spec = load("kuberay-rayjob.yaml")["spec"]
    cluster = spec["rayClusterSpec"]
    decode = group_named(cluster, "cpu-decode")
    assert decode["labels"] == decode_label()
    assert "labels" not in group_named(cluster, "gpu-8x") and "labels" not in cluster["headGroupSpec"]
    # With no decode pods, a job that steered decoding to them would wait for ever.
    assert decode["replicas"] > 0 or "--decode-nodes" not in spec["entrypoint"]


def test_images_and_versions_agree():
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{pinned('ray')}-" in dockerfile
    assert "-c constraints.txt" in dockerfile


def test_runtime_env_is_valid():
    from ray.runtime_env import RuntimeEnv

    env = RuntimeEnv(**load("runtime_env.yaml"))
    assert ".venv/" in env["excludes"]  # never upload a virtual environment as the working dir


SECRETS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
    re.compile(r"(?i)aws_secret_access_key\s*[:=]"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)RAY_AUTH_TOKEN\s*[:=]\s*\S"),
    re.compile(r'"type":\s*"service_account"'),
]


@pytest.mark.parametrize("path", sorted(p.name for p in CLUSTER.iterdir()))
def test_no_credentials_in_cluster_files(path):
    text = (CLUSTER / path).read_text()
    found = [p.pattern for p in SECRETS if p.search(text)]
    assert not found, f"{path} looks like it holds a credential: {found}"


def test_the_credential_scan_would_see_one():
    assert any(p.search("key: AKIAABCDEFGHIJKLMNOP") for p in SECRETS)
    assert any(p.search("RAY_AUTH_TOKEN=abc123") for p in SECRETS)


def node_images(config: dict) -> dict[str, str]:
    """Node type -> its boot image: AWS ImageId, GCP the boot disk's sourceImage."""
    images = {}
    for name, node_type in config["available_node_types"].items():
        node = node_type["node_config"]
        disks = [d for d in node.get("disks", []) if d.get("boot")]
        images[name] = node.get("ImageId") or (disks[0]["initializeParams"]["sourceImage"] if disks else None)
    return images


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_every_node_type_boots_a_pinned_image(name):
    text = re.sub(r"\s*\n#\s*", " ", (CLUSTER / name).read_text())  # comments as running text
    images = node_images(load(name))
    assert all(images.values()), f"{name}: node types without an image: {images}"
    for image in images.values():
        # A family (GCP) or "latest" resolves to whatever is newest at launch: not pinned.
        assert "/family/" not in image and "latest" not in image.lower(), image
    # Each config says what its image holds and how to pick a newer one.
    assert "Python 3.12" in text and "needs >= 3.11" in text
    assert "A newer image:" in text


def test_the_images_are_the_ones_the_docs_name():
    readme = (ROOT / "docs" / "design.md").read_text()  # "Running on a cluster", "Images"
    aws, gcp = (CLUSTER / "aws.yaml").read_text(), (CLUSTER / "gcp.yaml").read_text()
    assert "Deep Learning Base AMI with Single CUDA (Ubuntu 24.04)" in readme and "20260717" in aws + readme
    assert "ubuntu-2404-lts-amd64" in readme and "ubuntu-2404-lts-amd64" in gcp
    assert f"torch {pinned('torch')}" in readme


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_nodes_install_into_a_virtual_environment_and_run_its_ray(name):
    # Ubuntu 24.04's Python refuses system-wide pip installs (PEP 668).
    config = load(name)
    lists = [config["setup_commands"]] + [
        t["worker_setup_commands"]
        for t in config["available_node_types"].values()
        if "worker_setup_commands" in t
    ]
    for commands in lists:
        assert any("python3 -m venv ~/venv" in c for c in commands)
        assert any("~/venv/bin/python -m pip install -c constraints.txt" in c for c in commands)
    for command in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        assert "ray " not in command.replace("~/venv/bin/ray ", ""), command


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_the_spot_settings_uncommented_pass_rays_schema_on_every_worker_type(name):
    """The spot settings sit commented out beside each worker node type (README, "Spot nodes and
    preemption"); uncommented, the config still passes Ray's schema and every worker type is spot."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    text = re.sub(
        r"^(\s*)# ( *)(InstanceMarketOptions|scheduling:|provisioningModel|instanceTerminationAction)",
        r"\1\2\3",
        (CLUSTER / name).read_text(),
        flags=re.MULTILINE,
    )
    config = yaml.safe_load(text)
    validate_config(prepare_config(config))
    for node_type in ("gpu_8x_h100", "cpu_decode"):
        node = config["available_node_types"][node_type]["node_config"]
        spot = (
            node.get("InstanceMarketOptions", {}).get("MarketType") or node["scheduling"]["provisioningModel"]
        )
        assert spot.lower() == "spot", node_type
