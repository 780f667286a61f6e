"""What a person sees: the jobs' console holds vitray's lines, a failing run's error and the summary, and
none of Ray's bookkeeping (pipeline/console.py says which setting quiets which source)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from PIL import Image

from pipeline.console import (
    ACTOR_RESTART_NOTICE,
    QUIET_LINES,
    Console,
    QuietRecords,
    StripColour,
    quiet_pattern,
)
from pipeline.train.observe.sinks import PROBE_FIELDS

ROOT = Path(__file__).resolve().parents[2]

# Real lines of each quieted source, as a pretraining and an embedding run printed them.
RAY_LINES = {
    "ray_train_report": "(RayTrainWorker pid=19306) Reporting training result 1: TrainingReport("
    "checkpoint=None, metrics={'step': 10, 'epoch': 2, 'loss': 2.28}, validation_spec=None) from rank 0",
    "placement_group_cleaner": "(PlacementGroupCleaner pid=18990) Failed to query Ray Train Controller actor "
    "state. State API may be temporarily unavailable. Continuing to monitor.",
    "preemption_watcher": "(TrainController pid=18217) [2026-11-22 18:16:38,776 E 18217 18460] "
    "core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and ID: "
    "'83bbc5cfb428a4dcb2f5ad8a01000000' has constructor arguments in the object store and max_restarts > 0.",
    "ray_data_bars_off": "(RayTrainWorker pid=19463) Progress bars disabled. To enable, set "
    "`ray.data.DataContext.get_current().enable_progress_bars = True`.",
    "resource_request": "(TrainController pid=12716) Failed to send resource request for "
    "train-9fea8b19f5924b72ad6478a457d276ed. If this only happens transiently during network partition or "
    "CPU being overloaded, it's safe to ignore this error. If this error persists, file a GitHub issue.",
    "worker_startup": "(raylet) WARNING: 8 PYTHON worker processes have been started on node: 450f5eb3e45f1608de"
    "f72c6c1742fda92a44e2ac260af99590736c89 with address: 192.0.2.2, which is 4x the maximum expected startup "
    "concurrency (2). This could be a result of using a large number of actors, tasks blocked in ray.get() "
    "calls, or tasks with fractional CPU requests (e.g., num_cpus=0.1) allowing high concurrency.",
}
# The traceback Ray Train's controller logs after its resource-request line, as a busy machine showed it
# (the process prefix is the driver's: Ray forwards the bare lines).
SITE = "/venv/lib/python3.11/site-packages/ray"
RESOURCE_REQUEST_TRACEBACK = [
    "Traceback (most recent call last):",
    f'  File "{SITE}/train/v2/_internal/execution/scaling_policy/autoscaling_coordinator_client.py", '
    "line 58, in send_resource_request",
    "    ray.get(",
    f'  File "{SITE}/_private/worker.py", line 3009, in get',
    "    values, debugger_breakpoint = worker.get_objects(",
    "                                  ^^^^^^^^^^^^^^^^^^^",
    '  File "python/ray/_raylet.pyx", line 3471, in ray._raylet.CoreWorker.get_objects',
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
]
# What must never show by default, whatever line of it: the sources above, Ray's INFO logs and Ray
# Data's progress blocks on the driver, the token-auth notice, the actor-restart notice of any actor,
# colour codes.
NOISE = re.compile(
    quiet_pattern()
    + "|"
    + ACTOR_RESTART_NOTICE
    + r"|PlacementGroupCleaner|PreemptionWatcher|logging_progress|Running Dataset|"
    r"\bINFO\b|Token authentication|\x1b\["
)


# One metrics.jsonl row of a supervised run, as the README lists its fields.
METRICS_FIELDS = {
    "step", "epoch", "loss", "accuracy", "lr", "grad_norm", "images_per_s", "images_per_s_per_worker", "mfu",
    "data_wait_share", "samples_seen", "bad_samples", "skipped_steps", "memory_gib", "gc_s", "run_images_per_s",
    "rank_step_s", "time", "goodput",
}  # fmt: skip


def test_each_quiet_pattern_matches_its_source_and_no_vitray_line():
    assert set(RAY_LINES) == set(QUIET_LINES)
    for name, line in RAY_LINES.items():
        assert re.search(QUIET_LINES[name], line), name
    vitray = [
        "(RayTrainWorker pid=1) step 10/40 (25%) | epoch 2 | loss 2.2815 | acc 29.5% | lr 1.00e-03",
        "(RayTrainWorker pid=1) vit_tiny_test: 2 workers on 1 node(s), 32 images x 1 accumulation each",
        "embedded 2/2 shards (100%) | 256 rows | 7.0 rows/s | eta 0:00:00",
        "error: 3 of 128 samples are bad (budget 0%): ...",
    ]
    assert not [line for line in vitray if re.search(quiet_pattern(), line)]


def test_a_quiet_record_goes_with_its_traceback_and_every_other_line_stays():
    message = RAY_LINES["resource_request"].split(") ", 1)[1]
    error = ["Traceback (most recent call last):", '  File "/work/vit/model.py", line 3, in f',
             "ValueError: vitray's own"]  # fmt: skip
    chained = [*RESOURCE_REQUEST_TRACEBACK, "", "During handling of the above exception, another "
               "exception occurred:", "", *RESOURCE_REQUEST_TRACEBACK]  # fmt: skip
    quiet = QuietRecords()
    batch = {"ip": "a", "pid": 1, "is_err": True,
             "lines": [message, *chained, "step 10/40", *error, message, "exported", *error]}  # fmt: skip
    quiet(batch)
    assert batch["lines"] == ["step 10/40", *error, "exported", *error]  # a quiet line's traceback only
    # A record split over two batches of its process; another process's lines between them stay.
    first = {"ip": "a", "pid": 1, "is_err": True, "lines": [message, *RESOURCE_REQUEST_TRACEBACK[:3]]}
    other = {"ip": "a", "pid": 2, "is_err": True, "lines": RESOURCE_REQUEST_TRACEBACK[3:]}
    rest = {"ip": "a", "pid": 1, "is_err": True, "lines": [*RESOURCE_REQUEST_TRACEBACK[3:], "exported"]}
    for b in (first, other, rest):
        quiet(b)
    assert (first["lines"], other["lines"], rest["lines"]) == (
        [],
        RESOURCE_REQUEST_TRACEBACK[3:],
        ["exported"],
    )


def test_settings_by_mode():
    quiet = Console(verbose=False, colour=False).environment(local=True)
    assert quiet == {
        "RAY_COLOR_PREFIX": "0",
        "RAY_DEDUP_LOGS_SKIP_REGEX": quiet_pattern(),
        "RAY_AUTH_MODE": "token",
    }
    assert "RAY_AUTH_MODE" not in Console(verbose=False).environment(local=False)  # the cluster's own
    assert Console(verbose=True, colour=True).environment(local=True) == {}  # Ray's console as it is
    assert Console(verbose=True, colour=False).environment(local=True) == {"RAY_COLOR_PREFIX": "0"}
    assert Console.for_stream(verbose=False, stream=io.StringIO()).colour is False


def test_colour_codes_are_stripped_off_a_terminal():
    out = io.StringIO()
    StripColour(out).write("\x1b[36m(RayTrainWorker pid=1)\x1b[0m step 1 \x1b[32m[repeated 2x]\x1b[39m\n")
    assert out.getvalue() == "(RayTrainWorker pid=1) step 1 [repeated 2x]\n"


def test_rays_console_lines_go_to_the_stderr_of_the_moment_not_one_closed_since(monkeypatch, capsys):
    import logging

    from ray._private.log import PlainRayHandler

    from pipeline import cli

    # What ``import ray.data`` did in an earlier test: Ray Data's console handler, made on that test's
    # captured stderr, which was closed when that test ended.
    earlier = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", earlier)
        made_then = PlainRayHandler()
    earlier.close()
    logger = logging.getLogger("ray.data")
    monkeypatch.setattr(logger, "handlers", [made_then])
    monkeypatch.setattr(logger, "propagate", False)

    def body() -> int:
        logger.warning("a line of Ray Data's")
        return 0

    assert cli.run_job(body) == 0
    err = capsys.readouterr().err
    assert "Logging error" not in err and err.strip() == "a line of Ray Data's"
    captured, replaced = sys.stderr, io.StringIO()
    sys.stderr = replaced  # replaced again (a job's colour filter): the same handler follows
    try:
        logger.warning("and the next")
    finally:
        sys.stderr = captured
    assert replaced.getvalue().strip() == "and the next"


@dataclass
class Started:
    """A job running, its console going to a file: stdout and stderr in one stream (a file, not a pipe,
    so that jobs run at once never wait on a full pipe)."""

    process: subprocess.Popen
    console: IO[str]


def started(script: str, *args: str) -> Started:
    console = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read and dropped with the Started)
    command = [sys.executable, str(ROOT / "jobs" / script), *args]
    return Started(subprocess.Popen(command, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT), console)


def finished(job: Started, timeout: float = 420) -> subprocess.CompletedProcess:
    """The job's exit code and console, once it has ended (killed past ``timeout`` seconds)."""
    try:
        job.process.wait(timeout=timeout)
    finally:
        job.process.kill()
    job.console.seek(0)
    return subprocess.CompletedProcess(job.process.args, job.process.returncode, job.console.read())


def job(script: str, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return finished(started(script, *args), timeout)


def noise(console: str) -> list[str]:
    return [line for line in console.splitlines() if NOISE.search(line)]


@pytest.mark.slow
def test_make_demo_runs_every_stage_learns_and_its_console_is_vitray_lines_only(tmp_path):
    """`make demo` (`python jobs/demo.py`, here with its --out): five jobs on local Rays, the tiny preset
    as its docstring gives it. What the console shows, what each stage leaves, and that it learns."""
    import pyarrow.parquet as pq

    demo = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "demo.py"), "--out", str(tmp_path / "demo")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=720,
    )  # fmt: skip
    out, console = tmp_path / "demo", demo.stdout
    assert demo.returncode == 0, console[-4000:]
    assert not noise(console), noise(console)
    for n in range(1, 6):
        assert re.search(rf"^=== {n}/5 ", console, re.M), n

    # Pretraining: 512 images in 4 shards of 128, 2 workers x micro-batch 32 -> 8 steps an epoch;
    # a log line every 60 of the preset's 240 steps.
    run = out / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in rows] == [(s, (s - 1) // 8) for s in (60, 120, 180, 240)]
    # A checkpoint's row also says how long it kept training waiting, and what its probe found (the
    # checkpoints of 120 and 240, probed beside training: fit on the shards, scored on the held-out
    # images); the last step always checkpoints.
    probed = {"checkpoint_stall_s", *PROBE_FIELDS, "probe_converged"}
    assert all(r.keys() - probed == METRICS_FIELDS for r in rows), rows[0].keys()
    assert [r["step"] for r in rows if "probe_accuracy" in r] == [120, 240]
    for r in rows[1::2]:  # 10 classes: chance is 10%
        assert r["probe_accuracy"] > 0.6 and r["knn_accuracy"] > 0.6, r
        assert f"probe of step {r['step']} (checkpoint_{r['step']:08d}): linear probe " in console
    shown = " -> ".join(
        f"step {r['step']}: linear probe {100 * r['probe_accuracy']:.0f}%, k-NN {100 * r['knn_accuracy']:.0f}%"
        for r in rows[1::2]
    )
    assert f"probe:      {shown} (fit on shards/, scored on held-out/)" in console
    assert "checkpoint_stall_s" in rows[-1] and re.search(r"\| checkpoint stall \d+\.\d\d s \|", console)
    assert all(r["mfu"] is None for r in rows)  # no datasheet peak for a CPU
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert rows[-1]["accuracy"] > 0.9, [round(r["accuracy"], 3) for r in rows]
    for r in rows:  # every logged step has its line
        assert re.search(
            rf"step {r['step']}/240 \(\d+%\) \| epoch {r['epoch']} \| loss {r['loss']:.4f}", console
        )
    assert "vit_tiny_test: 2 workers on 1 node(s)" in console
    assert f"exported {run / 'final'}" in console and "finished at step 240: loss" in console
    assert f"run directory: {run} (checkpoints, metrics.jsonl, final/)" in console
    # The preset keeps 2 checkpoints, written every 120 steps.
    assert sorted(p.name for p in run.glob("checkpoint_*") if p.is_dir()) == [
        "checkpoint_00000120",
        "checkpoint_00000240",
    ]
    # The curve the demo draws from metrics.jsonl: a readable 1440 x 480 PNG, loss and accuracy on the
    # left and the probe's two accuracies beside them (their colours cover a few hundred pixels each; the
    # axis labels alone, about a hundred).
    curve = run / "training_curve.png"
    assert f"curve:      {curve}  (loss, and the probe beside it)" in console
    assert 10_000 < curve.stat().st_size < 1_000_000
    with Image.open(curve) as im:
        assert (im.format, im.size) == ("PNG", (1440, 480))
        pixels = {colour: n for n, colour in im.convert("RGB").getcolors(maxcolors=1_000_000)}
    # loss, accuracy; linear probe, k-NN
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28)):
        assert pixels.get(colour, 0) > 250, colour

    # Embeddings of the export: one row per image, the job's progress and summary lines.
    embeddings = out / "embeddings"
    assert "4 shards, 0 already done, 4 to embed" in console
    assert re.search(
        r"^embedded 4/4 shards \(100%\) \| 512 rows \| [\d.,]+ rows/s \| eta 0:00:00$", console, re.M
    )
    assert "shards: 4 embedded, 0 already done (skipped), 0 failed, of 4" in console
    table = pq.read_table(embeddings)
    assert table.num_rows == 512 and len(set(table.column("key").to_pylist())) == 512
    assert f"embeddings: {embeddings}  (512 rows of 512 images, D = 64)" in console

    # Fine-tuning at 48 px, evaluated on 128 held-out images of another seed (chance: 10%).
    finetuned = json.loads((out / "finetuned" / "final" / "config.json").read_text())["model"]
    assert (finetuned["head"], finetuned["image_size"], finetuned["num_classes"]) == ("finetune", 48, 10)
    tuned = re.search(
        r"^fine-tuned: .*\(48 px, eval accuracy (\d+)% on held-out/ at step 30\)$", console, re.M
    )
    assert tuned and int(tuned[1]) >= 60, console[-3000:]

    # The paper's Fig. 7 panels of the pretrained model, and where they are.
    figures = sorted((out / "analysis").glob("*.png"))
    assert [f.name for f in figures] == [
        "attention_distance.png",
        "patch_embedding_filters.png",
        "position_embedding_similarity.png",
    ]
    assert f"figures:    {', '.join(str(f) for f in figures)}" in console
    analysis = json.loads((out / "analysis" / "analysis.json").read_text())
    assert len(analysis["mean_attention_distance"]) == 2  # the tiny model's 2 layers
    assert console.rstrip().endswith("ray down cluster/aws.yaml")


def with_corrupt_shard(directory: Path) -> list[str]:
    """32 synthetic images in two shards under ``directory``, the second's images not images: a job passes
    the checks before Ray on the first shard, then meets the corrupt samples in the run."""
    from pipeline.data.synthetic import write_synthetic_shards

    shards = write_synthetic_shards(directory, 32, samples_per_shard=16, image_size=32)
    second = Path(shards.urls[1])
    members = []
    with tarfile.open(second) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            members.append((member, b"not an image" if member.name.endswith(".jpg") else data))
    with tarfile.open(second, "w") as tar:
        for member, data in members:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return shards.urls


# Beyond `noise`: in a run that succeeds, any line from a Ray process other than the training workers
# (whose lines are vitray's progress), any traceback and any log record in Ray's formats is foreign.
FOREIGN = re.compile(
    r"\((?!RayTrainWorker pid=)\w+ pid=\d+|Traceback|^\s+File \"|\.(?:cc|py):\d+|\b(?:WARNING|ERROR)\b"
)


def foreign(console: str) -> list[str]:
    return [line for line in console.splitlines() if NOISE.search(line) or FOREIGN.search(line)]


@pytest.mark.slow
def test_runs_at_once_on_busy_cpus_show_vitray_lines_a_failing_one_its_error_and_verbose_ray_too(
    tiny_export_32px, tmp_path, subtests
):
    """Four jobs at once while a busy loop takes a core (Ray's actors then answer late, and its periodic
    lines come in numbers), one scenario each (named in a failure): a pretraining with a report every step
    and a checkpoint every 4 and a fine-tuning print only vitray's lines; an embedding that meets corrupt
    images past its bad-sample budget still shows its one error line; with --verbose, Ray's lines are back."""
    from pipeline.data.synthetic import write_synthetic_shards

    shards = write_synthetic_shards(tmp_path / "shards", 128, samples_per_shard=32, image_size=32)
    held_out = write_synthetic_shards(tmp_path / "held-out", 32, samples_per_shard=32, image_size=32, seed=1)
    corrupt = with_corrupt_shard(tmp_path / "corrupt")
    small = ["--num-workers", "2", "--batch-size", "16", "--micro-batch-size", "8", "--warmup-steps", "2"]
    busy, jobs = subprocess.Popen([sys.executable, "-c", "while True: pass"]), []
    try:
        jobs += [
            started("pretrain.py", "--preset", "tiny", "--data", shards.dir, "--out", str(tmp_path / "run"),
                    *small, "--max-steps", "8", "--log-every", "1", "--checkpoint-every", "4"),
            # From an export of the same model, so that it need not wait for the pretraining.
            started("finetune.py", "--weights", tiny_export_32px, "--data", shards.dir, "--eval-data",
                    held_out.dir, "--out", str(tmp_path / "tuned"), "--image-size", "32", "--num-classes", "10",
                    "--cpu", *small, "--max-steps", "3", "--log-every", "1", "--checkpoint-every", "2"),
            started("pretrain.py", "--preset", "tiny", "--data", shards.dir, "--out", str(tmp_path / "v"),
                    *small, "--max-steps", "3", "--log-every", "1", "--verbose"),
            started("embed.py", "--data", ",".join(corrupt), "--weights", tiny_export_32px,
                    "--out", str(tmp_path / "emb"), "--max-bad-fraction", "0"),
        ]  # fmt: skip
        pretrain, finetune, verbose, failing = (finished(j, timeout=600) for j in jobs)
    finally:
        for process in (*(j.process for j in jobs), busy):
            process.kill()
        busy.wait()
    with subtests.test(msg="a pretraining prints only vitray's lines"):
        assert pretrain.returncode == 0, pretrain.stdout[-4000:]
        assert len(re.findall(r"^\(RayTrainWorker pid=\d+\) step \d+/8 ", pretrain.stdout, re.M)) == 8
        assert "finished at step 8:" in pretrain.stdout
        # Slow steps on busy CPUs are no hang: the watchdog's default bound is never reached.
        assert "hang: " not in pretrain.stdout and not (tmp_path / "run" / "hangs").exists()
        assert not foreign(pretrain.stdout), foreign(pretrain.stdout)
    with subtests.test(msg="a fine-tuning prints only vitray's lines"):
        assert finetune.returncode == 0, finetune.stdout[-4000:]
        assert re.search(
            r"^finished at step 3: loss [\d.]+, accuracy [\d.]+%, eval accuracy", finetune.stdout, re.M
        )
        assert not foreign(finetune.stdout), foreign(finetune.stdout)
    with subtests.test(msg="a failing run still shows its error"):
        assert failing.returncode == 1, failing.stdout[-4000:]
        errors = [line for line in failing.stdout.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "bad" in errors[0], failing.stdout[-4000:]
        assert not noise(failing.stdout), noise(failing.stdout)
    with subtests.test(msg="--verbose: Ray's console as Ray gives it, every rank's report line among it"):
        assert verbose.returncode == 0, verbose.stdout[-4000:]
        assert re.search(QUIET_LINES["ray_train_report"], verbose.stdout), verbose.stdout[-3000:]
        assert foreign(verbose.stdout)
