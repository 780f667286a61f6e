"""Shard URL expansion: paths, directories, globs, brace ranges, fsspec URLs, and the one-line errors;
a shard's name (its URL without a signature) and what is named by it: rows, seeds."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pytest

from pipeline.data.config import DataConfig
from pipeline.data.decode import preprocess_batch
from pipeline.data.rows import Retry, RowSpec, read_shard
from pipeline.data.shards import (
    MAX_SHARDS_PER_URL,
    ShardError,
    brace_count,
    dataset_root,
    distinct,
    expand_braces,
    expand_shards,
    shard_id,
    shard_name,
    shard_names,
    split_top_level,
)
from tests.signed_http import SignedStore


@pytest.mark.parametrize(
    ("shards", "root"),
    [
        (["/data/in1k/train-000.tar", "/data/in1k/train-001.tar"], "/data/in1k/"),
        (["/data/in1k/train-000.tar"], "/data/in1k/"),
        (["s3://bucket/in1k/train-000.tar", "s3://bucket/in1k/train-010.tar"], "s3://bucket/in1k/"),
        # A common prefix that ends inside a name stops at the directory above it.
        (["/data/set-a/x.tar", "/data/set-b/x.tar"], "/data/"),
        (["s3://a/x.tar", "s3://b/x.tar"], "s3://"),
        ([], ""),
    ],
)
def test_a_shard_is_named_by_its_path_under_its_dataset_root(shards, root):
    assert dataset_root(shards) == root
    names = [shard_name(url, root) for url in shards]
    assert names == [url[len(root) :] for url in shards] and len(set(names)) == len(shards)
    moved = [url.replace(root, "gs://elsewhere/copy/", 1) for url in shards]
    assert [shard_name(url, dataset_root(moved)) for url in moved] == names


@pytest.fixture
def shard_dir(tmp_path):
    for i in range(5):
        (tmp_path / f"train-{i:06d}.tar").write_bytes(b"")
    (tmp_path / "extra.tar.gz").write_bytes(b"")
    (tmp_path / "old.tgz").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a shard")
    (tmp_path / "sub").mkdir()
    return tmp_path


def test_brace_range_keeps_zero_padding_and_lists_expand_as_a_product():
    assert list(expand_braces("t-{000008..000011}.tar")) == [f"t-{i:06d}.tar" for i in range(8, 12)]
    assert list(expand_braces("t-{8..11}.tar")) == ["t-8.tar", "t-9.tar", "t-10.tar", "t-11.tar"]
    assert list(expand_braces("{a,b}-{0..1}")) == ["a-0", "a-1", "b-0", "b-1"]
    assert list(expand_braces("{a,b{1..2}}")) == ["a", "b1", "b2"]
    assert list(expand_braces("plain.tar")) == ["plain.tar"]
    assert [brace_count(p) for p in ("t-{8..11}.tar", "{a,b}-{0..1}", "{a,b{1..2}}", "x")] == [4, 4, 3, 1]


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        # A million names (the bound), none there: one stat, not a million.
        ("x-{0..999999}.tar", ["shard not found", "x-0.tar"]),
        # Two there, then the first missing one is named (the rest are never made).
        ("train-{000000..999999}.tar", ["shard not found", "train-000005.tar"]),
        # Over the bound: refused before a single name is made (60 s and 2.2 GB without an answer
        # before, and killed by the kernel at 24 GB for the second).
        ("x-{0..9999999}.tar", ["names 10,000,000 shards", "more than the 1,000,000"]),
        ("x-{0..999999999}.tar", ["names 1,000,000,000 shards", "more than the 1,000,000"]),
        ("x-{0..999}-{0..999}-{0..9}.tar", ["names 10,000,000 shards"]),
        ("{a,b}" * 21 + ".tar", [f"names {2**21:,} shards"]),
    ],
)
def test_a_huge_brace_range_fails_at_once_in_one_line(shard_dir, pattern, words):
    with pytest.raises(ShardError) as info:
        expand_shards(f"{shard_dir}/{pattern}")
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_a_range_at_the_bound_is_still_lazy():
    names = expand_braces("t-{0..999999}.tar")  # exactly the bound: accepted, nothing made yet
    assert (next(names), next(names)) == ("t-0.tar", "t-1.tar")
    assert brace_count("t-{0..999999}.tar") == MAX_SHARDS_PER_URL


def test_commas_split_only_outside_braces():
    assert split_top_level("a{1,2},b,c", ",") == ["a{1,2}", "b", "c"]


def test_directory_gives_its_shards_sorted(shard_dir):
    got = expand_shards(str(shard_dir))
    names = [p.rsplit("/", 1)[1] for p in got]
    assert names == ["extra.tar.gz", "old.tgz"] + [f"train-{i:06d}.tar" for i in range(5)]


def test_file_glob_range_and_comma_list(shard_dir, monkeypatch):
    one = str(shard_dir / "train-000002.tar")
    assert expand_shards(one) == [one]
    assert expand_shards(f"file://{one}") == [one]
    assert expand_shards(str(shard_dir / "train-*.tar")) == [
        str(shard_dir / f"train-{i:06d}.tar") for i in range(5)
    ]
    ranged = expand_shards(str(shard_dir / "train-{000001..000003}.tar"))
    assert ranged == [str(shard_dir / f"train-{i:06d}.tar") for i in (1, 2, 3)]
    listed = expand_shards(f"{shard_dir}/train-000004.tar,{shard_dir}/train-{{000000..000001}}.tar")
    assert [p[-10:-4] for p in listed] == ["000004", "000000", "000001"]  # comma order is kept
    assert expand_shards([one, one]) == [one]  # a shard read twice would repeat its samples
    monkeypatch.chdir(shard_dir)
    assert expand_shards("train-000002.tar") == [one]  # relative paths come back absolute


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("train-{000003..000009}.tar", ["shard not found", "train-000005.tar"]),
        ("nothing-here.tar", ["shard not found", "nothing-here.tar"]),
        ("*.parquet", ["matches no files"]),
        ("sub", ["holds no .tar"]),
        ("train-{000001..000003.tar", ["unbalanced braces"]),
        ("train-{000003..000001}.tar", ["runs backwards"]),
    ],
)
def test_a_url_matching_nothing_is_a_one_line_error(shard_dir, pattern, words):
    with pytest.raises(ShardError) as info:
        expand_shards(f"{shard_dir}/{pattern}")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_empty_and_unknown_protocol_are_clear_errors():
    with pytest.raises(ShardError, match="no shard URL"):
        expand_shards(" , ")
    with pytest.raises(ShardError, match="nosuchproto"):
        expand_shards("nosuchproto://bucket/train.tar")


def test_fsspec_urls_expand_with_one_listing_per_directory():
    fs = fsspec.filesystem("memory")
    for i in range(4):
        fs.pipe(f"/bucket/shards/train-{i:06d}.tar", b"")
    fs.pipe("/bucket/shards/readme.md", b"")
    want = [f"memory:///bucket/shards/train-{i:06d}.tar" for i in range(4)]
    assert expand_shards("memory://bucket/shards/train-{000000..000003}.tar") == want
    assert expand_shards("memory://bucket/shards/train-*.tar") == want
    assert expand_shards("memory://bucket/shards") == want
    with pytest.raises(ShardError, match=r"train-000004.tar and 1 more of 6"):
        expand_shards("memory://bucket/shards/train-{000000..000005}.tar")


def test_a_shard_is_named_by_its_url_without_userinfo_query_string_or_fragment():
    assert shard_id("https://acct.blob.core.windows.net/c/train-000.tar?sv=2024&sig=a%2Fb") == (
        "https://acct.blob.core.windows.net/c/train-000.tar"
    )
    assert shard_id("https://user:pw@host/d/x.tar.gz?X-Amz-Signature=1#f") == "https://host/d/x.tar.gz"
    assert shard_id("/data/what?.tar") == "/data/what?.tar"  # a local name: "?" is a character of it
    signed = [f"https://host/in1k/train-00{i}.tar?se=2030&sig=s{i}%2Fx" for i in range(3)]
    local = [f"/data/in1k/train-00{i}.tar" for i in range(3)]
    # A query string with slashes in it moves neither the dataset's root nor a shard's name in it.
    assert dataset_root(signed) == "https://host/in1k/"
    assert shard_names(signed) == shard_names(local) == ["train-000.tar", "train-001.tar", "train-002.tar"]
    assert shard_names([url.replace("sig=s", "sig=renewed") for url in signed]) == shard_names(signed)
    assert [shard_name(url, dataset_root(signed)) for url in signed] == shard_names(local)


def test_one_shard_signed_twice_is_refused_and_a_url_given_twice_read_once():
    a1, a2 = "https://h/d/a.tar?sig=1", "https://h/d/a.tar?sig=2"
    assert distinct([a1, "https://h/d/b.tar", a1]) == [a1, "https://h/d/b.tar"]
    with pytest.raises(ShardError, match=r"shard https://h/d/a\.tar is given twice") as info:
        distinct([a1, a2])
    assert "sig=" not in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def signed_store(synthetic_shards):
    store = SignedStore(Path(synthetic_shards.dir)).start()
    yield store
    store.stop()


def test_signed_shards_expand_read_and_seed_crops_by_their_names(signed_store, synthetic_shards):
    """Shards read through signed URLs: the URL whole reads them (the store refuses any other), their
    rows name them without the signature, and a training crop is the one their local copy gets."""
    names = [Path(url).name for url in synthetic_shards.urls[:2]]
    signed = expand_shards(",".join(signed_store.url(name) for name in names))
    assert signed == [signed_store.url(name) for name in names]  # what reads them keeps its query string
    spec = RowSpec(("jpg",), "cls", True, synthetic_shards.num_classes)
    rows = {c: np.concatenate([t[c].to_numpy(zero_copy_only=False) for t in read_shard(signed[0], spec, 256)])
            for c in ("key", "url", "image", "label", "error")}  # fmt: skip
    assert set(rows["url"]) == {f"{signed_store.base}/data/{names[0]}"} and not any(rows["error"])
    config = DataConfig(image_size=32, patch_size=8)
    local = synthetic_shards.urls[:2]
    from_store = preprocess_batch(rows, config=config, train=True, epoch=3, root=dataset_root(signed))
    rows_here = {**rows, "url": np.array([local[0]] * len(rows["key"]))}
    from_disk = preprocess_batch(rows_here, config=config, train=True, epoch=3, root=dataset_root(local))
    np.testing.assert_array_equal(from_store["patches"], from_disk["patches"])  # the same crops
    signed_store.resign()  # the old signature expires: the shard is unreadable, its rows still unsigned
    failed = [t for t in read_shard(signed[0], spec, 256, Retry(1, 0.0))]
    errors = [e for t in failed for e in t["error"].to_pylist()]
    assert errors and errors[-1].startswith("unreadable shard") and "sig=" not in "".join(errors)
    assert set(failed[-1]["url"].to_pylist()) == {shard_id(signed[0])}
