"""Masked autoencoding: the encoder on visible patches, the decoder, the loss on masked patches, learning."""

from __future__ import annotations

import pytest
import torch

import vit
from vit.mae import (
    MAEConfig,
    create_mae,
    encoder_state_dict,
    pixel_targets,
    reconstruction,
    sincos_pos_embed,
    take_patches,
    unshuffle,
)

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
    # A random projection: a plain sum of LayerNorm outputs has no gradient to speak of.
    (tokens * torch.randn(tokens.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    touched = model.pos_embed.grad.abs().sum(-1) > 0  # (1+N,)
    expected = torch.zeros(17, dtype=torch.bool)
    expected[0] = True
    expected[1 + ids.flatten()] = True
    assert torch.equal(touched, expected)


# --- the masked autoencoder --------------------------------------------------------------------

SMALL = MAEConfig(decoder_dim=32, decoder_depth=1, decoder_num_heads=2)


def masked_input(x: torch.Tensor, seed: int = 1, visible: int = 4):
    """What the data stage sends: visible patches, masked patches, ids_shuffle (visible first)."""
    ids = shuffles(x.shape[0], seed=seed)
    return take_patches(x, ids[:, :visible]), take_patches(x, ids[:, visible:]), ids


def smooth_images(batch: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``(B, 32, 32, 3)``: a random colour plus a random linear gradient per image, so a masked
    patch can be told from the visible ones (random noise could only be memorized)."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    slope_x, slope_y = (torch.rand(2, batch, 1, 1, 3, generator=g) * 2 - 1).unbind(0)
    colour = torch.rand(batch, 1, 1, 3, generator=g)
    image = colour + 0.4 * (slope_x * xx[None, :, :, None] + slope_y * yy[None, :, :, None])
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


def test_shapes_and_a_gradient_for_every_parameter():
    torch.manual_seed(0)
    model = create_mae(TINY, mae=SMALL)
    visible, masked, ids = masked_input(patches(3))
    pred = model.predict(visible, ids)
    assert pred.shape == (3, 16, 192)
    assert model.forward_encoder(visible, ids).shape == (3, 5, 64)  # [CLS] + 4 visible, no mask tokens
    losses = model(visible, masked, ids)
    assert losses.shape == (3,) and torch.isfinite(losses).all()
    torch.testing.assert_close(losses, model.forward_loss(pred, masked))
    losses.mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reaches {name}"
    assert {n.split(".")[0] for n, _ in model.named_parameters()} == {"encoder", "decoder"}


def test_the_loss_reads_the_masked_patches_only():
    torch.manual_seed(0)
    model = create_mae(TINY, mae=SMALL)
    x = patches(2)
    visible, masked, ids = masked_input(x)
    pred = model.predict(visible, ids).detach().requires_grad_()
    loss = model.forward_loss(pred, masked).mean()
    # Other pixels at the visible positions, as targets: the masked targets, and the loss, are unchanged.
    other = x.clone()
    for b in range(2):
        other[b, ids[b, :4]] = 255 - other[b, ids[b, :4]]
    assert torch.equal(model.forward_loss(pred, take_patches(other, ids[:, 4:])).mean(), loss)
    # ... and other predictions there change nothing either: no gradient reaches them.
    loss.backward()
    assert torch.all(pred.grad[:, :4] == 0) and pred.grad[:, 4:].abs().sum() > 0
    assert torch.equal(model.forward_loss(pred.detach() + torch.eye(16, 1)[None] * 5, masked).mean(), loss)
    # A changed masked patch does change it (so the checks above can fail).
    other[0, ids[0, 5]] = 255 - other[0, ids[0, 5]]
    assert model.forward_loss(pred, take_patches(other, ids[:, 4:])).mean() != loss


def test_targets_are_normalized_pixels_standardized_per_patch():
    x = patches(2)
    plain = pixel_targets(x, (0.5,) * 3, (0.5,) * 3, norm_pix_loss=False)
    torch.testing.assert_close(plain, x.float() / 127.5 - 1)
    per_patch = pixel_targets(x, (0.5,) * 3, (0.5,) * 3, norm_pix_loss=True)
    torch.testing.assert_close(per_patch.mean(-1), torch.zeros(2, 16), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_patch.var(-1), torch.ones(2, 16), atol=1e-4, rtol=0)


def test_a_tiny_mae_learns_to_reconstruct():
    torch.manual_seed(0)
    model = create_mae(TINY, mae=SMALL)
    visible, masked, ids = masked_input(vit.patchify(smooth_images(16), 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(30):
        loss = model(visible, masked, ids).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Predicting zeros scores ~1 on standardized targets; the decoder does far better from visible ones.
    assert losses[-1] < 0.4 < losses[0], losses


def test_the_encoder_exports_as_a_plain_vit(tmp_path):
    torch.manual_seed(0)
    model = create_mae(TINY, mae=SMALL)
    weights = encoder_state_dict(model.state_dict())
    assert not any(k.startswith("decoder") for k in weights)
    assert "decoder.pos_embed" not in model.state_dict()  # fixed: recomputed, never stored
    vit.save_pretrained(tmp_path, weights, model.encoder.config)
    loaded, _ = vit.load_pretrained(tmp_path)
    assert loaded.config.pool == "gap" and loaded.config.num_classes == 0
    x = patches(2)
    torch.testing.assert_close(loaded.embed(x), model.encoder.embed(x))
    finetune, _ = vit.load_pretrained(tmp_path, head="finetune", num_classes=10)  # as jobs/finetune.py
    assert finetune(x).shape == (2, 10)
    with pytest.raises(ValueError, match="encoder"):
        encoder_state_dict(loaded.state_dict())


def test_built_on_meta_then_initialized_computes_what_a_direct_build_does():
    torch.manual_seed(0)
    direct = create_mae(TINY, mae=SMALL)
    model = create_mae(TINY, mae=SMALL, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    torch.testing.assert_close(model.decoder.pos_embed, direct.decoder.pos_embed)
    model.load_state_dict(direct.state_dict())
    visible, _, ids = masked_input(patches(2))
    torch.testing.assert_close(model.predict(visible, ids), direct.predict(visible, ids))


def test_activation_checkpointing_covers_the_decoder_and_keeps_names():
    from vit.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    model = create_mae(TINY, mae=SMALL)
    names = [n for n, _ in model.named_parameters()]
    visible, masked, ids = masked_input(patches(2))

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = model(visible, masked, ids).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    expected = loss_and_grads()
    apply_activation_checkpointing(model)  # every block in `blocks`: encoder's and decoder's
    assert len(model.blocks) == 3 and [n for n, _ in model.named_parameters()] == names
    assert all(block.forward.__name__ == "run" for block in model.decoder.blocks)  # wrapped
    torch.testing.assert_close(loss_and_grads(), expected)


def test_sincos_positions_are_distinct_and_cls_row_is_zero():
    pos = sincos_pos_embed(32, 4)
    assert pos.shape == (17, 32) and torch.all(pos[0] == 0)
    assert torch.cdist(pos[1:], pos[1:]).add(torch.eye(16)).min() > 0.5  # no two positions alike
    torch.testing.assert_close(pos[1:, :16].reshape(4, 4, 16)[:, 0], pos[1:, :16].reshape(4, 4, 16)[:, 3])


def test_unshuffle_restores_grid_order():
    x = patches(2)
    ids = shuffles(2)
    torch.testing.assert_close(unshuffle(take_patches(x, ids), ids), x)


@pytest.mark.parametrize("norm_pix_loss", [True, False])
def test_a_perfect_prediction_reconstructs_the_image(norm_pix_loss):
    x = vit.patchify(smooth_images(2), 8)
    visible, masked, ids = masked_input(x)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    perfect = torch.cat(
        [torch.zeros(2, 4, 192), pixel_targets(masked, mean, std, norm_pix_loss=norm_pix_loss)], 1
    )
    image = reconstruction(perfect, visible, masked, ids, mean, std, norm_pix_loss=norm_pix_loss)
    assert image.dtype == torch.uint8
    assert (image.int() - x.int()).abs().max() <= 1  # float round trip: at most one grey level


def test_config_is_checked_and_round_trips():
    assert MAEConfig.from_dict(SMALL.to_dict()) == SMALL
    assert SMALL.decoder_config(vit.get_config(TINY)).mlp_dim == 128
    for kwargs, words in [
        ({"decoder_dim": 30, "decoder_num_heads": 3}, "multiple of 4"),
        ({"decoder_dim": 32, "decoder_num_heads": 5}, "not divisible"),
        ({"decoder_depth": 0}, "positive"),
    ]:
        with pytest.raises(ValueError, match=words):
            MAEConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown MAEConfig"):
        MAEConfig.from_dict({"decoder_width": 4})
    model = create_mae(TINY, mae=SMALL)
    with pytest.raises(ValueError, match="at least one visible and one masked"):
        model.predict(patches(1), shuffles(1))


def test_flops_count_the_encoder_on_visible_tokens_and_the_decoder_on_all():
    b16 = vit.get_config("vit_b16")
    parts = vit.mae_flops_breakdown(b16, MAEConfig(), num_visible=49)
    # The encoder's blocks over 1 + 49 tokens are a ViT-B/16's at 112 px (7 x 7 patches).
    at_112 = vit.flops_breakdown(vit.get_config("vit_b16", image_size=112))
    blocks_112 = sum(v for k, v in at_112.items() if k not in ("patch_embed", "head", "backbone"))
    assert parts["encoder_blocks"] == blocks_112
    assert parts["encoder_patch_embed"] == at_112["patch_embed"]
    assert parts["decoder_pred"] == 2 * 196 * 512 * 768
    l16 = vit.get_config("vit_l16")
    assert round(vit.count_mae_flops(l16, MAEConfig(), num_visible=49) / 1e9, 1) == 41.3


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_fsdp_shards_encoder_and_decoder_blocks_and_computes_the_same(param_dtype):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import FSDPModule

    from vit.parallelize import parallelize

    torch.manual_seed(0)
    reference = create_mae(TINY, mae=SMALL)
    visible, masked, ids = masked_input(patches(2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = create_mae(TINY, mae=SMALL, device="meta")
        # What the loop runs on many devices (on one, the whole model is one unit).
        parallelize(model, activation_checkpointing=True, param_dtype=param_dtype, per_block=True)
        assert all(isinstance(block, FSDPModule) for block in model.blocks) and len(model.blocks) == 3
        model.to_empty(device="cpu")
        model.init_weights()
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, reference.state_dict(), options=full)
        losses = model(visible, masked, ids)
        assert losses.dtype == torch.float32
        expected = reference(visible, masked, ids)
        tolerance = {} if param_dtype is None else {"rtol": 0.05, "atol": 0.05}
        torch.testing.assert_close(losses, expected, **tolerance)
        losses.mean().backward()
        assert all(p.grad is not None for p in model.parameters())
        exported = encoder_state_dict(get_model_state_dict(model, options=full))
        assert exported.keys() == vit.create_model(TINY, num_classes=0, head="finetune").state_dict().keys()
    finally:
        dist.destroy_process_group()
