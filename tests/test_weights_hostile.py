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
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import vit
from pipeline.weights import load_model_source
from vit.weights import CONFIG_FILE, WEIGHTS_FILE

TINY = "vit_tiny_test"  # embed_dim 64, depth 2, mlp_dim 128, patch 8, 4 heads, image 32
FAST_S = 2.0  # the tiny model loads in tens of milliseconds; a refusal takes no longer


def tiny_model() -> vit.VisionTransformer:
    torch.manual_seed(0)
    model = vit.create_model(TINY, num_classes=4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """The tiny model's export; loading it once here also pays the imports before any timing."""
    model = tiny_model()
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
