"""A checkpoint's scores in one process (`pipeline.evaluate.checkpoint_probe.score`): the probe sets'
bad samples and bad shards, as the embedding job treats them. That the scores equal ``jobs/embed.py`` +
``jobs/evaluate.py`` run by hand: tests/system/test_probe.py and tests/system/test_objectives.py."""

from __future__ import annotations

import pytest

from pipeline import storage
from pipeline.data.bad_samples import BadSampleBudgetError
from pipeline.data.synthetic import encode, render, write_synthetic_shards
from pipeline.data.writing import tar_bytes
from pipeline.evaluate.checkpoint_probe import score


@pytest.fixture(scope="module")
def probe_sets(tmp_path_factory):
    """(4 shards of 40 labeled images, a shard of 6 good ones and a truncated JPEG, a shard of zeros)."""
    root = tmp_path_factory.mktemp("probe_sets")
    shards = write_synthetic_shards(root / "sets", 160, samples_per_shard=40, image_size=32, num_classes=4)
    members = []
    for i in range(6):
        pixels, label = render(100 + i, image_size=32, num_classes=4)
        members += [(f"good{i}.cls", str(label).encode()), (f"good{i}.jpg", encode(pixels))]
    members += [("cut.cls", b"1"), ("cut.jpg", encode(render(7, image_size=32, num_classes=4)[0])[:40])]
    corrupt, zeros = root / "corrupt-000000.tar", root / "zeros-000000.tar"
    corrupt.write_bytes(tar_bytes(members))
    zeros.write_bytes(bytes(4096))  # a download that saved nothing: no tar, no sample
    return shards.urls, str(corrupt), str(zeros)


def test_a_corrupt_sample_is_skipped_and_counted_and_a_shard_without_one_fails_the_probe_in_one_line(
    probe_sets, tiny_export_32px
):
    urls, corrupt, zeros = probe_sets
    weights = storage.as_location(tiny_export_32px)
    scores = score(weights, train=",".join([*urls[:3], corrupt]), test=urls[3])
    assert (scores["probe_images"], scores["probe_eval_images"], scores["probe_bad_samples"]) == (126, 40, 1)
    assert 0 <= scores["knn_accuracy"] <= 1 and 0 <= scores["probe_accuracy"] <= 1

    with pytest.raises(BadSampleBudgetError) as lost:
        score(weights, train=",".join([*urls[:3], zeros]), test=urls[3])
    assert zeros in str(lost.value) and "gave no readable sample" in str(lost.value)
    assert "\n" not in str(lost.value)
    with pytest.raises(
        ValueError, match=r"--probe-data and --probe-eval-data were embedded from 1 of the same"
    ):
        score(weights, train=",".join(urls[:3]), test=urls[2])


def test_a_native_aspect_models_probe_embeds_its_sets_as_the_embedding_job_does(
    probe_sets, tiny_export_32px, tmp_path, monkeypatch
):
    """A run with --patches native: its checkpoints carry that preprocessing, and the probe embeds both
    sets with it, as ``jobs/embed.py --weights CHECKPOINT`` does (that `run_in_process` gives the embedding
    job's native rows: tests/embed/test_job.py)."""
    import vit
    from pipeline.data.config import DataConfig
    from pipeline.embed import job

    state, config = vit.load_pretrained(tiny_export_32px, as_state_dict=True)
    native = DataConfig(image_size=32, patch_size=8, patches="native", max_patches=20)
    vit.save_pretrained(tmp_path, state, config, extra={"preprocessing": native.to_dict()})
    seen, embed = [], job.run_in_process

    def run_in_process(plan):
        seen.append((plan.data_config.patches, plan.data_config.max_patches))
        return embed(plan)

    monkeypatch.setattr(job, "run_in_process", run_in_process)
    urls, _, _ = probe_sets
    scores = score(storage.as_location(str(tmp_path)), train=",".join(urls[:3]), test=urls[3])
    assert seen == [("native", 20), ("native", 20)]
    assert (scores["probe_images"], scores["probe_eval_images"]) == (120, 40)
