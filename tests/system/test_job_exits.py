"""How jobs end: one ``error:`` line and the exit code that says whether anything ran, whatever the cause;
and no job writes into a directory of the user's. In this process, no Ray."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import tempfile
from pathlib import Path

import pytest

from pipeline import cli, storage
from pipeline.train import driver
from pipeline.train.presets import PRESETS
from tests.job_scripts import load_job


def job(name: str):
    """A job script, loaded in this process under a name no package has."""
    return load_job(name, f"vitray_jobs_{name}_exits")


@pytest.fixture(autouse=True)
def tracebacks_in_tmp_path(tmp_path, monkeypatch):
    """The traceback files of unforeseen errors go to the test's own directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def unused_port() -> int:
    """A loopback port nothing listens on: connections to it are refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- run_job: every way a body can end --------------------------------------------------------------


def raises(error: BaseException, *, after_start: bool = False):
    def body() -> int:
        if after_start:
            cli.start_work()
        raise error

    return body


def test_an_oserror_is_bad_input_before_the_work_starts_and_a_failed_run_after(capsys):
    full = OSError(errno.ENOSPC, "No space left on device")
    assert cli.run_job(raises(full)) == cli.EXIT_BAD_INPUT
    assert "No space left on device" in one_error_line(capsys)
    assert cli.run_job(raises(full, after_start=True)) == cli.EXIT_RUN_FAILED
    assert "No space left on device" in one_error_line(capsys)
    # run_job starts each job afresh: the next one's checks are bad input again
    assert cli.run_job(raises(ValueError("a wrong flag"))) == cli.EXIT_BAD_INPUT
    assert one_error_line(capsys) == "error: a wrong flag"


@pytest.mark.parametrize(
    "error, expected",
    [
        (RuntimeError(), "error: RuntimeError (no message)"),
        (ValueError(""), "error: ValueError (no message)"),
        (KeyError("metrics"), "error: KeyError: 'metrics'"),  # a summary that could not be printed
        (
            ValueError("Input X contains NaN.\nLogisticRegression does not accept"),
            "error: Input X contains NaN. ...",
        ),
    ],
)
def test_an_exception_ends_in_one_line_with_a_reason(capsys, error, expected):
    code = cli.run_job(raises(error, after_start=True))
    assert code == cli.EXIT_RUN_FAILED
    assert one_error_line(capsys).startswith(expected)


def test_an_unforeseen_error_keeps_its_traceback_in_a_file(capsys):
    def body() -> int:
        summary: dict = {}
        print(summary["metrics"])  # the summary of a run whose workers returned nothing
        return 0

    assert cli.run_job(body) == cli.EXIT_RUN_FAILED
    line = one_error_line(capsys)
    path = Path(line.split("(traceback: ", 1)[1].rstrip(")"))
    assert 'summary["metrics"]' in path.read_text()
    path.unlink()


def test_errors_from_ray_tasks_and_actors_name_their_cause(capsys):
    from ray.exceptions import ActorDiedError, RayTaskError, UserCodeException
    from ray.train.v2.api.exceptions import WorkerGroupError

    task = RayTaskError("f", "Traceback ...\nKeyError", KeyError()).as_instanceof_cause()
    assert cli.run_job(raises(task, after_start=True)) == cli.EXIT_RUN_FAILED
    assert one_error_line(capsys).startswith("error: KeyError (no message)")
    # Ray Data's wrapper drops its cause on the way to the driver; the remote traceback still names it
    text = (
        "\x1b[36mray::MapWorker(MapBatches(Embedder)).submit()\x1b[39m (pid=1, ip=127.0.0.1)\n"
        '  File "actor.py", line 9, in __call__\n    raise RuntimeError()\nRuntimeError\n\n'
        "The above exception was the direct cause of the following exception:\n\n"
        "ray::MapWorker(MapBatches(Embedder)).submit() (pid=1, ip=127.0.0.1)\n"
        "ray.exceptions.UserCodeException: UDF failed to process a data block.\nFailed to apply UDF"
    )
    data = RayTaskError("submit", text, UserCodeException("UDF failed to process a data block."))
    assert cli.run_job(raises(data.as_instanceof_cause(), after_start=True)) == cli.EXIT_RUN_FAILED
    assert one_error_line(capsys).startswith("error: RuntimeError (traceback: ")
    died = WorkerGroupError("Training failed.\nWorker 0 died", {0: ActorDiedError()})
    assert cli.run_job(raises(died, after_start=True)) == cli.EXIT_RUN_FAILED
    assert one_error_line(capsys).startswith("error: ActorDiedError: The actor died")


def test_interrupts_exits_and_failed_returns_each_end_in_one_line(capsys):
    assert cli.run_job(raises(KeyboardInterrupt())) == cli.EXIT_INTERRUPTED
    assert "interrupted" in one_error_line(capsys)
    assert cli.run_job(raises(SystemExit(15), after_start=True)) == 15  # Ray's driver on a SIGTERM
    assert "SIGTERM" in one_error_line(capsys)
    assert cli.run_job(raises(SystemExit(0))) == 0 and capsys.readouterr().err == ""
    assert cli.run_job(lambda: 1) == 1
    assert "exit code 1" in one_error_line(capsys)


SIGTERM_JOB = """
import os, signal, sys, threading, time
from types import SimpleNamespace

from pipeline import cli


def body():
    cli.connect_ray(SimpleNamespace(address=None, num_cpus=1, verbose=False), needed_cpus=1)
    import ray

    @ray.remote
    def chatty():
        for i in range(1200):
            print(f"worker line {i}", flush=True)
            time.sleep(0.05)

    ref = chatty.remote()
    # The SIGTERM once the task's lines reach this console, inside the ray.get below.
    sigterm = lambda: forwarded.wait(120) and os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=sigterm, daemon=True).start()  # an exit never waits for it
    ray.get(ref)  # Ray's check_status turns the SIGTERM it interrupts into SystemExit(1)
    return 0


class Watched:  # this process's stdout, noting the first forwarded worker line
    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if "worker line" in text:
            forwarded.set()
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


forwarded = threading.Event()
sys.stdout = Watched(sys.stdout)
sys.exit(cli.run_job(body))
"""


def test_a_sigterm_in_a_ray_get_names_the_signal_with_its_code_and_no_worker_line_follows(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(SIGTERM_JOB)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    # Was: 'error: stopped by SystemExit(1)', exit code 1, and worker lines after it.
    assert done.returncode == 15, done.stdout[-2000:]
    assert len(errors) == 1, done.stdout[-2000:]
    assert lines[errors[0]] == (
        "error: stopped by a SIGTERM (exit code 15); run the same command again to continue"
    )
    assert any("worker line" in line for line in lines[: errors[0]])  # lines were forwarded before it
    assert not any("worker line" in line for line in lines[errors[0] :]), lines[errors[0] :]


# --- storage that cannot be reached -----------------------------------------------------------------


def test_an_unreachable_store_for_out_is_one_line_before_any_work(synthetic_shards, tiny_export, capsys):
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{unused_port()}", "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    args = ["--data", synthetic_shards.dir, "--weights", tiny_export, "--out", "s3://vitray-test/emb"]
    assert job("embed").main([*args, "--storage-options", json.dumps(options)]) == cli.EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "Could not connect to the endpoint URL" in line and "endpoint and credentials" in line


def test_s3_weights_without_credentials_are_one_line(synthetic_shards, tmp_path, monkeypatch, capsys):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata to wait for
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    options = {
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{unused_port()}", "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    args = [
        "--data",
        synthetic_shards.dir,
        "--weights",
        "s3://vitray-test/final",
        "--out",
        str(tmp_path / "o"),
    ]
    assert job("embed").main([*args, "--storage-options", json.dumps(options)]) == cli.EXIT_BAD_INPUT
    assert "Unable to locate credentials" in one_error_line(capsys)


# --- outputs onto the user's files ------------------------------------------------------------------


def users_dir(path: Path) -> Path:
    """A directory of the user's that names what a training run leaves, but no run wrote."""
    (path / "final").mkdir(parents=True)
    (path / "final" / "config.json").write_text("the user's")
    (path / "metrics.jsonl").write_text("the user's\n")
    return path


def test_training_refuses_a_root_and_a_directory_it_did_not_write(synthetic_shards, tmp_path, capsys):
    pretrain = job("pretrain")
    mine = users_dir(tmp_path / "mine")
    assert pretrain.main(["--data", synthetic_shards.dir, "--out", str(mine)]) == cli.EXIT_BAD_INPUT
    assert "(final/, metrics.jsonl); pass --overwrite" in one_error_line(capsys)
    assert (mine / "metrics.jsonl").read_text() == "the user's\n"
    # "/" once ran, its checkpoints in the current directory, metrics.jsonl and final/ in the root
    with pytest.raises(ValueError, match="needs a parent directory and a run name"):
        driver.check_out(PRESETS["tiny"]().replace(out="/"))
    # What a run leaves is its own: the marker it writes before its first step, or a checkpoint.
    config = PRESETS["tiny"]().replace(data=synthetic_shards.dir, out=str(tmp_path / "run"))
    driver.check_out(config)  # nothing there yet
    driver.claim_out(config)
    assert (tmp_path / "run" / driver.RUN_MARKER).is_file()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    driver.check_out(config)  # resumable without --overwrite
    older = users_dir(tmp_path / "older")
    (older / "checkpoint_00000004").mkdir()
    driver.check_out(config.replace(out=str(older)))
    driver.check_out(config.replace(out=str(mine), overwrite=True))


def test_a_jobs_own_errors_may_be_named_by_a_function_called_only_when_one_comes(capsys):
    # A job script passes its command's error classes as a function, so that --help imports none of them.
    class Diverged(RuntimeError):
        pass

    asked = []

    def failures():
        asked.append(True)
        return (Diverged,)

    assert cli.run_job(lambda: 0, failures=failures) == 0 and not asked
    assert (
        cli.run_job(raises(Diverged("the loss diverged at step 9")), failures=failures) == cli.EXIT_RUN_FAILED
    )
    assert one_error_line(capsys) == "error: the loss diverged at step 9"  # its message, as written
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int)
    assert cli.main(parser, lambda args: args.steps - 3, ["--steps", "3"]) == 0


def test_a_filesystem_root_is_no_output_directory(tmp_path):
    # Checked here rather than through the jobs: a regression would have them write into the root.
    for root in ("/", "file:///", "/.", "s3://"):
        assert storage.is_root(root), root
        with pytest.raises(ValueError, match="root of a filesystem"):
            storage.check_output_dir(root, job="a job", owns=lambda entries: True, overwrite=True)
    for directory in (str(tmp_path), "s3://bucket", "s3://bucket/emb", "relative/dir"):
        assert not storage.is_root(directory), directory
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        storage.check_output_dir(str(tmp_path / "a-file"), job="a job", owns=lambda entries: True)


def test_the_other_jobs_refuse_a_directory_they_did_not_write(
    synthetic_shards, tiny_export, tmp_path, capsys
):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    common = ["--data", synthetic_shards.dir, "--weights", tiny_export, "--out", str(mine)]
    for name in ("embed", "analyze"):
        assert job(name).main(common) == cli.EXIT_BAD_INPUT, name
        assert "did not write (notes.txt); pass --overwrite" in one_error_line(capsys)
    assert job("make_shards").main(["--synthetic", "8", "--out", str(mine)]) == cli.EXIT_BAD_INPUT
    assert "did not write (notes.txt); pass --overwrite" in one_error_line(capsys)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    # The shard writer shares a directory with other shards, and writes beside anything on request.
    shards = job("make_shards")
    assert shards.main(["--synthetic", "8", "--out", str(tmp_path / "s"), "--prefix", "val"]) == 0
    assert shards.main(["--synthetic", "8", "--out", str(tmp_path / "s")]) == 0
    assert shards.main(["--synthetic", "8", "--out", str(mine), "--overwrite"]) == 0
    assert (mine / "notes.txt").read_text() == "the user's"


def test_a_second_live_run_into_one_out_is_refused_in_one_line_naming_the_first(
    synthetic_shards, tmp_path, capsys
):
    from pipeline.train.checkpointing import lease

    for marked in (False, True):  # the first run's lease alone (before its marker), or beside it
        out = tmp_path / f"run-{marked}"
        first = lease.acquire(str(out))  # a live run: its driver is this process
        if marked:
            (out / driver.RUN_MARKER).write_text("{}")
        args = ["--preset", "tiny", "--data", synthetic_shards.dir, "--out", str(out), "--cpu"]
        assert job("pretrain").main(args) == cli.EXIT_BAD_INPUT
        line = one_error_line(capsys)
        head, tail = line.split(", renewed ")
        assert head == (
            f"error: --out {out} is in use by a live training run, run {first.run} (pid {os.getpid()} on "
            f"{socket.gethostname()}"
        )
        assert tail.endswith(
            " s ago); wait for it to end or stop it, then run again (a stopped run's directory is taken over)"
        )
        assert lease.read(str(out))["run"] == first.run  # the first run's lease untouched


def test_make_shards_from_a_missing_folder_is_bad_input_in_one_line(tmp_path, capsys):
    code = job("make_shards").main(["--from-folder", str(tmp_path / "nowhere"), "--out", str(tmp_path / "s")])
    assert code == cli.EXIT_BAD_INPUT
    assert "is not a directory" in one_error_line(capsys)
    assert not (tmp_path / "s").exists()


# --- --decode-nodes with a label no node has: no wait without an end ---------------------------------


def nodes(*labels: dict[str, str]) -> list[dict]:
    """What `ray.nodes()` gives for live nodes with these labels."""
    return [{"Alive": True, "Labels": {"ray.io/node-id": f"n{i}", **label}} for i, label in enumerate(labels)]


def test_a_label_no_node_of_a_local_ray_has_is_refused_at_once_by_both_jobs(
    synthetic_shards, tiny_export, tmp_path, monkeypatch, capsys
):
    """Before: the job printed its epoch line and waited, for ever, for a labelled node to run its reads."""
    import ray

    monkeypatch.setattr(cli, "connect_ray", lambda args, needed_cpus: True)  # a local Ray, started
    monkeypatch.setattr(ray, "nodes", lambda: nodes({}))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    label = ["--decode-nodes", "vitray/role=decode"]
    train = ["--preset", "tiny", "--data", synthetic_shards.dir, "--out", str(tmp_path / "run"), "--cpu"]
    embed = [
        "--data",
        synthetic_shards.dir,
        "--weights",
        tiny_export,
        "--out",
        str(tmp_path / "emb"),
        "--cpu",
    ]
    for name, args in (("pretrain", [*train, "--num-workers", "1"]), ("embed", embed)):
        assert job(name).main([*args, *label]) == cli.EXIT_BAD_INPUT
        assert one_error_line(capsys) == (
            "error: --decode-nodes vitray/role=decode: no node of the local Ray this job started carries "
            "that label, and no node can join it; drop --decode-nodes, or pass --address (or RAY_ADDRESS) "
            "of a cluster whose decode nodes carry it"
        )
    assert not (tmp_path / "emb" / "_manifest.json").exists()  # nothing written


def test_on_a_cluster_a_label_is_waited_for_within_a_bound_that_the_line_names(monkeypatch, capsys):
    import ray
    from ray.autoscaler import sdk

    asked: list[dict] = []
    monkeypatch.setattr(sdk, "request_resources", lambda **request: asked.append(request))
    monkeypatch.setattr(cli, "DECODE_NODES_POLL_S", 0.01)
    seen = iter([nodes({}), nodes({}), nodes({}, {"vitray/role": "decode"})])
    monkeypatch.setattr(ray, "nodes", lambda: next(seen))
    cli.check_decode_nodes("vitray/role=decode", local=False, wait_s=5)  # the node joins on the third look
    assert "waiting up to 5 s for a node labelled vitray/role=decode (--decode-nodes) to join" in (
        capsys.readouterr().out
    )
    # The autoscaler was asked for one CPU on such a node while the job waited, and the request withdrawn.
    assert asked == [
        {"bundles": [{"CPU": 1}], "bundle_label_selectors": [{"vitray/role": "decode"}]},
        {"bundles": []},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes({"vitray/role": "train"}))
    with pytest.raises(ValueError) as info:
        cli.check_decode_nodes("vitray/role=decode", local=False, wait_s=0.2)
    assert str(info.value).startswith(
        "--decode-nodes vitray/role=decode: no node of the cluster carried that label after waiting 0.2 s"
    )
    assert "\n" not in str(info.value)
    cli.check_decode_nodes("vitray/role=train", local=True)  # a node that has it: nothing to wait for
    cli.check_decode_nodes(None, local=True)
