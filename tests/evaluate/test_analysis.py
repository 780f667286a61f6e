"""The Fig. 7 computations on constructed inputs whose answers are known, and jobs/analyze.py end to end."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

import vit
from pipeline.data.config import DataConfig
from pipeline.data.decode import transform_image
from pipeline.evaluate import analysis
from pipeline.evaluate.attention import attention_distances, mean_attention_distance, patch_distances
from pipeline.evaluate.samples import eval_patches
from tests.job_scripts import load_job

analyze_job = load_job("analyze")  # the job script itself, run in this process (its output captured)

GRID = (3, 4)  # 3 rows x 4 columns of patches
PITCH = 8.0  # pixels per patch


def mean_pairwise_distance(grid: tuple[int, int], pitch: float) -> float:
    """By brute force over every ordered pair of patch positions, self-pairs included."""
    cells = list(itertools.product(range(grid[0]), range(grid[1])))
    return sum(pitch * math.dist(a, b) for a in cells for b in cells) / len(cells) ** 2


def test_a_head_attending_to_itself_has_distance_zero_and_a_uniform_one_the_mean_pairwise():
    n = GRID[0] * GRID[1]
    t = 1 + n
    attention = torch.zeros(2, 3, t, t)  # (B, H, T, T)
    attention[:, 0] = torch.eye(t)  # head 0: every token attends to itself
    attention[:, 1] = 1.0 / t  # head 1: uniform over [CLS] and the patches
    # Head 2: each patch attends to the patch to its right (to its left in the last column), one
    # patch away; half of its weight goes to [CLS], which has no place in the image and is left out.
    for q in range(n):
        row, col = divmod(q, GRID[1])
        neighbour = row * GRID[1] + (col + 1 if col + 1 < GRID[1] else col - 1)
        attention[:, 2, 1 + q, 0] = 0.5
        attention[:, 2, 1 + q, 1 + neighbour] = 0.5
    attention[:, 2, 0, 0] = 1.0
    got = mean_attention_distance(attention, patch_distances(GRID, PITCH))
    np.testing.assert_allclose(got.numpy(), [0.0, mean_pairwise_distance(GRID, PITCH), PITCH], atol=1e-9)


def test_a_model_with_zero_queries_and_keys_attends_uniformly_in_every_layer():
    # qkv weight and bias zero: q . k = 0 for every pair, so softmax is uniform over the 17 tokens.
    model = vit.create_model("vit_tiny_test").eval()  # 32 px, 8 px patches: a 4 x 4 grid, 2 layers, 4 heads
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.zero_()
            block.attn.qkv.bias.zero_()
    x = vit.patchify(torch.randint(0, 256, (5, 32, 32, 3), dtype=torch.uint8), 8)
    distances, seen = attention_distances(model, [x[:3], x[3:]], device=torch.device("cpu"))
    assert seen == 5 and distances.shape == (2, 4)
    np.testing.assert_allclose(distances, mean_pairwise_distance((4, 4), 8.0), rtol=1e-5)


def test_principal_components_of_constructed_filters():
    # D = 4 filters of 2x2x3 = 12 inputs: a shared mean filter plus a_i * u + b_i * v, with u, v
    # orthonormal pixel patterns and a, b orthogonal zero-mean weights, |a| = 6, |b| = 2. So the
    # centered filters are exactly a u^T + b v^T: components u then v (up to sign), variance shares
    # 36/40 and 4/40, and nothing else.
    p, c = 2, 3
    u = np.zeros((p, p, c))
    u[0, 1, 2] = 1.0  # row 0, column 1, blue
    v = np.zeros((p, p, c))
    v[1, 0, 0] = -1.0  # row 1, column 0, red (negative: the sign rule flips it to +1)
    a = np.array([3.0, -3.0, 3.0, -3.0])
    b = np.array([1.0, 1.0, -1.0, -1.0])
    mean = np.linspace(-1, 1, p * p * c)
    filters = mean + np.outer(a, u.reshape(-1)) + np.outer(b, v.reshape(-1))  # (D, P*P*C)
    components, share = analysis.patch_filter_components(filters, p, c, count=28)
    assert components.shape == (4, p, p, c)  # min(28, D, P*P*C) components
    np.testing.assert_allclose(components[0], u, atol=1e-12)
    np.testing.assert_allclose(components[1], -v, atol=1e-12)
    np.testing.assert_allclose(share, [0.9, 0.1, 0.0, 0.0], atol=1e-12)
    with pytest.raises(ValueError, match="not 3x3x3"):
        analysis.patch_filter_components(filters, 3, 3)


def test_position_similarity_of_row_coded_embeddings():
    # Each patch's embedding is the one-hot of its row: similarity 1 within a row, 0 across rows.
    # The [CLS] row (first) is not part of the grid.
    gh, gw = 4, 4
    rows = np.repeat(np.arange(gh), gw)
    pos_embed = np.concatenate([np.full((1, gh), 7.0), 5.0 * np.eye(gh)[rows]])  # (1 + 16, 4)
    similarity = analysis.position_similarity(pos_embed, (gh, gw))
    assert similarity.shape == (gh, gw, gh, gw)
    for r, c, r2, c2 in itertools.product(range(gh), range(gw), range(gh), range(gw)):
        assert similarity[r, c, r2, c2] == pytest.approx(float(r == r2))
    # Adjacent (4-neighbours, 48 ordered pairs): the 24 horizontal ones are in one row, the 24
    # vertical ones are not: 0.5. Distant (>= 2 apart, 156 ordered pairs): 24 share a row: 2/13.
    summary = analysis.similarity_by_neighbourhood(similarity)
    assert summary["adjacent"] == pytest.approx(0.5)
    assert summary["distant"] == pytest.approx(2 / 13)


def test_eval_patches_are_the_first_images_with_the_eval_crop(synthetic_shards):
    config = DataConfig(image_size=32, patch_size=8, label_key=None, require_labels=False)
    patches, bad = eval_patches(synthetic_shards.urls, config, 14)  # more than one 12-image shard
    assert patches.shape == (14, 16, 192) and bad.bad == 0
    import tarfile

    with tarfile.open(synthetic_shards.urls[1]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))  # the 13th image overall
        data = tar.extractfile(member).read()
    expected = vit.patchify(transform_image(data, config, train=False, rng=None), 8)
    np.testing.assert_array_equal(patches[12], expected)


@pytest.fixture
def export(tiny_export_32px):
    return tiny_export_32px


def test_analyze_writes_three_readable_figures_and_the_numbers(export, synthetic_shards, tmp_path, capsys):
    out = tmp_path / "analysis"
    args = f"--weights {export} --data {synthetic_shards.dir} --out {out} --images 5 --batch-size 2 --cpu"
    assert analyze_job.main(args.split()) == 0
    printed = capsys.readouterr().out
    for name in (
        "patch_embedding_filters.png",
        "position_embedding_similarity.png",
        "attention_distance.png",
    ):
        with Image.open(out / name) as image:
            assert image.format == "PNG" and min(image.size) >= 400, name
        assert name in printed.splitlines()[-1]  # one line names every file written ...
    assert printed.splitlines()[-1].endswith(f" to {out}")  # ... and where
    numbers = json.loads((out / "analysis.json").read_text())
    assert numbers["images"] == 5
    distances = np.array(numbers["mean_attention_distance"])
    assert distances.shape == (2, 4)  # [layer][head] of vit_tiny_test
    assert ((distances >= 0) & (distances <= 32 * math.sqrt(2))).all()  # pixels, within the image
    assert numbers["uniform_attention_distance"] == pytest.approx(
        mean_pairwise_distance((4, 4), 8.0), rel=1e-4
    )
    assert set(numbers["position_embedding_similarity"]) >= {"adjacent", "distant"}
    assert len(numbers["patch_embedding_filters"]["variance_share"]) == 28


def test_analyze_bad_input_is_one_line_and_exit_code_2(export, tmp_path, capsys):
    assert (
        analyze_job.main(["--weights", export, "--data", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert analyze_job.main(["--weights", export, "--data", "x", "--out", "y", "--images", "0"]) == 2
    assert capsys.readouterr().err == "error: --images must be from 1 to 2,147,483,647, got 0\n"
