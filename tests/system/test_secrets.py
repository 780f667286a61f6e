"""No credential is written anywhere: every job that takes ``--storage-options`` runs with secrets in every
fsspec form, and neither a file it writes, nor what it prints, nor an error line holds one of them.

Storage options are how a job reaches its data, not part of what it made: outputs record at most the names
of the options set. A URL is written without its userinfo and query string (a password, a SAS token).
One chain of runs shares the assertions: pretrain -> finetune -> embed -> analyze, evaluate, export, index,
search, on local paths (a local filesystem takes any fsspec option and ignores it).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile

import pytest

from pipeline import cli
from tests.job_scripts import load_job

pytestmark = pytest.mark.slow

SECRETS = {  # every form of credential fsspec backends take, each value a string found nowhere else
    "key": "AKIA7KEYSECRET0001",
    "secret": "s3secretvalue0002",
    "client_kwargs": {"headers": {"Authorization": "Bearer bearersecret0003"}},
    "connection_string": "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=connsecret0004",
    "account_key": "accountkeysecret0005",
    "sas_token": "sv=2024-01-01&sig=sasoptionsecret0006",
}
TOKEN_FILE = "tokenfilesecret0007.json"  # gcsfs's token: a service account file's path
IN_URLS = ("urlpassword0008", "urlsignature0009")
# A URL with a password and a SAS query string: what a job may name in an error line.
# (A port nothing listens on: refused at once.)
SAS_URL = "https://user:urlpassword0008@127.0.0.1:9/c/train-000000.tar?sv=2024&sig=urlsignature0009"


def secret_strings(token_file: str) -> list[str]:
    return [
        "AKIA7KEYSECRET0001", "s3secretvalue0002", "bearersecret0003", "connsecret0004",
        "accountkeysecret0005", "sasoptionsecret0006", token_file, *IN_URLS,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_session):
    """Every job run once with the secrets: (the folder they wrote under, exit codes by run, all they
    printed, the token file's path)."""
    from pipeline.data.synthetic import write_synthetic_shards

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(cli, "connect_ray", lambda *args, **kwargs: False)  # the tests' Ray
    root = tmp_path_factory.mktemp("secrets")
    (root / "tracebacks").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root / "tracebacks"))  # an unforeseen error's file, read too
    token = str(root / "creds" / TOKEN_FILE)
    stored = ["--storage-options", json.dumps({**SECRETS, "token": token})]
    shards = write_synthetic_shards(
        root / "shards", 32, samples_per_shard=16, image_size=32, num_classes=4, seed=0
    )
    run, ft, emb, out = root / "run", root / "ft", root / "emb", root / "out"
    steps = [
        "--cpu",
        "--num-workers",
        "1",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "8",
        "--max-steps",
        "2",
    ]
    steps += ["--warmup-steps", "1"]
    codes: dict[str, int] = {}
    printed = io.StringIO()

    def job(label: str, name: str, *args: str, options: list[str] = stored) -> None:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            codes[label] = load_job(name, f"vitray_jobs_{name}_secrets").main([*args, *options])

    job("pretrain", "pretrain", "--preset", "tiny", "--data", shards.dir, "--out", str(run), "--image-size", "32",
        "--checkpoint-every", "2", *steps)  # fmt: skip
    job("finetune", "finetune", "--weights", str(run), "--data", shards.dir, "--eval-data", shards.dir,
        "--out", str(ft), "--image-size", "32", "--num-classes", "4", *steps)  # fmt: skip
    job(
        "embed", "embed", "--data", shards.urls[0], "--weights", str(ft / "final"), "--out", str(emb), "--cpu"
    )
    test = out / "emb-test"  # held-out shards: evaluate refuses a --test embedded from --train's
    job("embed a test split", "embed", "--data", shards.urls[1], "--weights", str(ft / "final"), "--out", str(test),
        "--cpu")  # fmt: skip
    job("analyze", "analyze", "--weights", str(run), "--data", shards.dir, "--out", str(out / "analysis"),
        "--cpu", "--images", "4")  # fmt: skip
    job("evaluate", "evaluate", "--train", str(emb), "--test", str(test), "--json", str(out / "scores.json"), "--k", "3",
        "--shots", "1")  # fmt: skip
    job(
        "export",
        "export",
        "--weights",
        str(run),
        "--to",
        "timm",
        "--out",
        str(out / "timm"),
        "--encoder-only",
    )
    job("index", "index", "--embeddings", str(emb), "--out", str(out / "index"))
    job("search", "search", "--index", str(out / "index"), "--near-duplicates", "0.5",
        "--out", str(out / "pairs.parquet"))  # fmt: skip
    # Error lines: jobs that fail on a URL with a password and a SAS token in it (options for https).
    https = ["--storage-options", json.dumps({"client_kwargs": SECRETS["client_kwargs"]})]
    job("embed from a SAS URL", "embed", "--data", SAS_URL, "--weights", str(ft / "final"),
        "--out", str(out / "e2"), "--cpu", options=https)  # fmt: skip
    job("analyze of SAS URL weights", "analyze", "--weights", SAS_URL, "--data", shards.dir,
        "--out", str(out / "a2"), "--cpu", options=https)  # fmt: skip
    monkeypatch.undo()
    return root, codes, printed.getvalue(), token


def test_every_job_ran(runs):
    _, codes, printed, _ = runs
    failed = {"embed from a SAS URL", "analyze of SAS URL weights"}
    assert {k: v for k, v in codes.items() if k not in failed} == dict.fromkeys(set(codes) - failed, 0), (
        printed
    )
    assert all(codes[k] == cli.EXIT_BAD_INPUT for k in failed), printed


def test_no_file_a_job_writes_holds_a_secret(runs):
    root, _, _, token = runs
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "shards" not in p.parts):
        data = path.read_bytes()
        found += [f"{path.relative_to(root)}: {s}" for s in secret_strings(token) if s.encode() in data]
    assert found == []


def test_outputs_record_which_storage_options_were_set_and_no_value(runs):
    root, _, _, _ = runs
    saved = json.loads((root / "run" / "final" / "config.json").read_text())
    options = saved["training"]["config"]["data"]["storage_options"]
    assert sorted(options) == sorted([*SECRETS, "token"])
    assert set(options.values()) == {"***"}


def test_no_line_a_job_prints_holds_a_secret(runs):
    _, _, printed, token = runs
    assert printed.count("error: ") == 2, printed  # the two runs that fail, one line each
    assert "https://127.0.0.1:9/c/train-000000.tar" in printed  # the URL, without credentials
    assert [s for s in secret_strings(token) if s in printed] == []
