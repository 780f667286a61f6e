"""Hostile ``--weights``: crafted exports, checkpoints and weights files, each refused quickly in one line.

Every folder or file below is made in ``tmp_path`` from the tiny model's own export, then changed in
one place: a config that claims another (or an absurd) model, a safetensors header that lies about its
tensors, weights that are not finite. ``load_model_source`` (what every job's ``--weights`` goes
through) must refuse each with a one-line ValueError, which the jobs turn into exit code 2, in well
under the time a model of the claimed size would take to build: nothing is built larger than the
weights file, and nothing is read past what its header promises.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import vit
from pipeline.model_source import load_model_source
from tests.embed.test_job import trained_model
from vit.weights import CONFIG_FILE, WEIGHTS_FILE

TINY = "vit_tiny_test"  # embed_dim 64, depth 2, mlp_dim 128, patch 8, 4 heads, image 32
FAST_S = 2.0  # the tiny model loads in tens of milliseconds; a refusal takes no longer


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """The tiny model's export; loading it once here also pays the imports before any timing."""
    model = trained_model()
    path = tmp_path_factory.mktemp("export")
    vit.save_pretrained(path, model.state_dict(), model.config)
    assert load_model_source(str(path)).config == model.config
    return path


# --- crafting ---------------------------------------------------------------------------------------


def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    """``(header, data section)`` of a safetensors file."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_safetensors(header: dict | bytes, body: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + body


def with_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        meta = json.loads((folder / CONFIG_FILE).read_text())
        change(meta["model"])
        (folder / CONFIG_FILE).write_text(json.dumps(meta))  # NaN / Infinity written as JSON allows

    return craft


def with_header(change: Callable[[dict, bytes], bytes]) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        header, body = split_safetensors((folder / WEIGHTS_FILE).read_bytes())
        (folder / WEIGHTS_FILE).write_bytes(change(header, body))

    return craft


def with_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / WEIGHTS_FILE)
        change(tensors)
        save_file(tensors, folder / WEIGHTS_FILE)

    return craft


def set_field(field: str, value) -> Callable[[Path], None]:
    return with_config(lambda model: model.__setitem__(field, value))


def poison(value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors["blocks.1.mlp.fc1.weight"][3, 5] = value

    return change


def header_entry(name: str, **fields) -> Callable[[dict, bytes], bytes]:
    def change(header: dict, body: bytes) -> bytes:
        header[name].update(fields)
        return join_safetensors(header, body)

    return change


def far_block(tensors: dict[str, torch.Tensor]) -> None:
    tensors["blocks.99999.norm1.weight"] = torch.ones(64)


EXPORTS = [
    # The config claims another model than the weights hold.
    pytest.param(set_field("depth", 100_000), "depth", id="depth-100000"),
    pytest.param(set_field("depth", 10_000), "depth", id="depth-10000"),
    pytest.param(set_field("depth", 3), "depth", id="depth-3"),
    pytest.param(set_field("embed_dim", 32), "embed_dim", id="embed-dim"),
    pytest.param(set_field("mlp_dim", 1 << 40), "mlp_dim", id="mlp-dim-2**40"),
    pytest.param(set_field("image_size", 2**31), "image_size", id="image-size-2**31"),
    pytest.param(set_field("image_size", 64), "image_size", id="image-size-64"),
    pytest.param(set_field("num_heads", 3), "num_heads", id="heads-not-dividing"),
    pytest.param(set_field("depth", "2"), "depth", id="depth-a-string"),
    # Values no ViT is built with.
    pytest.param(set_field("mean", 5), "mean", id="mean-a-number"),
    pytest.param(set_field("mean", [5, 5, 5]), "mean", id="mean-5"),
    pytest.param(set_field("std", [0.5, math.inf, 0.5]), "std", id="std-inf"),
    pytest.param(set_field("norm_eps", math.nan), "norm_eps", id="norm-eps-nan"),
    pytest.param(set_field("norm_eps", 1e30), "norm_eps", id="norm-eps-1e30"),
    pytest.param(set_field("num_classes", "ten"), "num_classes", id="num-classes-a-string"),
    pytest.param(set_field("depth", [2]), "depth", id="depth-a-list"),
    # A safetensors header that lies about the data after it.
    pytest.param(
        with_header(lambda h, b: join_safetensors(h, b, length=1 << 40)), "header", id="header-too-long"
    ),
    pytest.param(
        with_header(header_entry("cls_token", data_offsets=[0, 1 << 40])), "offsets", id="offsets-outside"
    ),
    pytest.param(with_header(header_entry("cls_token", shape=[65])), "cls_token", id="shape-not-offsets"),
    pytest.param(with_header(header_entry("cls_token", dtype="F99")), "dtype", id="dtype-unknown"),
    pytest.param(with_header(lambda h, b: join_safetensors(b"{not json", b)), "header", id="header-not-json"),
    pytest.param(with_header(lambda h, b: join_safetensors(h, b[:-100])), "", id="data-cut-short"),
    pytest.param(with_header(lambda h, b: b"\x05"), "", id="five-bytes"),
    # Weights that are not finite, and blocks the config does not have.
    pytest.param(with_tensors(poison(math.nan)), "NaN or infinite", id="nan-weight"),
    pytest.param(with_tensors(poison(-math.inf)), "NaN or infinite", id="inf-weight"),
    pytest.param(with_tensors(far_block), "block", id="block-99999"),
    pytest.param(with_tensors(lambda t: t.pop("blocks.1.attn.qkv.weight")), "", id="tensor-missing"),
]


def refused(path: str | Path, match: str, **kwargs) -> ValueError:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as e:
        load_model_source(str(path), **kwargs)
    took = time.perf_counter() - start
    message = str(e.value)
    assert "\n" not in message and 0 < len(message) < 500, message
    assert took < FAST_S, f"refused after {took:.1f} s: {message}"
    return e.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("craft", "match"), EXPORTS)
def test_crafted_exports_are_refused_quickly_in_one_line(export, tmp_path, craft, match):
    folder = tmp_path / "final"
    folder.mkdir()
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        (folder / name).write_bytes((export / name).read_bytes())
    craft(folder)
    refused(folder, match)


# --- the other forms --weights takes: DCP checkpoints, transformers directories, single files -------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint directory as training leaves one, for the model part: DCP shards + config.json."""
    import torch.distributed.checkpoint as dcp

    model = trained_model()
    path = tmp_path_factory.mktemp("run") / "checkpoint_00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    (path / CONFIG_FILE).write_text(json.dumps({"model_config": model.config.to_dict()}))
    assert load_model_source(str(path)).config == model.config
    return path


def hf_layout(sd: dict[str, torch.Tensor], config: vit.ViTConfig) -> dict[str, torch.Tensor]:
    """A vitray state dict as a transformers ViTModel stores it (its pooler is the pretraining head)."""
    p, c = config.patch_size, config.num_channels
    parts = {"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.proj": "attention.output.dense"}
    parts |= {"mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
    out = {
        "embeddings.cls_token": sd["cls_token"].reshape(1, 1, -1),
        "embeddings.position_embeddings": sd["pos_embed"][None],
        "embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"]
        .reshape(-1, p, p, c)
        .permute(0, 3, 1, 2),
        "embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
    }
    for k, v in sd.items():
        block, _, rest = k.removeprefix("blocks.").partition(".")
        name, _, kind = rest.rpartition(".")
        if k.startswith("blocks.") and name == "attn.qkv":
            for part, chunk in zip(("query", "key", "value"), v.chunk(3), strict=True):
                out[f"encoder.layer.{block}.attention.attention.{part}.{kind}"] = chunk
        elif k.startswith("blocks."):
            out[f"encoder.layer.{block}.{parts[name]}.{kind}"] = v
        elif k.startswith(("norm.", "head.pre_logits.")):
            out[k.replace("norm.", "layernorm.").replace("head.pre_logits.", "pooler.dense.")] = v
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    model = vit.create_model(TINY, num_classes=0)
    path = tmp_path_factory.mktemp("hf")
    save_file(hf_layout(model.state_dict(), model.config), path / "model.safetensors")
    c = model.config
    hf_config = {"model_type": "vit", "hidden_size": c.embed_dim, "num_hidden_layers": c.depth}
    hf_config |= {"num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim, "image_size": 32}
    hf_config |= {"patch_size": c.patch_size, "num_channels": 3, "layer_norm_eps": 1e-12, "qkv_bias": True}
    (path / CONFIG_FILE).write_text(json.dumps(hf_config))
    assert load_model_source(str(path)).kind == "hf"
    return path


def hf_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        config = json.loads((folder / CONFIG_FILE).read_text())
        change(config)
        (folder / CONFIG_FILE).write_text(json.dumps(config))

    return craft


def checkpoint_config(field: str, value) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        saved = json.loads((folder / CONFIG_FILE).read_text())
        saved["model_config"][field] = value
        (folder / CONFIG_FILE).write_text(json.dumps(saved))

    return craft


def nan_checkpoint(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = trained_model().state_dict()
    state["pos_embed"][0, 0] = math.nan
    for file in folder.glob("*.distcp"):
        file.unlink()
    dcp.save({"model": state}, checkpoint_id=str(folder), no_dist=True)


def hf_weights(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def craft(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors")

    return craft


FOLDERS = [
    pytest.param("checkpoint", checkpoint_config("depth", 100_000), "depth", id="checkpoint-depth-100000"),
    pytest.param(
        "checkpoint", checkpoint_config("embed_dim", 1 << 20), "embed_dim", id="checkpoint-embed-dim-2**20"
    ),
    pytest.param(
        "checkpoint", checkpoint_config("image_size", 2**31), "image_size", id="checkpoint-image-size"
    ),
    pytest.param(
        "checkpoint", checkpoint_config("norm_eps", math.nan), "norm_eps", id="checkpoint-norm-eps-nan"
    ),
    pytest.param("checkpoint", nan_checkpoint, "NaN or infinite", id="checkpoint-nan-weight"),
    pytest.param(
        "hf_dir", hf_config(lambda c: c.update(num_hidden_layers=100_000)), "depth", id="hf-depth-100000"
    ),
    pytest.param("hf_dir", hf_config(lambda c: c.update(image_size=2**31)), "image_size", id="hf-image-size"),
    pytest.param(
        "hf_dir", hf_config(lambda c: c.update(layer_norm_eps=math.nan)), "norm_eps", id="hf-norm-eps-nan"
    ),
    pytest.param("hf_dir", hf_config(lambda c: c.pop("hidden_size")), "hidden_size", id="hf-no-hidden-size"),
    pytest.param(
        "hf_dir", hf_weights(lambda t: t["layernorm.bias"].fill_(math.inf)), "NaN or infinite", id="hf-inf"
    ),
    pytest.param(
        "hf_dir",
        hf_weights(lambda t: t.__setitem__("encoder.layer.99999.layernorm_before.bias", torch.zeros(64))),
        "block",
        id="hf-layer-99999",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("form", "craft", "match"), FOLDERS)
def test_crafted_checkpoints_and_transformers_dirs_are_refused_quickly_in_one_line(
    request, tmp_path, form, craft, match
):
    folder = tmp_path / request.getfixturevalue(form).name
    shutil.copytree(request.getfixturevalue(form), folder)
    craft(folder)
    refused(folder, match)


def weights_file(name: str, tensors: Callable[[], dict[str, torch.Tensor]], change=None):
    def craft(folder: Path) -> Path:
        from safetensors.torch import save_file

        path = folder / name
        if name.endswith(".safetensors"):
            save_file(tensors(), path)
            if change is not None:
                header, body = split_safetensors(path.read_bytes())
                path.write_bytes(change(header, body))
        else:
            torch.save(tensors(), path)
        return path

    return craft


def timm_tensors(change=None) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        from tests.test_model_source import timm_layout

        model = trained_model()
        tensors = timm_layout(model.state_dict(), model.config)
        if change is not None:
            change(tensors)
        return tensors

    return make


def vitray_tensors(change) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        tensors = dict(trained_model().state_dict())
        change(tensors)
        return tensors

    return make


FILES = [
    pytest.param(
        weights_file(
            "timm.safetensors", timm_tensors(), header_entry("cls_token", data_offsets=[0, 1 << 40])
        ),
        "offsets",
        id="timm-safetensors-offsets-outside",
    ),
    pytest.param(
        weights_file("timm.safetensors", timm_tensors(), header_entry("pos_embed", dtype="I64")),
        "pos_embed",
        id="timm-safetensors-shape-not-offsets",
    ),
    pytest.param(
        weights_file("timm.pth", timm_tensors(poison(math.nan))), "NaN or infinite", id="timm-pth-nan"
    ),
    pytest.param(weights_file("timm.pt", timm_tensors(far_block)), "block", id="timm-pt-block-99999"),
    pytest.param(weights_file("vitray.pth", vitray_tensors(far_block)), "block", id="state-dict-block-99999"),
    pytest.param(
        weights_file(
            "vitray.pth", vitray_tensors(lambda t: t.__setitem__("cls_token", t["cls_token"].long()))
        ),
        "floating point",
        id="state-dict-integer-tensor",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("craft", "match"), FILES)
def test_crafted_weights_files_are_refused_quickly_in_one_line(tmp_path, craft, match):
    refused(craft(tmp_path), match)
