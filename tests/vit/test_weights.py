"""The export format: weights.safetensors + config.json, and its errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import vit
from vit.weights import CONFIG_FILE, WEIGHTS_FILE

TINY = "vit_tiny_test"


@pytest.fixture
def trained():
    """A tiny model with no zero tensors left, standing for trained weights."""
    torch.manual_seed(0)
    model = vit.create_model(TINY, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def patches(batch: int = 2, size: int = 32) -> torch.Tensor:
    images = torch.randint(
        0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    return vit.patchify(images, 8)


def test_round_trip(tmp_path, trained):
    extra = {"training": {"steps": 12, "loss": 1.5}}
    vit.save_pretrained(tmp_path, trained.state_dict(), trained.config, extra=extra)
    assert (tmp_path / WEIGHTS_FILE).exists() and not list(tmp_path.glob("*.tmp"))
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert meta["training"] == extra["training"]
    assert meta["preprocessing"]["mean"] == [0.485, 0.456, 0.406] and meta["preprocessing"]["patch_size"] == 8
    for path in (tmp_path, tmp_path / WEIGHTS_FILE, tmp_path / CONFIG_FILE):
        model, config = vit.load_pretrained(path)
        assert config == trained.config
        with torch.no_grad():
            torch.testing.assert_close(model(patches()), trained(patches()), rtol=0, atol=0)
        assert all(p.requires_grad and not p.is_meta for p in model.parameters())
    state_dict, _ = vit.load_pretrained(tmp_path, as_state_dict=True)
    assert state_dict.keys() == trained.state_dict().keys()
    assert vit.load_config(tmp_path)[1]["training"]["steps"] == 12


def test_vit_reads_and_writes_local_directories_only(tmp_path, trained):
    # Staging an export to or from a store is pipeline.storage's (tests/test_model_source.py reads one
    # from S3); vit refuses a URL in one line rather than reaching the network itself.
    url = "memory://vitray-test/final"
    for call in (
        lambda: vit.save_pretrained(url, trained.state_dict(), trained.config),
        lambda: vit.load_pretrained(url),
        lambda: vit.load_config(url),
    ):
        with pytest.raises(
            ValueError, match="is not a local directory: vit reads and writes local exports only"
        ):
            call()
    vit.save_pretrained(f"file://{tmp_path}", trained.state_dict(), trained.config)
    model, config = vit.load_pretrained(tmp_path)
    assert config == trained.config
    with torch.no_grad():
        torch.testing.assert_close(model(patches()), trained(patches()), rtol=0, atol=0)


def test_loading_for_another_resolution_or_head(tmp_path, trained):
    vit.save_pretrained(tmp_path, trained.state_dict(), trained.config)
    larger, config = vit.load_pretrained(tmp_path, image_size=48)
    assert config.image_size == 48 and larger(patches(size=48)).shape == (2, 10)
    torch.testing.assert_close(larger.pos_embed[0], trained.pos_embed[0])

    finetune, config = vit.load_pretrained(tmp_path, head="finetune", num_classes=3)
    assert (config.head, config.num_classes) == ("finetune", 3)
    assert torch.equal(finetune.head.fc.weight, torch.zeros(3, 64))  # a fresh, zero-init classifier
    with torch.no_grad():
        torch.testing.assert_close(finetune.embed(patches()), trained.embed(patches()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="mean/std are part of the weights"):
        vit.load_pretrained(tmp_path, mean=(0.5, 0.5, 0.5))


def test_weights_that_do_not_fit_the_config_are_one_line_errors(tmp_path, trained):
    vit.save_pretrained(tmp_path, trained.state_dict(), trained.config)
    other = trained.config.replace(embed_dim=32)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**meta, "model": other.to_dict()}))
    with pytest.raises(
        ValueError, match=r"weights.safetensors holds a ViT with embed_dim 64, the config says 32"
    ) as e:
        vit.load_pretrained(tmp_path)
    assert "\n" not in str(e.value)

    deeper = vit.create_model(TINY, depth=3)
    with pytest.raises(ValueError, match="the state dict holds a ViT with depth 3, the config says 2"):
        vit.save_pretrained(tmp_path / "x", deeper.state_dict(), vit.get_config(TINY))
    with pytest.raises(ValueError, match="num_classes 10, the config says 4"):
        vit.save_pretrained(tmp_path / "x", trained.state_dict(), trained.config.replace(num_classes=4))
    with pytest.raises(ValueError, match="normalizes inputs with mean"):
        vit.save_pretrained(tmp_path / "x", trained.state_dict(), vit.get_config(TINY))
    sd = dict(trained.state_dict())
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        vit.save_pretrained(tmp_path / "x", sd, trained.config)
    with pytest.raises(ValueError, match="reserved keys"):
        vit.save_pretrained(tmp_path / "x", trained.state_dict(), trained.config, extra={"model": {}})


def test_missing_exports_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json in"):
        vit.load_pretrained(tmp_path / "nowhere")
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"architectures": ["ViTModel"]}))
    with pytest.raises(ValueError, match="not a vitray export"):
        vit.load_pretrained(tmp_path)


def test_a_saved_sharded_style_state_dict_needs_no_model(tmp_path):
    # What the training job passes: a plain dict of CPU tensors, here in bf16.
    model = vit.create_model(TINY)
    nn.init.normal_(model.head.fc.weight)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    vit.save_pretrained(tmp_path, sd, model.config)
    loaded, _ = vit.load_pretrained(tmp_path)
    assert loaded.head.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.head.fc.weight, sd["head.fc.weight"], rtol=0, atol=0)
