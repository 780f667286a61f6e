"""Native-aspect input to the ViT and the MAE (`vit.model`, `vit.mae`, `vit.pos_embed.sample_pos_embed`):
a square image on the model's own grid computes what the square path computes, padding changes no real
token, and each image's position embeddings are the bicubic resampling a resolution change makes."""

from __future__ import annotations

import pytest
import torch

import vit
from vit.mae import create_mae, sincos_pos_embed
from vit.pos_embed import resample_pos_embed, sample_pos_embed


def grid_coords(gh: int, gw: int) -> torch.Tensor:
    """(row, col) of a gh x gw grid, row-major: ``(gh*gw, 2)``."""
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    return torch.stack([rows, cols], dim=-1).reshape(-1, 2)


def native_batch(grids: list[tuple[int, int]], width: int, patch_dim: int, seed: int = 0):
    """Random images of these grids as one padded batch: patches, coords, mask, grid (padding random too)."""
    g = torch.Generator().manual_seed(seed)
    b = len(grids)
    patches = torch.randint(0, 256, (b, width, patch_dim), dtype=torch.uint8, generator=g)
    coords = torch.randint(0, 9, (b, width, 2), generator=g).to(torch.int16)  # padding: anything
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i, (gh, gw) in enumerate(grids):
        coords[i, : gh * gw] = grid_coords(gh, gw)
        mask[i, : gh * gw] = True
    return patches, coords, mask, torch.tensor(grids, dtype=torch.int16)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("pool", ["cls", "gap"])
@pytest.mark.parametrize("head", ["pretrain", "finetune"])
def test_a_square_image_on_the_models_own_grid_computes_what_the_square_path_computes(pool, head):
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", image_size=32, num_classes=5, pool=pool, head=head).eval()
    with torch.no_grad():  # a classifier that is not zero, so the logits say something
        torch.nn.init.normal_(model.head.fc.weight)
    side = model.config.grid_size
    patches, coords, mask, grid = native_batch([(side, side)] * 3, side * side, model.config.patch_dim)
    with torch.no_grad():
        square = model.forward_features(patches)
        native = model.forward_features(patches, coords=coords, mask=mask, grid=grid)
        assert rel_error(native, square) <= 1e-5
        assert rel_error(model(patches, coords, mask, grid), model(patches)) <= 1e-5
        embedded = model.embed(patches, pre_logits=True, coords=coords, mask=mask, grid=grid)
        assert rel_error(embedded, model.embed(patches, pre_logits=True)) <= 1e-5
        # The encoder's input itself is the square path's, to the bit.
        tokens = model.prepare_tokens(patches, coords=coords, grid=grid)
        assert torch.equal(tokens, model.prepare_tokens(patches))


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_padding_changes_no_real_tokens_output(pool):
    """The same images padded to two lengths, with random patches and coordinates in the padding, beside
    other images of other grids: every real token's output, and every embedding, is the same."""
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", image_size=32, num_classes=0, pool=pool).eval()
    k = model.config.patch_dim
    grids = [(3, 7), (5, 4), (1, 12), (4, 4)]
    short = native_batch(grids, 21, k, seed=1)
    longer = native_batch(grids, 33, k, seed=2)
    longer[0][:, :21] = short[0]  # the same images; padding, and the slots past 21, differ
    longer[1][:, :21] = torch.where(short[2][..., None], short[1], longer[1][:, :21])
    with torch.no_grad():
        a = model.forward_features(short[0], coords=short[1], mask=short[2], grid=short[3])
        b = model.forward_features(longer[0], coords=longer[1], mask=longer[2], grid=longer[3])
        real = torch.cat([torch.ones(4, 1, dtype=torch.bool), short[2]], dim=1)  # [CLS] and the patches
        torch.testing.assert_close(b[:, :22][real], a[real], rtol=1e-5, atol=1e-6)
        alone = model.embed(short[0][:1, :21], coords=short[1][:1, :21], mask=short[2][:1], grid=short[3][:1])
        embedded = model.embed(*longer[:1], coords=longer[1], mask=longer[2], grid=longer[3])
        torch.testing.assert_close(embedded[:1], alone, rtol=1e-5, atol=1e-6)  # its batch-mates: no matter


@pytest.mark.parametrize("grid", [(3, 11), (16, 4), (1, 20), (7, 9), (12, 12), (2, 2), (5, 1)])
def test_each_token_gets_the_position_embedding_a_resolution_change_to_its_grid_gives(grid):
    torch.manual_seed(0)
    pos_embed = torch.randn(1 + 8 * 8, 16)
    expected = resample_pos_embed(pos_embed, grid)[1:]  # (gh*gw, D): F.interpolate, bicubic
    coords = grid_coords(*grid)[None]
    got = sample_pos_embed(pos_embed[1:], (8, 8), coords, torch.tensor([grid]))[0]
    assert rel_error(got, expected) <= 1e-5


def test_gradients_reach_the_position_grid_through_the_resampling():
    model = vit.create_model("vit_tiny_test", image_size=32, num_classes=3)
    with torch.no_grad():
        torch.nn.init.normal_(model.head.fc.weight)
    patches, coords, mask, grid = native_batch([(2, 6), (6, 2)], 12, model.config.patch_dim)
    model(patches, coords, mask, grid).sum().backward()
    assert model.pos_embed.grad is not None and model.pos_embed.grad[1:].abs().sum() > 0


def test_native_input_is_refused_in_one_line_where_it_cannot_work():
    model = vit.create_model("vit_tiny_test", image_size=32)
    patches, coords, mask, grid = native_batch([(2, 3)], 6, model.config.patch_dim)
    with pytest.raises(ValueError, match="takes coords, mask and grid together"):
        model.forward_features(patches, coords=coords, mask=mask)
    with pytest.raises(ValueError, match=r"needs coords of shape \(1, 6, 2\)"):
        model.forward_features(patches, coords=coords[:, :4], mask=mask, grid=grid)
    hybrid = vit.create_model("vit_r_tiny_test")
    with pytest.raises(ValueError, match="needs a plain ViT"):
        hybrid.forward_features(patches, coords=coords, mask=mask, grid=grid)


def mae_native_inputs(ids: torch.Tensor, patches: torch.Tensor, n: int, side: int):
    """A square batch's MAE input as native-aspect slots: the same visible and masked patches, their
    coordinates in ``ids``' order, every slot real."""
    b, total = ids.shape
    coords = grid_coords(side, side)[ids]  # (B, N, 2)
    mask = torch.ones(b, total, dtype=torch.bool)
    return coords, mask, torch.full((b, 2), side, dtype=torch.int16)


def test_a_square_image_through_the_native_mae_path_has_the_square_paths_loss():
    torch.manual_seed(0)
    mae = create_mae("vit_tiny_test", image_size=32, mae=vit.MAEConfig(32, 1, 4)).eval()
    side = mae.encoder.config.grid_size
    total, n = side * side, 4
    patches = torch.randint(0, 256, (3, total, mae.encoder.config.patch_dim), dtype=torch.uint8)
    ids = torch.stack([torch.randperm(total) for _ in range(3)])
    shuffled = torch.take_along_dim(patches, ids[..., None], dim=1)
    visible, masked = shuffled[:, :n], shuffled[:, n:]
    coords, mask, grid = mae_native_inputs(ids, patches, n, side)
    with torch.no_grad():
        square = mae(visible, masked, ids)
        native = mae(visible, masked, coords, mask, grid)
    assert rel_error(native, square) <= 1e-5
    # The decoder's codes of a square grid's coordinates are its fixed table's rows, to the bit.
    table = sincos_pos_embed(32, side)[1:]
    assert torch.equal(vit.mae.sincos_codes(32, grid_coords(side, side)), table)


def test_padding_changes_no_native_mae_loss():
    """Two images of other grids, their visible and masked slots padded by two amounts with random
    contents: the per-image losses are the same."""
    torch.manual_seed(0)
    mae = create_mae("vit_tiny_test", image_size=32, mae=vit.MAEConfig(32, 1, 4)).eval()
    k = mae.encoder.config.patch_dim
    grids, visible_n = [(2, 5), (3, 3)], [2, 2]

    def batch(pad: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        wide_v, wide_m = 2 + pad, 8 + pad
        visible = torch.randint(0, 256, (2, wide_v, k), dtype=torch.uint8, generator=g)
        masked = torch.randint(0, 256, (2, wide_m, k), dtype=torch.uint8, generator=g)
        coords = torch.randint(0, 5, (2, wide_v + wide_m, 2), generator=g).to(torch.int16)
        mask = torch.zeros(2, wide_v + wide_m, dtype=torch.bool)
        for i, ((gh, gw), v) in enumerate(zip(grids, visible_n, strict=True)):
            order = torch.randperm(gh * gw, generator=torch.Generator().manual_seed(i))
            places = grid_coords(gh, gw)[order]
            real = torch.Generator().manual_seed(10 + i)
            pixels = torch.randint(0, 256, (gh * gw, k), dtype=torch.uint8, generator=real)[order]
            visible[i, :v], masked[i, : gh * gw - v] = pixels[:v], pixels[v:]
            coords[i, :v], coords[i, wide_v : wide_v + gh * gw - v] = places[:v], places[v:]
            mask[i, :v], mask[i, wide_v : wide_v + gh * gw - v] = True, True
        return visible, masked, coords, mask, torch.tensor(grids, dtype=torch.int16)

    with torch.no_grad():
        a, b = mae(*batch(0, 1)), mae(*batch(5, 2))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
