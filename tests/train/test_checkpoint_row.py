"""The worker loop's order at a checkpoint, in one process without Ray, with rank 0's `metrics.jsonl` on
an object store (fsspec's ``memory://``: written at flushes only, as on S3): the checkpoint's row is in
storage before its save begins, and the file is written once per checkpoint.

The loop runs on the fake data of `tests.train.test_loop` (8 steps, a row every 2, checkpoints at 4 and 8).
"""

from __future__ import annotations

import json

from pipeline import storage
from pipeline.train import loop
from pipeline.train.checkpointing.saver import Checkpointer
from pipeline.train.input import dataplan
from pipeline.train.observe.metrics import METRICS_FILE, MetricsLog
from tests.train.test_loop import config, fake_micro_batches, run


def test_a_checkpoints_row_is_stored_once_and_before_its_save_on_an_object_store(
    world, monkeypatch, tmp_path
):
    store = storage.as_location(f"memory://checkpoint-row/{tmp_path.name}")
    events: list[tuple[str, object]] = []  # ("write", steps in the file) and ("save", step), in order

    real_write, real_save = storage.write_text, Checkpointer.save

    def write_text(where, text):
        if str(where).endswith(METRICS_FILE):
            events.append(("write", [json.loads(line)["step"] for line in text.splitlines()]))
        real_write(where, text)

    def save(self, state, check, metrics):
        events.append(("save", state.step))
        return real_save(self, state, check, metrics)

    monkeypatch.setattr(dataplan, "micro_batches", fake_micro_batches)
    monkeypatch.setattr(storage, "write_text", write_text)
    monkeypatch.setattr(Checkpointer, "save", save)
    monkeypatch.setattr(
        loop, "MetricsLog", lambda run_dir, resume_step=0, **kw: MetricsLog(store, resume_step, **kw)
    )

    summary, _ = run(config(tmp_path / "run"), world)

    assert summary["error"] == ""
    # Each checkpoint: its row written, then its save, and no other write of the file until the next
    # checkpoint's; the end of the run writes the last checkpoint's stall.
    assert events == [
        ("write", [2, 4]),
        ("save", 4),
        ("write", [2, 4, 6, 8]),
        ("save", 8),
        ("write", [2, 4, 6, 8]),
    ]
    rows = [json.loads(line) for line in storage.read_text(store.join(METRICS_FILE)).splitlines()]
    stalls = {r["step"]: r.get("checkpoint_stall_s") for r in rows}
    assert stalls[2] is None and stalls[6] is None
    assert all(isinstance(stalls[s], float) for s in (4, 8)), stalls  # it reached the file at the next write
