"""`storage.upload_dir(commit_last=...)`: the commit file lands after every other file, locally and on an
object store, so a crash between two uploads never leaves a new config.json beside old weights."""

from __future__ import annotations

import os

import fsspec
import pytest

from pipeline import storage

FILES = {"config.json": "{}", "weights.safetensors": "w", "a_readme.txt": "r"}


@pytest.fixture
def export_dir(tmp_path):
    local = tmp_path / "export"
    local.mkdir()
    for name, text in FILES.items():
        (local / name).write_text(text)
    return local


def test_local_upload_commits_the_config_last(export_dir, tmp_path, monkeypatch):
    landed = []
    replace = os.replace

    def recording_replace(src, dst):
        landed.append(os.path.basename(dst))
        replace(src, dst)

    monkeypatch.setattr(storage.os, "replace", recording_replace)
    storage.upload_dir(export_dir, str(tmp_path / "final"), commit_last="config.json")
    assert landed[-1] == "config.json"
    assert sorted(landed) == sorted(FILES)
    assert {p.name: p.read_text() for p in (tmp_path / "final").iterdir()} == FILES


def test_object_store_upload_commits_the_config_last(export_dir, monkeypatch):
    fs = fsspec.filesystem("memory")
    landed = []
    put_file = type(fs).put_file

    def recording_put(self, lpath, rpath, *args, **kwargs):
        landed.append(rpath.rsplit("/", 1)[-1])
        return put_file(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(type(fs), "put_file", recording_put)
    storage.upload_dir(export_dir, "memory://bucket/run/final", commit_last="config.json")
    assert landed == ["a_readme.txt", "weights.safetensors", "config.json"]
    assert fs.cat_file("/bucket/run/final/config.json") == b"{}"
