"""How `jobs/embed.py` ends a run that fails part-way: one ``error:`` line and exit code 1 (not 2: work
was done), and the same command run again completes. In this process, on the tests' Ray."""

from __future__ import annotations

import errno
from pathlib import Path

import pyarrow.parquet as pq

from pipeline import cli
from pipeline.embed import job
from pipeline.embed.output import EmbeddingOutput
from tests.job_scripts import load_job

embed_job = load_job("embed", "vitray_jobs_embed_exits")


def test_a_full_disk_and_a_lost_shard_fail_the_run_in_one_line_and_a_rerun_completes(
    ray_session, synthetic_shards, tiny_export, tmp_path, monkeypatch, capsys
):
    shards = tmp_path / "shards"
    shards.mkdir()
    for url in synthetic_shards.urls[:3]:
        (shards / Path(url).name).write_bytes(Path(url).read_bytes())
    out = tmp_path / "out"
    args = ["--data", str(shards), "--weights", tiny_export, "--out", str(out)]
    args += ["--cpu", "--batch-size", "8", "--concurrency", "1", "--cpus-per-actor", "1"]
    monkeypatch.setattr(cli, "connect_ray", lambda args, needed_cpus: True)  # the tests' Ray

    # The disk fills up after the first commit.
    commit, commits = EmbeddingOutput.commit, []

    def full_after_first(self, *a, **k):
        if commits:
            raise OSError(errno.ENOSPC, "No space left on device")
        commits.append(commit(self, *a, **k))
        return commits[-1]

    with monkeypatch.context() as m:
        m.setattr(EmbeddingOutput, "commit", full_after_first)
        assert embed_job.main(args) == cli.EXIT_RUN_FAILED  # was 2, "bad input, nothing ran"
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "No space left on device" in err and "\n" not in err

    # A shard lost between planning and reading: reported as failed, and the run says so on stderr.
    lost = shards / Path(synthetic_shards.urls[2]).name
    saved = lost.read_bytes()
    prepare = job.prepare

    def prepare_then_lose_one(config):
        plan = prepare(config)
        lost.unlink()
        return plan

    with monkeypatch.context() as m:
        m.setattr(job, "prepare", prepare_then_lose_one)
        assert embed_job.main(args) == cli.EXIT_RUN_FAILED
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: 1 of 3 shards failed (first: {lost}: unreadable shard") and "\n" not in err

    lost.write_bytes(saved)
    assert embed_job.main(args) == 0
    assert capsys.readouterr().err == ""
    keys = pq.read_table(str(out))["key"].to_pylist()
    assert sorted(keys) == sorted(synthetic_shards.keys[:36])
