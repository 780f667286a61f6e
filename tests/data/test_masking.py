"""The MAE mask as a data stage: seeded per sample, only visible patches as encoder input, bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.data.config import DataConfig, sample_seed
from pipeline.data.dataset import build_dataset, rebatch
from pipeline.data.masking import bytes_per_sample, mask_batch, mask_seed, num_visible

CONFIG = DataConfig(image_size=32, patch_size=8, shuffle_buffer=0, mask_ratio=0.75)  # N = 16, n = 4


def patch_rows(count: int, *, seed: int = 0, url: str = "shard-0.tar") -> dict[str, np.ndarray]:
    """``count`` rows of random uint8 patches ``(16, 192)``, keys ``k0``, ``k1``, ..."""
    rng = np.random.default_rng(seed)
    return {
        "key": np.array([f"k{i}" for i in range(count)], dtype=object),
        "url": np.array([url] * count, dtype=object),
        "patches": rng.integers(0, 256, (count, 16, 192), dtype=np.uint8),
        "label": np.arange(count, dtype=np.int64),
        "error": np.array([""] * count, dtype=object),
    }


def ids_by_key(batch: dict[str, np.ndarray]) -> dict[str, list[int]]:
    return {str(k): ids.tolist() for k, ids in zip(batch["key"], batch["ids_shuffle"], strict=True)}


def test_only_visible_patches_are_the_encoder_input_and_masked_ones_are_the_rest():
    rows = patch_rows(5)
    out = mask_batch(rows, config=CONFIG, epoch=0)
    assert "patches" not in out
    assert set(out) == {"key", "url", "label", "error", "visible", "masked", "ids_shuffle"}
    assert out["visible"].shape == (5, 4, 192) and out["visible"].dtype == np.uint8
    assert out["masked"].shape == (5, 12, 192) and out["masked"].dtype == np.uint8
    assert out["ids_shuffle"].shape == (5, 16) and out["ids_shuffle"].dtype == np.int16
    for b in range(5):
        ids = out["ids_shuffle"][b]
        assert sorted(ids.tolist()) == list(range(16))  # a permutation: every patch exactly once
        np.testing.assert_array_equal(out["visible"][b], rows["patches"][b][ids[:4]])
        np.testing.assert_array_equal(out["masked"][b], rows["patches"][b][ids[4:]])
    np.testing.assert_array_equal(out["label"], rows["label"])


def test_a_samples_mask_is_a_pure_function_of_seed_epoch_url_and_key():
    rows = patch_rows(8)
    whole = ids_by_key(mask_batch(rows, config=CONFIG, epoch=0))
    # Other batch boundaries and another order within the batch: the same mask per sample.
    halves = {}
    for part in (slice(4, 8), slice(0, 4)):
        reversed_rows = {k: v[part][::-1] for k, v in rows.items()}
        halves.update(ids_by_key(mask_batch(reversed_rows, config=CONFIG, epoch=0)))
    assert halves == whole
    assert len({tuple(v) for v in whole.values()}) == 8  # samples differ from each other
    next_epoch = ids_by_key(mask_batch(rows, config=CONFIG, epoch=1))
    other_seed = ids_by_key(mask_batch(rows, config=dataclasses.replace(CONFIG, seed=1), epoch=0))
    other_shard = ids_by_key(mask_batch(patch_rows(8, url="shard-1.tar"), config=CONFIG, epoch=0))
    for changed in (next_epoch, other_seed, other_shard):
        assert sum(changed[k] != whole[k] for k in whole) >= 7  # 16! masks: a repeat is a bug
    # The same shard under another root (the data copied elsewhere): the same masks.
    moved = patch_rows(8, url="s3://bucket/copy/shard-0.tar")
    assert ids_by_key(mask_batch(moved, config=CONFIG, epoch=0, root="s3://bucket/copy/")) == whole
    # Its own stream: the same sample's crop seed is not reused for the mask.
    assert mask_seed(0, 0, "shard-0.tar", "k0") != sample_seed(0, 0, "shard-0.tar", "k0")


def test_visible_count_follows_the_paper_and_bad_ratios_are_refused():
    assert num_visible(196, 0.75) == 49  # ViT-B/16 at 224: 49 tokens reach the encoder
    assert num_visible(256, 0.75) == 64
    assert num_visible(10, 0.8) == 2  # 10 * (1 - 0.8) is 1.999... in floats
    for ratio in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            num_visible(196, ratio)
        with pytest.raises(ValueError, match="mask_ratio"):
            DataConfig(mask_ratio=ratio)
    with pytest.raises(ValueError, match="leaves 0 of 16 patches visible"):
        num_visible(16, 0.95)
    with pytest.raises(ValueError, match="needs DataConfig"):
        mask_batch(patch_rows(1), config=dataclasses.replace(CONFIG, mask_ratio=None), epoch=0)


def test_bytes_per_sample_say_what_travels_with_and_without_the_mask():
    sizes = bytes_per_sample(DataConfig(image_size=224, patch_size=16), mask_ratio=0.75)
    assert sizes["unmasked"] == {"patches": 196 * 768, "label": 8}
    assert sizes["masked"] == {"visible": 49 * 768, "masked": 147 * 768, "ids_shuffle": 196 * 2, "label": 8}
    # The targets travel too: masking adds the indices and saves only in the encoder's input.
    assert sizes["masked_total"] - sizes["unmasked_total"] == 392
    assert sizes["encoder_input_masked"] * 4 == sizes["encoder_input_unmasked"]


# --- through Ray -------------------------------------------------------------------------------


def test_training_datasets_mask_in_the_read_task_and_keep_the_crops(ray_session, synthetic_shards):
    urls = synthetic_shards.urls
    ds = build_dataset(urls, CONFIG, train=True, epoch=2)
    blocks = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    rows = _concat(blocks)
    assert "ReadTarShard->MapBatches(preprocess_batch)->MapBatches(mask_batch)" in ds.stats()
    assert "patches" not in rows and rows["visible"].shape == (48, 4, 192)
    # Put back in grid order, the masked rows are exactly the unmasked dataset's patches.
    plain_config = dataclasses.replace(CONFIG, mask_ratio=None)
    plain = _concat(build_dataset(urls, plain_config, train=True, epoch=2).iter_batches(batch_size=None))
    assert list(rows["key"]) == list(plain["key"])
    restored = np.empty_like(plain["patches"])
    shuffled = np.concatenate([rows["visible"], rows["masked"]], axis=1)
    np.put_along_axis(restored, rows["ids_shuffle"].astype(np.int64)[:, :, None], shuffled, axis=1)
    np.testing.assert_array_equal(restored, plain["patches"])
    # The consumer's batching takes masked rows as they are.
    assert [b["visible"].shape for b in rebatch(iter(blocks), 8)] == [(8, 4, 192)] * 6
    # Evaluation never masks, whatever the config says (the embedding job reuses training configs).
    assert "patches" in _concat(build_dataset(urls[:1], CONFIG, train=False).iter_batches(batch_size=None))


def _concat(batches) -> dict[str, np.ndarray]:
    batches = list(batches)
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}
