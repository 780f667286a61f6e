"""`jobs/embed.py` as a user runs it: every option documented, bad input refused before Ray, a killed run resumed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.embed.output import RECORDS
from tests.job_scripts import run_without_ray

ROOT = Path(__file__).resolve().parents[2]
EMBED = ROOT / "jobs" / "embed.py"

# The command line is an interface: adding or removing an option is a decision, made here on purpose.
FLAGS = {
    "--data", "--weights", "--out", "--weights-format", "--model", "--embedding", "--normalize", "--no-normalize", "--dtype", "--image-size",
    "--batch-size", "--concurrency", "--cpus-per-actor", "--cpu", "--gpu", "--overwrite", "--no-overwrite",
    "--label-key", "--crop-fraction", "--interpolation", "--max-bad-fraction", "--max-lost-shards",
    "--patches", "--max-patches",
    "--storage-options", "--decode-nodes", "--decode", "--address",
    "--num-cpus", "--print-config", "--verbose", "--help",
}  # fmt: skip


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The job as its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(EMBED), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_help_documents_every_option():
    result = run("--help")
    assert result.returncode == 0
    options = result.stdout.split("\noptions:", 1)[1]  # past the description's example commands
    assert set(re.findall(r"(--[a-z][a-z-]+)", options)) == FLAGS
    entries = re.findall(r"\n  (-[^\n]*(?:\n {6,}[^\n]*)*)", options)
    assert len(entries) == len(FLAGS) - 2  # --overwrite / --no-overwrite are one entry, --normalize too
    for entry in entries:  # "--flag METAVAR    help text": the help text says something
        parts = re.split(r"\s{2,}", entry.strip(), maxsplit=1)
        assert len(parts) == 2 and len(parts[1].split()) >= 3, entry


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/nonexistent/shard-{000..003}.tar"], "shard not found: /nonexistent/shard-000.tar"),
        (["--weights", "/nonexistent/run"], "--weights /nonexistent/run does not exist"),
        (["--model", "vit_s16"], "not vit_s16 (embed_dim 384"),
        (["--model", "vit_nope"], "unknown model 'vit_nope'"),
        (["--embedding", "pre_logits", "--image-size", "30"], "not divisible by patch_size 8"),
    ],
)
def test_bad_input_fails_before_ray_in_one_line(synthetic_shards, tiny_export, tmp_path, args, message):
    base = {"--data": synthetic_shards.dir, "--weights": tiny_export, "--out": str(tmp_path / "out")}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    result = run_without_ray("embed", *[x for kv in base.items() for x in kv])  # the job in this process
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Ray" not in result.stdout + result.stderr  # failed before any cluster work
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_killed_job_run_again_ends_with_one_row_per_key(tiny_export, tmp_path, ray_session):
    from pipeline.data.synthetic import write_synthetic_shards

    shards = write_synthetic_shards(
        tmp_path / "shards", 64, samples_per_shard=4, image_size=48, num_classes=4
    )
    out = tmp_path / "out"
    args = [str(EMBED), "--data", shards.dir, "--weights", tiny_export, "--out", str(out)]
    args += ["--batch-size", "2", "--num-cpus", "3"]
    log = (tmp_path / "first.log").open("w")
    job = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    # Each commit leaves its record in _records/ (the manifest is merged from them at a run's start and end).
    records = out / RECORDS
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and job.poll() is None:
            if records.is_dir() and any(p.suffix == ".json" for p in records.iterdir()):
                break
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job and the local Ray it started, as a lost machine would
        job.wait()
        log.close()
    committed = len(
        [p for p in records.iterdir() if p.suffix == ".json" and not storage.is_temporary(p.name)]
    )
    assert 1 <= committed < 16, (tmp_path / "first.log").read_text()[-3000:]

    # What the kill left mid-write is only removed once an hour old (a younger temporary may be a concurrent
    # run's commit in flight): age the leftovers as a lost machine's would be when its job is run again.
    leftovers = [n for n in storage.list_files(str(out)) if storage.is_temporary(n)]
    hours_ago = time.time() - 2 * 3600
    for name in leftovers:
        os.utime(out / name, (hours_ago, hours_ago))

    # Run again (in this process, on the tests' Ray): the committed shards are kept, the rest embedded.
    from pipeline.embed import job as embed_job
    from pipeline.embed.config import EmbedConfig

    plan = embed_job.prepare(EmbedConfig(data=shards.dir, weights=tiny_export, out=str(out), batch_size=2))
    assert len(plan.work.done) == committed and len(plan.work.pending) == 16 - committed
    summary = embed_job.run(plan)
    assert (summary.committed, summary.already_done, summary.failed) == (16 - committed, committed, {})
    keys = pq.read_table(str(out))["key"].to_pylist()
    assert sorted(keys) == shards.keys
    assert not [n for n in storage.list_files(str(out)) if storage.is_temporary(n)]
