"""`storage.Location`: a URL and the fsspec options that reach it, as one value that never prints a secret."""

from __future__ import annotations

import pickle

import fsspec
import pytest

from pipeline import storage
from pipeline.redaction import public_text, public_url
from pipeline.storage import Location

OPTIONS = {
    "key": "AKIA-NOT-SHOWN",
    "secret": "s3cr3t",
    "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
}


def test_join_keeps_the_options_and_joins_like_the_url():
    run = Location("s3://bucket/runs/exp1/", OPTIONS)
    assert run.join("final", "config.json") == Location("s3://bucket/runs/exp1/final/config.json", OPTIONS)
    assert run.join("metrics.jsonl").options == OPTIONS
    assert Location("/data/runs/exp1").join("final").url == "/data/runs/exp1/final"
    assert run.at("s3://other/x") == Location("s3://other/x", OPTIONS)


def test_neither_repr_nor_str_shows_an_options_value():
    run = Location("s3://bucket/runs/exp1", OPTIONS)
    assert str(run) == f"{run}" == "s3://bucket/runs/exp1"  # messages name the URL alone
    assert repr(run) == "Location('s3://bucket/runs/exp1', options=<client_kwargs, key, secret>)"
    for text in (str(run), repr(run), repr([run]), str({"out": run})):
        assert "s3cr3t" not in text and "AKIA" not in text and "127.0.0.1" not in text
    assert repr(Location("/x")) == "Location('/x')"


@pytest.mark.parametrize(
    ("url", "public"),
    [
        (
            "https://user:pw@acct.blob.core.windows.net/c/x.tar?sv=2024&sig=abc",
            "https://acct.blob.core.windows.net/c/x.tar",
        ),
        ("https://ghp_token@example.com/x.tar#frag", "https://example.com/x.tar"),
        ("s3://bucket/train-{000..009}.tar", "s3://bucket/train-{000..009}.tar"),
        (
            "abfs://container@acct.dfs.core.windows.net/x?sig=abc",
            "abfs://container@acct.dfs.core.windows.net/x",
        ),
        ("abfs://container:key@acct.dfs.core.windows.net/x", "abfs://acct.dfs.core.windows.net/x"),
        ("/data/what?is#this.tar", "/data/what?is#this.tar"),  # a local file's name
        ("file:///data/a?b.tar", "file:///data/a?b.tar"),
    ],
)
def test_a_url_as_outputs_and_messages_write_it_holds_no_userinfo_or_query(url, public):
    assert public_url(url) == public
    assert public_text(f"cannot list {url} (from '{url}'): refused") == (
        f"cannot list {public} (from '{public}'): refused"
    )
    assert public in repr(Location(url)) and (url == public or url not in repr(Location(url)))


def test_equal_by_url_and_options_and_its_own_copy_of_them():
    options = {"anon": True}
    a = Location("s3://b/x", options)
    options["anon"] = False  # the caller's dict changing later changes no Location
    assert a == Location("s3://b/x", {"anon": True}) != Location("s3://b/x")
    assert a != Location("s3://b/y", {"anon": True})
    assert Location("/x", None) == Location("/x") and Location("/x").options == {}
    assert len({a, Location("s3://b/x", {"anon": True}), Location("/x")}) == 2  # hashable
    assert pickle.loads(pickle.dumps(a)) == a  # travels to Ray tasks and workers whole
    with pytest.raises(TypeError, match="url is a str"):
        Location(["s3://b/x"])


def test_local_or_url():
    assert Location("/data/x").is_local and Location("relative/x").is_local
    assert Location("file:///data/x").is_local and Location("file:///data/x").local_path == "/data/x"
    assert not Location("s3://b/x").is_local and not Location("memory://b/x").is_local
    assert storage.as_location("/data/x") == Location("/data/x")
    run = Location("s3://b/x")
    assert storage.as_location(run) is run


def test_the_options_reach_the_filesystem(tmp_path):
    fs, path = Location(str(tmp_path / "a"), {"auto_mkdir": True}).fs()
    assert path.endswith("/a") and fs.auto_mkdir
    where = Location("memory://loc/x.txt")
    storage.write_text(where, "hi")
    assert storage.read_text(where) == storage.read_text("memory://loc/x.txt") == "hi"
    assert storage.list_files(Location("memory://loc")) == {"x.txt": 2}
    with pytest.raises(ValueError, match="nosuchproto"):
        Location("nosuchproto://b/x").fs()
    fsspec.filesystem("memory").rm("/loc", recursive=True)
