"""The make_shards job (pipeline/data/make_shards.py, jobs/make_shards.py) and the shard writer: synthetic and folder sources, reproducible bytes. No Ray."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.data.make_shards import make_shards, parse_args
from pipeline.data.shards import expand_shards
from pipeline.data.synthetic import CLASSES, render, write_synthetic_shards
from pipeline.data.writing import ShardWriter, brace_url
from tests.job_scripts import load_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "jobs" / "make_shards.py"


def members(path: str) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def test_cli_writes_synthetic_shards_and_prints_the_url(tmp_path):
    out = tmp_path / "shards"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--synthetic", "25", "--out", str(out), "--samples-per-shard", "10"],
        capture_output=True,
        text=True,
        check=True,
    )
    url = result.stdout.strip().splitlines()[-1].split("'")[1]
    assert url == f"{out}/train-{{000000..000002}}.tar"
    shards = expand_shards(url)
    assert [len(members(s)) for s in shards] == [30, 30, 15]  # jpg + cls + json per sample
    names = [name for name, _ in members(shards[0])]
    assert names[:3] == ["00000000.cls", "00000000.jpg", "00000000.json"]
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--synthetic", "5", "--out", str(out)], capture_output=True, text=True
    )
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_help_lists_every_option_with_a_sentence():
    text = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    ).stdout
    parser_options = [
        "--synthetic",
        "--from-folder",
        "--out",
        "--samples-per-shard",
        "--image-size",
        "--num-classes",
        "--max-size",
        "--format",
        "--quality",
        "--seed",
        "--prefix",
        "--gzip",
        "--overwrite",
    ]
    for option in parser_options:
        assert option in text
    actions = parse_args(["--synthetic", "1", "--out", "x"])
    assert set(vars(actions)) == {o.lstrip("-").replace("-", "_") for o in parser_options}


def test_same_arguments_write_the_same_bytes_whatever_the_shard_size(tmp_path):
    a = write_synthetic_shards(tmp_path / "a", 12, samples_per_shard=5, image_size=32, gzip=True)
    b = write_synthetic_shards(tmp_path / "b", 12, samples_per_shard=5, image_size=32, gzip=True)
    c = write_synthetic_shards(tmp_path / "c", 12, samples_per_shard=12, image_size=32)
    assert [Path(u).read_bytes() for u in a.urls] == [Path(u).read_bytes() for u in b.urls]
    assert all(u.endswith(".tar.gz") for u in a.urls)
    assert [m for u in a.urls for m in members(u)] == members(c.urls[0])
    assert a.labels == {f"{i:08d}": i % 10 for i in range(12)} and a.num_classes == len(CLASSES)


def test_synthetic_classes_differ_and_are_not_trivial():
    images = [render(i, seed=0, image_size=64)[0].astype(np.float32) for i in range(40)]
    by_class = [np.mean([img.mean(axis=(0, 1)) for img in images[c::10]], axis=0) for c in range(10)]
    assert all(np.abs(by_class[0] - other).max() > 5 for other in by_class[1:])  # colors tell classes apart
    same_class = images[0], images[10]
    assert np.abs(same_class[0] - same_class[1]).mean() > 10  # but no two samples of a class look alike


def test_folder_source_keeps_original_bytes_and_labels_by_sorted_class(tmp_path):
    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    originals = {}
    for cls, fmt, ext in [("zebra", "JPEG", "jpg"), ("ant", "PNG", "png"), ("bee", "BMP", "bmp")]:
        (root / cls).mkdir(parents=True)
        for i in range(3):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(buf, format=fmt)
            (root / cls / f"img{i}.{ext}").write_bytes(buf.getvalue())
            originals[f"{cls}/img{i}.{ext}"] = buf.getvalue()
    (root / "ant" / "notes.txt").write_text("not an image")
    shard_set = make_shards(
        parse_args(["--from-folder", str(root), "--out", str(tmp_path / "out"), "--samples-per-shard", "4"])
    )
    assert len(shard_set.urls) == 3 and shard_set.class_names == ["ant", "bee", "zebra"]
    samples: dict[str, dict[str, bytes]] = {}
    for url in shard_set.urls:
        for name, data in members(url):
            key, ext = name.split(".", 1)
            samples.setdefault(key, {})[ext] = data
    assert len(samples) == 9 and set(shard_set.keys) == set(samples)
    for members_of in samples.values():
        meta = json.loads(members_of["json"])
        assert int(members_of["cls"]) == meta["label"] == ["ant", "bee", "zebra"].index(meta["class"])
        if meta["class"] in ("ant", "zebra"):
            image = members_of["png" if meta["class"] == "ant" else "jpg"]
            assert image == originals[meta["path"]]  # stored as it was
        else:
            assert "jpg" in members_of  # BMP is re-encoded

    # The same arguments write the same bytes: into another --out, with the files' times changed,
    # plain and gzipped, originals kept and re-encoded (--max-size 10: every image is larger).
    for path in root.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))

    def shard_bytes(out: str, *extra: str) -> list[bytes]:
        args = ["--from-folder", str(root), "--out", str(tmp_path / out), "--samples-per-shard", "4"]
        return [Path(u).read_bytes() for u in make_shards(parse_args([*args, *extra])).urls]

    assert shard_bytes("again") == [Path(u).read_bytes() for u in shard_set.urls]
    assert shard_bytes("gz-a", "--gzip") == shard_bytes("gz-b", "--gzip")
    small = shard_bytes("small-a", "--gzip", "--max-size", "10")
    assert small == shard_bytes("small-b", "--gzip", "--max-size", "10")
    reencoded = [
        data for name, data in members(str(next((tmp_path / "small-a").iterdir()))) if name.endswith(".jpg")
    ]
    assert reencoded and not set(reencoded) & set(originals.values())


def test_unreadable_files_are_counted_and_a_folder_of_none_readable_writes_nothing(tmp_path, capsys):
    root = tmp_path / "folder"
    (root / "cat").mkdir(parents=True)
    Image.new("RGB", (20, 10)).save(root / "cat" / "good.jpg")
    (root / "cat" / "broken.jpg").write_bytes(b"not a jpeg")
    shard_set = make_shards(parse_args(["--from-folder", str(root), "--out", str(tmp_path / "a")]))
    assert len(shard_set.keys) == 1 and shard_set.skipped == [str(root / "cat" / "broken.jpg")]
    assert f"skipping {root / 'cat' / 'broken.jpg'}: not an image PIL can open" in capsys.readouterr().out
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-folder", str(root), "--out", str(tmp_path / "b")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and "(1 samples, 1 classes, 1 unreadable file(s) skipped)" in result.stdout
    (root / "cat" / "good.jpg").write_bytes(b"")  # now none reads
    with pytest.raises(ValueError, match=r"^no image in \S+ could be read \(2 file\(s\) skipped, first: "):
        make_shards(parse_args(["--from-folder", str(root), "--out", str(tmp_path / "c")]))
    assert not list((tmp_path / "c").glob("*.tar"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--synthetic", "4", "--image-size", "0"], "--image-size must be from 1 to 65,536, got 0"),
        (["--synthetic", "4", "--max-size", "0"], "--max-size must be from 1 to 65,536, got 0"),
        (["--synthetic", "0"], "--synthetic must be from 1 to 2,147,483,647, got 0"),
        (["--synthetic", "4", "--quality", "96"], "--quality must be from 1 to 95, got 96"),
        (
            ["--synthetic", "4", "--num-classes", "0"],
            f"--num-classes must be from 1 to {len(CLASSES)}, got 0",
        ),
        (
            ["--synthetic", "4", "--samples-per-shard", "0"],
            "--samples-per-shard must be from 1 to 2,147,483,647, got 0",
        ),
        ([], "pass one source: --synthetic N (generated images) or --from-folder DIR"),
        (["--synthetic", "4", "--from-folder", "x"], "pass one source: --synthetic N"),
        (["--synthetic", "4", "--prefix", "../x"], "--prefix '../x' must be a plain file name part"),
        (["--synthetic", "4", "--prefix", ""], "--prefix '' must be a plain file name part"),
        (["--synthetic", "4", "--prefix", "*"], "--prefix '*' must be a plain file name part"),
    ],
)
def test_values_that_cannot_work_are_refused_before_anything_is_written(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        parse_args([*args, "--out", str(tmp_path / "out")])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_writer_refuses_dotted_keys_and_leaves_no_partial_shard(tmp_path):
    with pytest.raises(ValueError, match="contains a dot"), ShardWriter(tmp_path) as writer:
        writer.write("ok", {"cls": b"1"})
        writer.write("a.b", {"cls": b"1"})
    assert list(tmp_path.iterdir()) == []


def test_brace_url_names_every_shard():
    urls = [f"/d/train-{i:06d}.tar.gz" for i in range(3)]
    assert brace_url(urls) == "/d/train-{000000..000002}.tar.gz"
    assert brace_url(urls[:1]) == urls[0]


def test_the_job_refuses_a_value_outside_a_bound_in_one_line_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    main = load_job("make_shards", "vitray_jobs_make_shards_bounds").main
    assert main(["--synthetic", "4", "--quality", "0", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "error: --quality must be from 1 to 95, got 0\n"
    assert not out.exists()
    assert main(["--synthetic", "4", "--out", str(out), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["synthetic"] == 4 and not out.exists()
