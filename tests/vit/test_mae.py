"""Masked autoencoding: the encoder on visible patches, the decoder, the loss on masked patches, learning."""

from __future__ import annotations

import torch

import vit

TINY = "vit_tiny_test"  # 32 px, 8 px patches (N = 16), D = 64, depth 2, 4 heads


def patches(batch: int, seed: int = 0) -> torch.Tensor:
    """Random uint8 patches ``(B, 16, 192)`` in the layout of `vit.patchify`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 16, 192), generator=g, dtype=torch.uint8)


def shuffles(batch: int, n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g) for _ in range(batch)])  # (B, N)


def test_encoder_on_every_patch_by_index_equals_the_plain_forward():
    model = vit.create_model(TINY)
    x = patches(3)
    ids = shuffles(3)
    shuffled = torch.take_along_dim(x, ids[..., None], dim=1)  # (B, N, K), patch j at grid ids[b, j]
    tokens = model.forward_features(shuffled, ids_keep=ids)  # (B, 1+N, D), in the shuffled order
    expected = model.forward_features(x)
    torch.testing.assert_close(tokens[:, 0], expected[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        tokens[:, 1:], torch.take_along_dim(expected[:, 1:], ids[..., None], dim=1), rtol=1e-4, atol=1e-5
    )


def test_encoder_on_a_subset_gets_the_subsets_position_embeddings():
    model = vit.create_model(TINY)
    x = patches(2)
    ids = shuffles(2)[:, :4]  # 4 visible patches of 16
    visible = torch.take_along_dim(x, ids[..., None], dim=1)  # (B, 4, K)
    tokens = model.forward_features(visible, ids_keep=ids)
    assert tokens.shape == (2, 5, model.config.embed_dim)
    # The same patches declared at other positions give other tokens: positions reach the encoder.
    assert not torch.allclose(tokens, model.forward_features(visible, ids_keep=ids.flip(1)))
    tokens.sum().backward()
    touched = model.pos_embed.grad.abs().sum(-1) > 0  # (1+N,)
    expected = torch.zeros(17, dtype=torch.bool)
    expected[0] = True
    expected[1 + ids.flatten()] = True
    assert torch.equal(touched, expected)
