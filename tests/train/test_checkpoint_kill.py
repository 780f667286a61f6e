"""SIGKILL while a checkpoint is being written: the run resumes from the last complete checkpoint.

The worker loop runs in one process without Ray, on the fake data of `tests.train.test_loop` (4 steps an
epoch, so checkpoints 4 and 8 fall on epoch edges). Its session stands in for Ray Train's upload: each
checkpoint is copied into the run directory file by file, each file written in place, as Ray Train's
copy into a local or mounted `--out` does; rank 0's small files go first, the shard file last, so a cut
leaves the metadata beside a short shard file. A subprocess trains and kills itself (SIGKILL) halfway
through copying checkpoint 8's shard file; the same run started again must resume from checkpoint 4.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline import dcp
from pipeline.train import loop
from pipeline.train.config import TrainConfig
from pipeline.train.driver import format_summary, read_metrics
from pipeline.train.input import dataplan
from pipeline.train.step.model import init_distributed, model_config
from tests.train.test_loop import SHARDS, config, fake_micro_batches, untimed

ROOT = Path(__file__).resolve().parents[2]
SHARD_FILE = "__0_0.distcp"  # a world of one writes one shard file
CHECKPOINT_FILES = (dcp.METADATA, dcp.TRAIN_STATE, dcp.CONFIG, SHARD_FILE)


class UploadingSession:
    """Ray Train's part, in one process: a checkpoint is copied into ``run_dir`` file by file (each file
    written in place, the shard file last); with ``kill_in`` = (checkpoint name, file name) this process
    SIGKILLs itself halfway through that file. A resume takes the latest complete checkpoint there."""

    rank, world, node_id = 0, 1, "local"

    def __init__(self, device: torch.device, run_dir: Path, kill_in: tuple[str, str] | None = None):
        self.device, self.run_dir, self.kill_in = device, run_dir, kill_in
        self.reports: list[dict] = []

    @contextlib.contextmanager
    def resume_from(self):
        latest = dcp.latest_complete(self.run_dir) if self.run_dir.exists() else None
        yield None if latest is None else (Path(latest.local_path), latest.url)

    def report(self, metrics: dict, checkpoint_dir: str | None = None, name: str = "", written=None) -> None:
        self.reports.append(metrics)
        if written is not None:  # an asynchronous save: its files are whole once DCP has written them
            written.result()
        if checkpoint_dir is None:
            return
        target = self.run_dir / name
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(Path(checkpoint_dir).iterdir(), key=lambda p: (p.name == SHARD_FILE, p.name)):
            data = source.read_bytes()
            with open(target / source.name, "wb") as out:
                if (name, source.name) == self.kill_in:
                    out.write(data[: len(data) // 2])
                    out.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                out.write(data)


def train(cfg: TrainConfig, session: UploadingSession) -> dict:
    loop_config = {"train": cfg.to_dict(), "shards": SHARDS, "data_cpus_per_worker": 1.0}
    return loop.Trainer(loop_config, session).train()


def train_and_kill(out: str, threads: int) -> None:
    """The killed run, in a subprocess of its own: 8 steps from scratch, killed inside checkpoint 8's copy;
    on the test process's torch threads, so that its steps round as the straight run's do."""
    torch.set_num_threads(threads)
    _, _, device = init_distributed()
    dataplan.micro_batches = fake_micro_batches
    session = UploadingSession(device, Path(out), kill_in=(dcp.checkpoint_name(8), SHARD_FILE))
    train(config(Path(out)), session)


def model_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    cfg = config(run)
    return dcp.load_model_state(str(run / dcp.checkpoint_name(step)), model_config(cfg))


@pytest.fixture(scope="module")
def killed_and_straight(world, tmp_path_factory):
    """A run SIGKILLed inside checkpoint 8's copy (a subprocess) and, meanwhile, the same run straight."""
    root = tmp_path_factory.mktemp("kill")
    killed, straight = root / "killed", root / "straight"
    code = (
        "from tests.train.test_checkpoint_kill import train_and_kill; "
        f"train_and_kill({str(killed)!r}, {torch.get_num_threads()})"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dataplan, "micro_batches", fake_micro_batches)
        summary = train(config(straight), UploadingSession(world, straight))
    output, _ = process.communicate(timeout=240)
    assert process.returncode == -signal.SIGKILL, output[-3000:]
    assert summary["error"] == "" and summary["metrics"]["step"] == 8
    return killed, straight


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(
    killed_and_straight, world, monkeypatch
):
    killed, straight = killed_and_straight
    cut = killed / dcp.checkpoint_name(8)
    # What the kill left: checkpoint 8's rank-0 files whole, its shard file half there.
    assert {p.name for p in cut.iterdir()} == set(CHECKPOINT_FILES)
    whole = (straight / dcp.checkpoint_name(8) / SHARD_FILE).stat().st_size
    assert (cut / SHARD_FILE).stat().st_size == whole // 2
    assert not dcp.is_complete(cut)
    assert dcp.latest_complete(killed).url == str(killed / dcp.checkpoint_name(4))
    # Row 8 is stored before its save (without the save's stall): the kill inside the save left rows 2 to 8.
    assert [r["step"] for r in read_metrics(str(killed))] == [2, 4, 6, 8]

    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    session = UploadingSession(world, killed)
    summary = train(config(killed), session)  # the same run, started again

    assert summary["error"] == "" and summary["metrics"]["step"] == 8
    resumed = summary["resumed_from"]
    assert resumed["checkpoint"] == str(killed / dcp.checkpoint_name(4)) and resumed["step"] == 4
    lost = 8 - resumed["step"]
    assert lost <= config(killed).run.checkpoint_every
    assert [r["step"] for r in session.reports] == [6, 8]
    assert dcp.is_complete(cut)  # written again, whole
    # One history, equal to the straight run's, and the straight run's parameters (step 8 is an epoch edge).
    assert untimed(read_metrics(str(killed))) == untimed(read_metrics(str(straight)))
    a, b = model_weights(straight, 8), model_weights(killed, 8)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    final_a = load_file(straight / "final" / "weights.safetensors")
    final_b = load_file(killed / "final" / "weights.safetensors")
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name


def cut_copies(files: dict[str, bytes]):
    """Every state a kill can leave a checkpoint's copy in: any proper subset of its files whole, plus
    at most one more file cut at 0 bytes, 1 byte, half, or one byte short."""
    names = list(files)
    for k in range(len(names)):
        for whole in itertools.combinations(names, k):
            yield {n: files[n] for n in whole}
            for partial in (n for n in names if n not in whole):
                data = files[partial]
                for cut in sorted({0, 1, len(data) // 2, len(data) - 1}):
                    yield {**{n: files[n] for n in whole}, partial: data[:cut]}


def test_a_checkpoint_copy_cut_anywhere_is_never_taken_as_complete(killed_and_straight, tmp_path):
    _, straight = killed_and_straight
    run = tmp_path / "run"
    shutil.copytree(straight / dcp.checkpoint_name(4), run / dcp.checkpoint_name(4))
    source = straight / dcp.checkpoint_name(8)
    files = {name: (source / name).read_bytes() for name in CHECKPOINT_FILES}
    target = run / dcp.checkpoint_name(8)
    states = 0
    for state in cut_copies(files):
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        for name, data in state.items():
            (target / name).write_bytes(data)
        assert not dcp.is_complete(target), sorted((n, len(d)) for n, d in state.items())
        assert dcp.latest_complete(run).url == str(run / dcp.checkpoint_name(4))
        states += 1
    assert states == 143
    for name, data in files.items():  # and whole, it is
        (target / name).write_bytes(data)
    assert dcp.latest_complete(run).url == str(target)


def test_a_run_killed_after_its_last_checkpoint_run_again_exports_and_says_so(
    killed_and_straight, world, monkeypatch, tmp_path, capsys
):
    """Killed between its last checkpoint and the export (what remains: the straight run without
    final/), the same run started again resumes at the end of its schedule: no step, the export, and a
    summary that says so."""
    _, straight = killed_and_straight
    run = tmp_path / "run"
    shutil.copytree(straight, run, ignore=shutil.ignore_patterns("final"))
    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    session = UploadingSession(world, run)
    summary = train(config(run), session)
    assert summary["error"] == "" and summary["resumed_from"]["step"] == 8 and session.reports == []
    # Its log says no sample is read again (the epoch position would say so for a resume mid-epoch).
    resumed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1 and resumed[0].endswith(": the schedule is done, nothing is re-read"), resumed
    printed = format_summary(summary, config(run))
    assert printed.startswith(
        "\nfinished at step 8: resumed at the end of the schedule, nothing left to train"
    )
    assert "samples read: 72, skipped as bad: 8" in printed
    assert [r["step"] for r in read_metrics(str(run))] == [2, 4, 6, 8]
    final_a = load_file(straight / "final" / "weights.safetensors")
    final_b = load_file(run / "final" / "weights.safetensors")
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name
    # The export records the training it came from, as the straight run's did (not nulls).
    trained_a, trained_b = (
        json.loads((r / "final" / "config.json").read_text())["training"] for r in (straight, run)
    )
    assert trained_b["loss"] is not None and trained_b["accuracy"] is not None
    assert {k: trained_b[k] for k in ("step", "loss", "accuracy")} == {
        k: trained_a[k] for k in ("step", "loss", "accuracy")
    }
