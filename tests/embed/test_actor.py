"""The embedding actor's model: float32 on CPU exactly as before, and the GPU path (bf16 weights,
compiled `embed`) run on CPU, where it must agree with float32 within bf16's precision."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vit
from pipeline.data import native
from pipeline.embed.actor import embed_rows
from pipeline.model_source import inference_model


def rows(n: int, seed: int = 3) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    errors = np.array([""] * n, dtype=object)
    errors[1] = "corrupt"  # a bad row passes through with a zero embedding
    return {
        "key": np.array([f"k{i}" for i in range(n)], dtype=object),
        "url": np.array(["u"] * n, dtype=object),
        "patches": g.integers(0, 256, (n, 16, 192), dtype=np.uint8),
        "label": np.arange(n),
        "error": errors,
    }


@pytest.fixture(scope="module", params=["vit_tiny_test", "vit_r_tiny_test"])
def weights(request) -> tuple[vit.ViTConfig, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = vit.create_model(request.param, num_classes=4)
    return model.config, {k: v.clone() for k, v in model.state_dict().items()}


def test_cpu_default_is_float32_and_exactly_the_plain_forward(weights):
    config, state = weights
    model = inference_model(config, dict(state), torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    batch = rows(6)
    out = embed_rows(model, batch, batch_size=8)["embedding"]
    plain = vit.VisionTransformer(config)
    plain.load_state_dict(state)
    with torch.inference_mode():
        padded = torch.cat(
            [torch.from_numpy(batch["patches"][[0, 2, 3, 4, 5]]), torch.zeros(3, 16, 192, dtype=torch.uint8)]
        )
        expected = plain.eval().embed(padded)[:5].numpy()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[[0, 2, 3, 4, 5]], expected)  # bit for bit
    assert not out[1].any()


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_bf16_weights_agree_with_float32_within_bf16_precision(weights, compile):
    config, state = weights
    reference = inference_model(config, dict(state), torch.device("cpu"))
    model = inference_model(config, dict(state), torch.device("cpu"), dtype=torch.bfloat16, compile=compile)
    blocks = {p.dtype for n, p in model.named_parameters() if not n.startswith("patch_embed.backbone")}
    assert blocks == {torch.bfloat16}
    assert model.patch_embed.mean.dtype == torch.float32  # the input scaling stays float32
    batch = rows(6)
    for pre_logits in (False, True):
        expected = embed_rows(reference, batch, batch_size=4, pre_logits=pre_logits)["embedding"]
        got = embed_rows(model, batch, batch_size=4, pre_logits=pre_logits)["embedding"]
        assert got.dtype == np.float32 and got.shape == expected.shape
        good = [0, 2, 3, 4, 5]
        cosine = F.cosine_similarity(torch.from_numpy(got[good]), torch.from_numpy(expected[good]), dim=1)
        assert cosine.min() > 0.999, cosine
        np.testing.assert_allclose(got[good], expected[good], rtol=0.1, atol=0.05)


def test_native_rows_embed_each_image_as_it_would_be_alone():
    """Native-aspect rows of other grids in one padded batch: each embedding is the image's own, as
    if it were embedded alone without padding, and a bad row still reaches no model."""
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", num_classes=4).eval()
    images = [
        np.full((8 * gh, 8 * gw, 3), 40 * i, np.uint8) for i, (gh, gw) in enumerate([(2, 7), (4, 4), (1, 9)])
    ]
    images[1] = images[1] + np.arange(32, dtype=np.uint8)[:, None, None]
    batch = {
        **native.native_rows([*images, None], 8, 20),
        "key": np.array(["a", "b", "c", "bad"], dtype=object),
        "url": np.array(["u"] * 4, dtype=object),
        "label": np.arange(4),
        "error": np.array(["", "", "", "corrupt"], dtype=object),
    }
    out = embed_rows(model, batch, batch_size=8)["embedding"]
    for i in range(3):
        n = int(batch["mask"][i].sum())
        with torch.inference_mode():
            alone = model.embed(
                torch.from_numpy(batch["patches"][i : i + 1, :n]), coords=torch.from_numpy(batch["coords"][i : i + 1, :n]),
                mask=torch.from_numpy(batch["mask"][i : i + 1, :n]), grid=torch.from_numpy(batch["grid"][i : i + 1]),
            )  # fmt: skip
        np.testing.assert_allclose(out[i], alone[0].numpy(), rtol=1e-5, atol=1e-5)
    assert not out[3].any()
