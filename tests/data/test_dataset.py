"""The chained pipeline: DataConfig, shard order, and Ray datasets over tiny shards (shared local Ray)."""

from __future__ import annotations

import collections
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from pipeline.data import dataset
from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples, LabelsMissingError
from pipeline.data.config import DataConfig, shard_order
from pipeline.data.consumed import Consumed
from pipeline.data.dataset import build_dataset, check_shards, iter_batches, micro_batches
from pipeline.data.decode import transform_image
from pipeline.data.shards import ShardError
from pipeline.data.synthetic import write_synthetic_shards
from pipeline.data.tar import Sample, iter_samples
from pipeline.data.writing import tar_bytes
from vit.patchify import unpatchify

ROOT = Path(__file__).resolve().parents[2]
CONFIG = DataConfig(image_size=32, patch_size=8, shuffle_buffer=16)


def collect(ds) -> dict[str, np.ndarray]:
    batches = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}


def images_by_key(urls: list[str]) -> dict[str, bytes]:
    out = {}
    for url in urls:
        with open(url, "rb") as f:
            out.update({s.key: s.members["jpg"] for s in iter_samples(f)})
    return out


# --- without Ray -------------------------------------------------------------------------------


def test_config_rejects_bad_values_in_one_line_that_names_the_flag_and_what_to_give():
    for kwargs, words in [
        ({"image_size": 30, "patch_size": 8}, "not divisible by patch_size"),
        ({"scale": (0.5, 0.1)}, "--crop-scale 0.5,0.1 must be MIN,MAX with 0 < MIN <= MAX <= 1, e.g. 0.08,1"),
        ({"ratio": (2, 1)}, "--crop-ratio 2,1 must be MIN,MAX with 0 < MIN <= MAX, e.g. 0.75,1.33"),
        ({"crop_fraction": 0}, "^--crop-fraction must be in \\(0, 1\\], got 0$"),
        ({"max_bad_fraction": 2}, "^--max-bad-fraction must be in \\[0, 1\\], got 2$"),
        ({"max_lost_shards": -1}, "^--max-lost-shards must be from 0 to 2,147,483,647, got -1$"),
        ({"shuffle_buffer": -1}, "^--shuffle-buffer must be from 0 to 2,147,483,647, got -1$"),
        ({"block_rows": 0}, "^--block-rows must be from 1 to 2,147,483,647, got 0$"),
        ({"read_attempts": 0}, "^--read-attempts must be from 1 to 10, got 0$"),
        ({"read_backoff_s": -1}, "^--read-backoff-s must be in \\[0, 60\\], got -1$"),
        ({"patch_size": 0}, "^DataConfig: patch_size must be from 1 to 65,536, got 0$"),
        (
            {"train_interpolation": "fancy"},
            "^--train-interpolation must be one of nearest, box, .*, got 'fancy'$",
        ),
    ]:
        with pytest.raises(ValueError, match=words) as info:
            DataConfig(**kwargs)
        assert "\n" not in str(info.value)


def test_decode_nodes_is_one_node_label_as_rays_label_selector():
    assert DataConfig().label_selector is None  # the default: decode on any node
    assert DataConfig(decode_nodes="vitray/role=decode").label_selector == {"vitray/role": "decode"}
    assert DataConfig(decode_nodes="pool=cpu-1").label_selector == {"pool": "cpu-1"}
    for bad in ("vitray/role", "role=", "=decode", "a=b,c=d", "role=de code", "Role/x=y", "role=-x"):
        with pytest.raises(
            ValueError, match=f"--decode-nodes '{bad}' must be one node label KEY=VALUE"
        ) as info:
            DataConfig(decode_nodes=bad)
        assert "\n" not in str(info.value)


def test_a_models_stored_preprocessing_never_says_where_to_decode():
    trained = DataConfig(decode_nodes="vitray/role=decode").to_dict()  # as an export or checkpoint stores it
    assert DataConfig.for_eval(trained, image_size=32, patch_size=8).label_selector is None
    given = DataConfig.for_eval(trained, image_size=32, patch_size=8, decode_nodes="pool=cpu")
    assert given.label_selector == {"pool": "cpu"}
    # A run's own settings (fine-tuning's evaluation) keep theirs.
    own = DataConfig(decode_nodes="pool=cpu")
    assert DataConfig.for_eval(own, image_size=32, patch_size=8).label_selector == {"pool": "cpu"}


def test_labels_required_without_a_label_key_make_every_sample_bad_never_silently_unlabeled():
    spec = DataConfig(label_key=None, require_labels=True).row_spec
    assert spec.label(Sample("k", {"jpg": b""})) == (-1, "missing label: no label key given")
    assert DataConfig(label_key=None, require_labels=False).row_spec.label(Sample("k", {"jpg": b""})) == (
        -1,
        "",
    )


def test_config_round_trips_and_redacts_secrets():
    config = DataConfig(
        image_size=64,
        label_key="json:label",
        storage_options={"key": "AKIA", "secret": "s3cr3t", "client_kwargs": {"endpoint_url": "http://x"}},
    )
    saved = json.loads(json.dumps(config.to_dict()))
    # The names of the options set, no value (a header or a connection string under any name is one).
    assert saved["storage_options"] == {"key": "***", "secret": "***", "client_kwargs": "***"}
    again = DataConfig.from_dict(saved, storage_options=config.storage_options)
    assert again == config
    assert DataConfig.from_dict(saved).storage_options is None  # redacted values are never used
    with pytest.raises(ValueError, match="no field"):
        DataConfig.from_dict({**saved, "colour": 1})


def test_shard_order_is_a_pure_function_of_seed_and_epoch():
    shards = [f"s3://b/train-{i:06d}.tar" for i in range(16)]
    first = shard_order(shards, seed=7, epoch=0)
    assert sorted(first) == shards and first != shards
    assert shard_order(shards, seed=7, epoch=0) == first
    assert shard_order(list(shards), 7, 1) != first
    assert shard_order(shards, 8, 0) != first
    assert len({tuple(shard_order(shards, 7, e)) for e in range(10)}) == 10


def test_the_data_side_imports_without_ray():
    code = "import sys; sys.modules['ray'] = None; import pipeline, pipeline.data, pipeline.data.bad_samples"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})


def test_a_ranks_training_pipeline_is_quiet_and_held_to_its_cpu_share(monkeypatch):
    from ray.data import DataContext

    built = []  # datasets that are only their own context: no Ray needed

    def build(shards, config, *, train, epoch=0, root=None, skip=None):
        built.append(SimpleNamespace(context=DataContext()))
        return built[-1]

    monkeypatch.setattr(dataset, "build_dataset", build)
    monkeypatch.setattr(
        dataset, "iter_batches", lambda ds, size, config, **kw: iter([{"label": np.zeros(size)}])
    )
    bad = BadSamples.from_config(CONFIG)
    taken = dataset.micro_batches(
        ["a.tar"], CONFIG, epoch=0, rank=0, size=2, bad_samples=bad, data_cpus=1.5, root=""
    )
    assert len(list(taken)) == 1
    context = built[0].context
    assert not context.enable_progress_bars and not context.print_on_execution_start
    assert context.execution_options.resource_limits.cpu == 1.5
    assert DataContext().print_on_execution_start  # a fresh context is not quieted: only this dataset's
    evaluation = SimpleNamespace(context=DataContext())  # fine-tuning's evaluation takes the same
    assert dataset.for_one_rank(evaluation, 0.5) is evaluation and not evaluation.context.enable_progress_bars


def test_check_shards_fails_fast_on_unlabeled_or_imageless_shards(tmp_path, synthetic_shards):
    check_shards(synthetic_shards.urls, CONFIG)
    unlabeled = tmp_path / "unlabeled.tar"
    unlabeled.write_bytes(tar_bytes([(f"{i:04d}.jpg", b"J") for i in range(20)]))
    with pytest.raises(ShardError, match=r"carries no label member \.cls"):
        check_shards([str(unlabeled)], CONFIG)
    check_shards([str(unlabeled)], DataConfig(label_key=None, require_labels=False))
    texts = tmp_path / "texts.tar"
    texts.write_bytes(tar_bytes([(f"{i:04d}.txt", b"T") for i in range(3)]))
    with pytest.raises(
        ShardError, match=r"holds no image member .* name its image extension with --image-keys"
    ):
        check_shards([str(texts)], CONFIG)


def test_check_shards_refuses_a_label_key_that_reads_no_label(synthetic_shards):
    check_shards(synthetic_shards.urls, CONFIG.replace(label_key="json:label"))  # the shards' .json field
    with pytest.raises(ShardError) as info:
        check_shards(synthetic_shards.urls, CONFIG.replace(label_key="json:missing"))
    assert str(info.value) == (
        f"shard {synthetic_shards.urls[0]}: 12 of the first 12 labels are unreadable (key '00000000': .json "
        "member has no field 'missing'); check --label-key (cls, or json:FIELD for a field of the .json "
        "member), or fix the labels"
    )


def test_check_shards_takes_one_unreadable_label_among_readable_ones_as_a_bad_sample(tmp_path):
    # One .cls of 2**63 among good labels is that sample's error row, not a wrong --label-key.
    shard = tmp_path / "one_bad.tar"
    labels = [b"1", str(2**63).encode(), b"0", b"1"]
    shard.write_bytes(
        tar_bytes(
            [
                (f"{i:04d}.{ext}", b"J" if ext == "jpg" else labels[i])
                for i in range(4)
                for ext in ("jpg", "cls")
            ]
        )
    )
    config = DataConfig(image_size=32, patch_size=8, num_classes=2)
    assert config.max_bad_fraction * 4 < 1  # the budget alone would refuse it
    check_shards([str(shard)], config)
    with shard.open("rb") as f:
        samples = list(iter_samples(f))
    assert [config.row_spec.label(s)[1].split(":")[0] for s in samples] == ["", "bad label", "", ""]
    every_bad = tmp_path / "every_bad.tar"
    every_bad.write_bytes(
        tar_bytes(
            [(f"{i:04d}.{ext}", b"J" if ext == "jpg" else b"x") for i in range(4) for ext in ("jpg", "cls")]
        )
    )
    with pytest.raises(ShardError, match=r"4 of the first 4 labels are unreadable .*check --label-key"):
        check_shards([str(every_bad)], config)


def test_check_shards_says_a_file_that_is_not_a_tar_is_not_one(tmp_path, synthetic_shards):
    empty, text, noise = tmp_path / "empty.tar", tmp_path / "text.tar", tmp_path / "noise.tar"
    empty.write_bytes(b"")
    text.write_bytes(b"not a tar\n")
    noise.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(
        ShardError, match=r"^shard \S+empty.tar is empty \(no tar member\); point at WebDataset"
    ):
        check_shards([str(empty)], CONFIG)
    for url in (text, noise):
        with pytest.raises(
            ShardError, match=r"is not a readable tar archive \((truncated|corrupt) tar: "
        ) as info:
            check_shards([str(url)], CONFIG)
        assert str(url) in str(info.value) and "\n" not in str(info.value)
    gzipped = tmp_path / "gzipped.tar"  # a gzipped shard is one
    gzipped.write_bytes(gzip.compress(Path(synthetic_shards.urls[0]).read_bytes()))
    check_shards([str(gzipped)], CONFIG)


def test_check_shards_fails_fast_when_the_first_labels_pass_the_class_count(tmp_path, synthetic_shards):
    from pipeline.train.config import TrainConfig

    train = TrainConfig().replace(num_classes=3, shards="unused", out="unused")
    assert train.data_for(16).num_classes == 3  # the training run's head size reaches the data stage
    first = synthetic_shards.urls[0]
    labels = {synthetic_shards.labels[k] for k in images_by_key([first])}
    check_shards([first], DataConfig(**{**CONFIG.to_dict(), "num_classes": max(labels) + 1}))
    with pytest.raises(ShardError, match=r"labels are out of range .*set --num-classes") as info:
        check_shards([first], DataConfig(**{**CONFIG.to_dict(), "num_classes": max(labels)}))
    assert "\n" not in str(info.value)
    # One stray label among 20 is a bad sample for the budget, not a wrong class count.
    one_off = tmp_path / "one_off.tar"
    members = [
        (f"{i:04d}.{ext}", b"J" if ext == "jpg" else b"1") for i in range(20) for ext in ("jpg", "cls")
    ]
    one_off.write_bytes(tar_bytes([("0000.jpg", b"J"), ("0000.cls", b"7"), *members[2:]]))
    check_shards(
        [str(one_off)], DataConfig(**{**CONFIG.to_dict(), "num_classes": 2, "max_bad_fraction": 0.1})
    )
    with pytest.raises(ShardError, match="1 of the first 16 labels"):
        check_shards([str(one_off)], DataConfig(**{**CONFIG.to_dict(), "num_classes": 2}))


# --- with Ray ----------------------------------------------------------------------------------


def test_eval_rows_arrive_once_in_shard_order_with_labels_and_exact_patches(ray_session, synthetic_shards):
    from ray.data import DataContext

    order = shard_order(synthetic_shards.urls, seed=0, epoch=3)
    ds = build_dataset(order, CONFIG, train=False)
    rows = collect(ds)
    expected_keys = [key for url in order for key in sorted(images_by_key([url]))]
    assert list(rows["key"]) == expected_keys  # shard by shard as given, tar order inside
    assert [str(u) for u in rows["url"]] == [url for url in order for _ in range(12)]
    assert list(rows["label"]) == [synthetic_shards.labels[k] for k in expected_keys]
    assert set(rows["error"]) == {""}
    assert rows["patches"].shape == (48, 16, 8 * 8 * 3) and rows["patches"].dtype == np.uint8
    images = images_by_key(synthetic_shards.urls)
    for key, patches in zip(rows["key"], rows["patches"], strict=True):
        direct = transform_image(images[key], CONFIG, train=False, rng=None)
        np.testing.assert_array_equal(unpatchify(patches, 8, (4, 4)), direct)
    assert ds.context.execution_options.preserve_order
    assert not DataContext.get_current().execution_options.preserve_order  # global context untouched
    assert "ReadTarShard->MapBatches(preprocess_batch)" in ds.stats()  # decode fused into the read


def test_train_crops_depend_on_epoch_not_on_scheduling(ray_session, synthetic_shards):
    urls = synthetic_shards.urls
    serial = collect(
        build_dataset(urls, DataConfig(**{**CONFIG.to_dict(), "read_concurrency": 1}), train=True)
    )
    parallel = collect(build_dataset(urls, CONFIG, train=True))
    np.testing.assert_array_equal(serial["patches"], parallel["patches"])
    # Another shard order (as another epoch's order or another rank's slice would give): every sample
    # still gets its own crop, compared key by key.
    reordered = collect(build_dataset(urls[::-1], CONFIG, train=True))
    assert list(reordered["key"]) != list(serial["key"])
    by_key = dict(zip(reordered["key"], reordered["patches"], strict=True))
    assert sorted(by_key) == sorted(serial["key"])
    for key, patches in zip(serial["key"], serial["patches"], strict=True):
        np.testing.assert_array_equal(by_key[key], patches, err_msg=key)
    later = collect(build_dataset(urls, CONFIG, train=True, epoch=1))
    assert list(later["key"]) == list(serial["key"])
    assert not np.array_equal(later["patches"], serial["patches"])


def test_block_size_is_this_datasets_own_and_order_survives_small_blocks(ray_session, synthetic_shards):
    from ray.data import DataContext

    small = DataConfig(image_size=32, patch_size=8, block_bytes=16_000)  # about 5 rows of patches
    blocks = list(build_dataset(synthetic_shards.urls, small, train=False).iter_batches(batch_size=None))
    assert len(blocks) >= 2 * len(synthetic_shards.urls)  # one block per shard with the default size
    assert [k for b in blocks for k in b["key"]] == synthetic_shards.keys
    assert DataContext.get_current().target_max_block_size != small.block_bytes


def test_local_shuffle_is_seeded_by_epoch_and_rank(ray_session, synthetic_shards):
    ds = build_dataset(synthetic_shards.urls, CONFIG, train=False)

    def keys(**kw):
        return [k for b in iter_batches(ds, 8, CONFIG, **kw) for k in b["key"]]

    plain = keys(epoch=0, shuffle=False)
    shuffled = keys(epoch=0, shuffle=True)
    assert sorted(shuffled) == sorted(plain) == synthetic_shards.keys and shuffled != plain
    assert keys(epoch=0, shuffle=True) == shuffled
    assert keys(epoch=0, rank=1, shuffle=True) != shuffled
    later = keys(epoch=1, shuffle=True)
    assert sorted(later) == sorted(plain) and later not in (plain, shuffled)
    assert keys(epoch=1, shuffle=True) == later


@pytest.fixture(scope="module")
def corrupt_shards(tmp_path_factory):
    """Two shards: one with every kind of bad sample between good ones, one cut short mid-member."""
    out = tmp_path_factory.mktemp("corrupt")

    def jpeg(color, size=48):
        buf = io.BytesIO()
        Image.new("RGB", (size, size), color).save(buf, format="JPEG")
        return buf.getvalue()

    noise = np.random.default_rng(0).integers(0, 256, (160, 160, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="JPEG", quality=95)
    cut_jpeg = buf.getvalue()[: len(buf.getvalue()) // 2]

    good = {f"good{i}": jpeg((40 * i, 100, 200)) for i in range(6)}
    bad = [
        ("bad-empty", [("jpg", b""), ("cls", b"1")], "empty image"),
        ("bad-garbage", [("jpg", bytes(range(256)) * 4), ("cls", b"1")], "undecodable image"),
        ("bad-text", [("jpg", b"hello, I am text"), ("cls", b"1")], "undecodable image"),
        ("bad-cut", [("jpg", cut_jpeg), ("cls", b"1")], "truncated image"),
        ("bad-bomb", [("jpg", jpeg((9, 9, 9), 200)), ("cls", b"1")], "image too large"),
        ("bad-noimage", [("cls", b"1"), ("txt", b"caption")], "missing image"),
        ("bad-nolabel", [("jpg", jpeg((5, 5, 5)))], "missing label"),
        ("bad-dup", [("cls", b"1"), ("jpg", jpeg((5, 5, 5))), ("jpg", jpeg((6, 6, 6)))], "duplicate member"),
    ]
    members = []
    for i, (key, data) in enumerate(good.items()):
        members += [(f"{key}.cls", str(i).encode()), (f"{key}.jpg", data)]
        if i < len(bad):
            members += [(f"{bad[i][0]}.{ext}", value) for ext, value in bad[i][1]]
    members += [(f"{key}.{ext}", value) for key, parts, _ in bad[len(good) :] for ext, value in parts]
    first = out / "a-000000.tar"
    first.write_bytes(tar_bytes(members))
    second_members = [
        (f"tail{i}.{ext}", jpeg((i, i, i)) if ext == "jpg" else b"2")
        for i in range(4)
        for ext in ("cls", "jpg")
    ]
    raw = tar_bytes(second_members)
    cut = raw.find(b"tail3.jpg") + 512 + 100  # inside tail3's image
    second = out / "a-000001.tar"
    second.write_bytes(raw[:cut])
    expected = {key: category for key, _, category in bad} | {"tail3": "truncated tar"}
    good_keys = {**{k: i for i, k in enumerate(good)}, **{f"tail{i}": 2 for i in range(3)}}
    return [str(first), str(second)], expected, good_keys


def test_each_bad_sample_is_counted_with_key_and_reason_and_neighbours_arrive(ray_session, corrupt_shards):
    urls, expected, good_keys = corrupt_shards
    config = DataConfig(image_size=32, patch_size=8, max_image_pixels=30_000, max_bad_fraction=1.0)
    bad = BadSamples.from_config(config)
    batches = list(
        iter_batches(
            build_dataset(urls, config, train=True), 4, config, epoch=0, shuffle=False, bad_samples=bad
        )
    )
    arrived = {str(k): int(label) for b in batches for k, label in zip(b["key"], b["label"], strict=True)}
    assert arrived == good_keys
    recorded = {e["key"]: e["reason"].split(":")[0] for e in bad.examples}
    assert recorded == expected
    assert (bad.total, bad.bad) == (len(good_keys) + len(expected), len(expected))
    assert all(e["url"] in urls and e["reason"] for e in bad.examples)


def test_the_budget_fails_a_job_that_passes_it(ray_session, corrupt_shards):
    urls, _, _ = corrupt_shards
    config = DataConfig(
        image_size=32, patch_size=8, max_image_pixels=30_000, max_bad_fraction=0.2, bad_grace_samples=10
    )
    ds = build_dataset(urls, config, train=False)
    with pytest.raises(BadSampleBudgetError, match=r"max_bad_fraction 20\.0%"):
        for _ in iter_batches(
            ds, 4, config, epoch=0, shuffle=False, bad_samples=BadSamples.from_config(config)
        ):
            pass


def test_a_labeled_run_over_unlabeled_shards_fails_clearly(ray_session, tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (40, 40), "red").save(buf, format="PNG")
    path = tmp_path / "u-000000.tar"
    path.write_bytes(tar_bytes([(f"{i:04d}.png", buf.getvalue()) for i in range(20)]))
    ds = build_dataset([str(path)], CONFIG, train=False)
    with pytest.raises(LabelsMissingError, match="look unlabeled"):
        list(iter_batches(ds, 8, CONFIG, epoch=0, shuffle=False, bad_samples=BadSamples.from_config(CONFIG)))


def test_tar_gz_reads_like_tar(ray_session, tmp_path, synthetic_shards):
    gz = write_synthetic_shards(
        tmp_path, 48, samples_per_shard=12, image_size=64, num_classes=4, seed=0, gzip=True
    )
    assert all(u.endswith(".tar.gz") for u in gz.urls)
    plain = collect(build_dataset(synthetic_shards.urls, CONFIG, train=False))
    zipped = collect(build_dataset(gz.urls, CONFIG, train=False))
    assert list(zipped["key"]) == list(plain["key"]) and list(zipped["label"]) == list(plain["label"])
    np.testing.assert_array_equal(zipped["patches"], plain["patches"])
    assert set(zipped["error"]) == {""}


def test_a_rank_stream_passes_over_the_consumed_samples_and_names_every_other_one(
    ray_session, synthetic_shards
):
    """The read stage's ``skip`` (a resume at another world size): each shard's consumed samples never
    arrive, every other one does, once, with its place in the shard; the last row read of each shard
    says the shard's size (12 samples)."""
    urls = synthetic_shards.urls[:2]
    skip = {urls[0]: Consumed().add([0, 1, 2, 5, 11]), urls[1]: Consumed().add(range(6))}
    bad = BadSamples.from_config(CONFIG)
    stream = micro_batches(
        urls, CONFIG, epoch=0, rank=0, size=4, bad_samples=bad, data_cpus=1.0, root="", skip=skip
    )
    rows = collections.Counter()
    sizes = {}
    for batch in stream:
        for url, index, size in zip(batch["url"], batch["index"], batch["shard_size"], strict=True):
            rows[(url, int(index))] += 1
            if size >= 0:
                sizes[url] = int(size)
    expected = {(url, i) for url in urls for i in range(12) if i not in skip[url]}
    assert rows == collections.Counter(expected) and sizes == {url: 12 for url in urls}
    assert bad.total == len(expected)  # consumed samples are not counted again
