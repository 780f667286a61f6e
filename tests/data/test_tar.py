"""Tar parsing and sample grouping on in-memory tars, and read rows (labels, missing members). No Ray."""

from __future__ import annotations

import io
import random
import tarfile
import zlib

import numpy as np
import pyarrow as pa
import pytest

from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples
from pipeline.data.rows import SCHEMA, RowSpec, parse_label, read_shard, sample_rows
from pipeline.data.tar import iter_members, iter_samples, open_tar_stream, split_name
from pipeline.data.writing import tar_bytes

CLEAN = [
    ("a/0001.cls", b"3"),
    ("a/0001.jpg", b"J1" * 300),
    ("a/0002.cls", b"4\n"),
    ("a/0002.JPG", b"J2" * 300),
    ("a/0002.seg.png", b"P2"),
    ("a/0003.cls", b"5"),
    ("a/0003.jpg", b"J3" * 300),
]


def samples_of(raw: bytes, wanted=None):
    """``(key, members, error)`` per sample of a tar (or gzip-compressed tar) held in memory."""
    return [(s.key, s.members, s.error) for s in iter_samples(open_tar_stream(io.BytesIO(raw)), wanted)]


def test_split_name_follows_webdataset_key_rules():
    assert split_name("dir/abc.seg.JPG") == ("dir/abc", "seg.jpg")
    assert split_name("./0001.jpg") == ("./0001", "jpg")
    assert split_name("dir.v2/abc.cls") == ("dir.v2/abc", "cls")
    assert split_name("README") is None
    assert split_name("dir/.hidden.jpg") is None


def test_members_group_into_samples_in_tar_order():
    got = samples_of(tar_bytes(CLEAN))
    assert [key for key, _, _ in got] == ["a/0001", "a/0002", "a/0003"]
    assert got[1][1] == {"cls": b"4\n", "jpg": b"J2" * 300, "seg.png": b"P2"}
    assert all(error == "" for *_, error in got)


def test_unwanted_members_are_skipped_unread_but_still_grouped():
    got = samples_of(tar_bytes(CLEAN), wanted=lambda ext: ext == "cls")
    assert [m for _, m, _ in got] == [{"cls": b"3"}, {"cls": b"4\n"}, {"cls": b"5"}]
    names = [
        (name, data) for name, data, _ in iter_members(io.BytesIO(tar_bytes(CLEAN)), lambda n: "0003" in n)
    ]
    assert names[0] == ("a/0001.cls", None) and names[-1] == ("a/0003.jpg", b"J3" * 300)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_long_names_in_every_tar_format(fmt):
    name = "d" * 90 + "/" + "e" * 60 + "/0001"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=fmt) as tar:
        tar.addfile(tarfile.TarInfo("somedir"))  # a directory entry (size 0): skipped
        for ext, data in [("cls", b"1"), ("jpg", b"xyz")]:
            info = tarfile.TarInfo(f"{name}.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert samples_of(raw.getvalue()) == [(name, {"cls": b"1", "jpg": b"xyz"}, "")]


def test_gzip_is_detected_from_the_bytes():
    raw = tar_bytes(CLEAN, gzip=True)
    assert [s.key for s in iter_samples(open_tar_stream(io.BytesIO(raw), "x.tar"))] == [
        "a/0001",
        "a/0002",
        "a/0003",
    ]


def test_duplicate_member_and_split_sample_are_error_samples_neighbours_kept():
    members = [
        ("0001.jpg", b"a"),
        ("0002.jpg", b"b"),
        ("0002.jpg", b"c"),
        ("0003.jpg", b"d"),
        ("0001.cls", b"1"),  # 0001 again after other keys
        ("0004.jpg", b"e"),
    ]
    got = samples_of(tar_bytes(members))
    assert [(k, e.split(":")[0]) for k, _, e in got] == [
        ("0001", ""),
        ("0002", "duplicate member"),
        ("0003", ""),
        ("0001", "split sample"),
        ("0004", ""),
    ]


def member_ends(raw: bytes) -> dict[str, int]:
    """Sample key -> the byte offset (in the uncompressed tar) where its last member's data ends."""
    ends = {}
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        for info in tar:
            key = split_name(info.name)[0]
            ends[key] = info.offset_data + info.size
    return ends


def check_cut(got, full, ends: dict[str, int], available: int, where: str) -> None:
    """Samples whose members all end within ``available`` bytes are kept whole, in order; after them
    at most the next sample with some of its members (a cut between or inside headers cannot tell
    whether more were coming), then at most one error row, last."""
    errors = [g for g in got if g[2]]
    good = [g for g in got if not g[2]]
    whole = sum(1 for end in ends.values() if end <= available)
    assert good[:whole] == full[:whole], where
    assert len(good) <= whole + 1, where
    if len(good) == whole + 1:
        key, members, _ = good[-1]
        assert key == full[whole][0] and members.items() <= full[whole][1].items(), where
    assert len(errors) <= 1 and got[len(got) - len(errors) :] == errors, where


@pytest.mark.parametrize("gzip", [False, True])
def test_every_truncation_keeps_every_sample_that_ends_before_the_cut(gzip):
    raw = tar_bytes(CLEAN)
    packed = tar_bytes(CLEAN, gzip=True) if gzip else raw
    full, ends = samples_of(raw), member_ends(raw)
    end_of_data = max(ends.values())
    for cut in range(len(packed) + 1):
        available = len(zlib.decompressobj(31).decompress(packed[:cut])) if gzip else cut
        got = samples_of(packed[:cut])
        check_cut(got, full, ends, available, f"cut at {cut} ({available} bytes of tar)")
        if available < end_of_data and ((gzip and cut > 0) or cut % 512 != 0):
            assert got and got[-1][2].startswith("truncated tar"), cut


@pytest.mark.parametrize("gzip", [False, True])
def test_the_sample_just_before_a_cut_is_kept(gzip):
    raw = tar_bytes(CLEAN)
    ends = member_ends(raw)
    header = ends["a/0001"] + (-ends["a/0001"]) % 512  # where a/0002's first header starts
    for cut, where, error_key in [
        (header + 100, "inside the next sample's first header", ""),
        (header + 512 + 1, "inside the next sample's first member's data", "a/0002"),
        (ends["a/0001"] + 3, "inside the padding after the sample's last member", ""),
    ]:
        plain = raw[:cut]
        packed = gzip_prefix(plain) if gzip else plain
        got = samples_of(packed)
        assert [(k, e.split(":")[0]) for k, _, e in got] == [("a/0001", ""), (error_key, "truncated tar")], (
            where
        )
        assert got[0] == samples_of(raw)[0], where


def gzip_prefix(tar_prefix: bytes) -> bytes:
    """A gzip stream that holds exactly ``tar_prefix`` and then stops without its end marker."""
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    return compressor.compress(tar_prefix) + compressor.flush(zlib.Z_SYNC_FLUSH)


def test_truncated_gzip_and_corrupt_header_are_one_error_each():
    gz = tar_bytes(CLEAN, gzip=True)
    got = list(iter_samples(open_tar_stream(io.BytesIO(gz[: len(gz) // 2]))))
    assert got[-1].error.startswith("truncated tar") and all(not s.error for s in got[:-1])
    raw = bytearray(tar_bytes(CLEAN))
    raw[raw.find(b"a/0002.cls") + 3] ^= 0xFF  # a later header's name: its checksum no longer matches
    got = samples_of(bytes(raw))
    # The sample in progress when parsing stops has all its members whole: it is kept.
    assert [(k, e.split(":")[0]) for k, _, e in got] == [("a/0001", ""), ("", "corrupt tar")]


def test_labels_from_a_member_or_a_json_field():
    assert parse_label(b" 7\n", "cls") == 7
    assert parse_label(b"\t007\r\n", "cls") == 7
    assert parse_label(b"9223372036854775807", "cls") == 2**63 - 1  # int64's largest
    assert parse_label(b'{"label": 3}', "json:label") == 3
    assert parse_label(b'{"meta": {"y": "12"}}', "json:meta.y") == 12
    for raw, key, words in [
        (b"cat", "cls", "not a class index"),
        (b"", "cls", "not a class index"),
        (b"-1", "cls", "not a class index"),
        (b'{"x": 1}', "json:label", "no field"),
        (b"{nope", "json:label", "not valid JSON"),
        (b'{"label": true}', "json:label", "not an integer"),
        (b'{"label": 7.0}', "json:label", "not an integer"),
        (b'{"label": -1}', "json:label", "negative"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_label(raw, key)


# What Python's int() takes but a class index is not, and numbers past int64 (2**63 crashed the read
# task and was retried as a storage failure), as a .cls member and as a .json field.
NOT_CLASS_INDICES = [
    ("٣".encode(), "not a class index"),  # Arabic-Indic three
    ("７".encode(), "not a class index"),  # fullwidth seven
    (b"1_0", "not a class index"),
    (b"+2", "not a class index"),
    (b"1 2", "not a class index"),
    (b"\xa07", "not a class index"),  # a no-break space is not ASCII whitespace
    (str(2**63).encode(), "does not fit int64"),
    (b"0" * 30 + b"1" * 20, "does not fit int64"),
    (b"9" * 5000, "does not fit int64"),  # past int()'s 4300-digit limit
]


@pytest.mark.parametrize(("raw", "words"), NOT_CLASS_INDICES)
def test_a_label_must_be_ascii_digits_that_fit_int64(raw, words):
    with pytest.raises(ValueError, match=words):
        parse_label(raw, "cls")
    if b"\xa0" not in raw:
        as_string = b'{"label": "' + raw + b'"}'
        with pytest.raises(ValueError, match=words):
            parse_label(as_string, "json:label")
    if raw.isdigit() and not raw.startswith(b"0") and len(raw) < 4000:  # as a JSON integer too
        with pytest.raises(ValueError, match=words):
            parse_label(b'{"label": ' + raw + b"}", "json:label")


def test_json_nested_thousands_deep_is_a_bad_label():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_label(b'{"label": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "json:label")


def test_rows_take_the_first_image_key_and_report_missing_members():
    members = [
        ("0001.png", b"P"),
        ("0001.jpg", b"J"),
        ("0001.cls", b"1"),
        ("0002.jpg", b"J"),  # no label
        ("0003.txt", b"T"),  # no image
        ("0003.cls", b"3"),
        ("0004.jpg", b"J"),
        ("0004.cls", b"dog"),
    ]
    samples = list(iter_samples(io.BytesIO(tar_bytes(members))))
    required = list(sample_rows(samples, RowSpec(label_key="cls", require_labels=True)))
    assert required[0] == ("0001", b"J", 1, "")
    assert [(k, e.split(":")[0]) for k, _, _, e in required[1:]] == [
        ("0002", "missing label"),
        ("0003", "missing image"),
        ("0004", "bad label"),
    ]
    assert all(image == b"" for _, image, _, e in required if e)  # error rows carry no bytes
    # Optional labels: a sample without one is good; a label member that holds no class index is not.
    optional = list(sample_rows(samples, RowSpec(label_key="cls", require_labels=False)))
    assert [(k, label, e.split(":")[0]) for k, _, label, e in optional] == [
        ("0001", 1, ""),
        ("0002", -1, ""),
        ("0003", -1, "missing image"),
        ("0004", -1, "bad label"),
    ]


def test_a_label_outside_the_classes_is_a_bad_sample_and_counted():
    members = [(f"{i:04d}.{ext}", str(i).encode()) for i in range(6) for ext in ("cls", "jpg")]
    members += [("0006.json", b'{"y": 9}'), ("0006.jpg", b"J")]
    samples = list(iter_samples(io.BytesIO(tar_bytes(members))))
    rows = list(sample_rows(samples[:6], RowSpec(label_key="cls", num_classes=4)))
    assert [(k, label, e) for k, _, label, e in rows[:4]] == [(f"{i:04d}", i, "") for i in range(4)]
    assert [(k, label, image, e.split(":")[0]) for k, image, label, e in rows[4:]] == [
        ("0004", -1, b"", "label out of range"),
        ("0005", -1, b"", "label out of range"),
    ]
    assert "5 is not in [0, 4)" in rows[5][3]
    (json_row,) = sample_rows(samples[6:], RowSpec(label_key="json:y", num_classes=9))
    assert json_row[3].startswith("label out of range: 9")
    assert list(sample_rows(samples[:6], RowSpec(label_key="cls")))[5][2] == 5  # None: no check

    bad = BadSamples(max_bad_fraction=0.2)
    bad.filter(
        {
            "key": np.array([r[0] for r in rows], object),
            "url": np.array(["s.tar"] * 6, object),
            "error": np.array([r[3] for r in rows], object),
        }
    )
    assert (bad.total, bad.bad, dict(bad.by_reason)) == (6, 2, {"label out of range": 2})
    with pytest.raises(BadSampleBudgetError, match="2 label out of range"):
        bad.check_budget(final=True)  # 2 of 6 > 20%


def test_read_shard_yields_arrow_blocks_and_survives_a_missing_file(tmp_path):
    members = [
        (f"{i:04d}.{ext}", b"x" if ext == "jpg" else str(i).encode())
        for i in range(10)
        for ext in ("cls", "jpg")
    ]
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes(members))
    blocks = list(read_shard(str(path), RowSpec(require_labels=True), block_rows=4))
    assert [b.num_rows for b in blocks] == [4, 4, 2]
    table = pa.concat_tables(blocks)
    assert table.schema == SCHEMA
    assert table.column("label").to_pylist() == list(range(10))
    assert set(table.column("url").to_pylist()) == {str(path)}
    (gone,) = list(read_shard(str(tmp_path / "gone.tar"), RowSpec(), block_rows=4))
    assert gone.column("error")[0].as_py().startswith("unreadable shard: FileNotFoundError")
    (tmp_path / "empty.tar").write_bytes(tar_bytes([]))
    (empty,) = list(read_shard(str(tmp_path / "empty.tar"), RowSpec(), block_rows=4))
    assert empty.to_pylist() == [
        {
            "key": "",
            "url": str(tmp_path / "empty.tar"),
            "image": b"",
            "label": -1,
            "error": "lost shard: the tar holds no samples",
            "index": -1,
            "shard_size": -1,
        }
    ]


def test_random_damage_never_raises_and_keeps_clean_samples_first():
    """Bytes overwritten at random, then cut at random: at most one error row, last, and every sample
    whose members all end before the first changed byte (and the cut) read exactly as undamaged."""
    rng = random.Random(0)
    raw = tar_bytes(CLEAN)
    full, ends = samples_of(raw), member_ends(raw)
    kept_somewhere = 0
    for trial in range(300):
        damaged = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        cut = rng.randint(0, len(damaged))
        got = samples_of(bytes(damaged[:cut]))  # must not raise
        first_change = next((i for i in range(cut) if damaged[i] != raw[i]), cut)
        whole = sum(1 for end in ends.values() if end <= first_change)
        errors = [g for g in got if g[2]]
        assert len(errors) <= 1 and got[len(got) - len(errors) :] == errors, trial
        assert [g for g in got if not g[2]][:whole] == full[:whole], trial
        kept_somewhere += whole
    assert kept_somewhere > 100  # the damage left clean samples before it often enough to test them


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\0" * 10240, "the tar holds no samples"),  # zeros: a tar's end marker and nothing else
        (b"<html><body>503 Service Unavailable</body></html>\n" * 40, "none readable"),  # a saved error page
        (tar_bytes([("a.txt", b"x"), ("b.txt", b"y")]), "none readable"),  # members, no image
    ],
    ids=["zeros", "html-page", "no-image"],
)
def test_a_shard_that_gives_no_readable_sample_ends_with_one_lost_shard_row(tmp_path, content, why):
    path = tmp_path / "train-000007.tar"
    path.write_bytes(content)
    table = pa.concat_tables(read_shard(str(path), RowSpec(require_labels=True), block_rows=4))
    errors = table.column("error").to_pylist()
    assert errors[-1].startswith("lost shard: ") and why in errors[-1], errors
    assert sum(e.startswith("lost shard") for e in errors) == 1
    # A shard with one good sample among bad ones is no lost shard.
    mixed = tmp_path / "mixed.tar"
    mixed.write_bytes(tar_bytes([("a.txt", b"x"), ("b.jpg", b"jpeg"), ("b.cls", b"1")]))
    table = pa.concat_tables(read_shard(str(mixed), RowSpec(require_labels=True), block_rows=4))
    assert not any(e.startswith("lost shard") for e in table.column("error").to_pylist())
