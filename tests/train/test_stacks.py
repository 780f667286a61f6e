"""The training thread's stack sampler (`pipeline.train.observe.stacks`) and its per-window summary."""

from __future__ import annotations

import threading
import time

from pipeline.train.observe import stacks
from pipeline.train.observe.stacks import table, windows

# Two functions whose frames look like the loop's: waiting for input, and the step.
LOOP = (
    compile("import time\ndef next(seconds):\n    time.sleep(seconds)\n", "prefetch.py", "exec"),
    compile("import time\ndef update(seconds):\n    time.sleep(seconds)\n", "train_step.py", "exec"),
)


def test_samples_fall_into_the_log_windows_and_say_where_the_thread_waited(tmp_path, monkeypatch):
    monkeypatch.setenv(stacks.ENV, str(tmp_path))
    monkeypatch.setattr(stacks, "_out", None)
    wait, step = ({}, {})
    exec(LOOP[0], wait)
    exec(LOOP[1], step)

    def training_thread():
        stacks.start(rank=3)
        wait["next"](0.4)  # a window spent waiting for data
        stacks.mark(10)
        step["update"](0.4)  # a window spent in the step
        stacks.mark(20)
        step["update"](0.2)  # after the last mark (a run's end): a window of no step

    thread = threading.Thread(target=training_thread)
    thread.start()
    thread.join()
    time.sleep(3 * stacks.INTERVAL_S)  # the sampler sees the thread gone and stops
    stacks._out.close()
    found = windows((tmp_path / "stacks-rank3.tsv").read_text().splitlines())
    # Without the samples after the last mark the sampler could still catch the thread between its
    # last mark and its end, on a loaded machine: this list then ended in None too.
    assert [w.last_step for w in found] == [10, 20, None]
    first, second, end = found
    assert first.samples >= 10 and second.samples >= 10 and end.parts["step"] >= 5
    assert first.parts["data wait"] >= 0.8 * first.samples and second.parts["step"] >= 0.8 * second.samples
    assert 0.35 < first.end - first.start < 1.0
    lines = table(found, top=2).splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["10", "20", "end"]


def test_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(stacks.ENV, raising=False)
    monkeypatch.setattr(stacks, "_out", None)
    stacks.start(rank=0)
    stacks.mark(1)  # nothing to write to
    assert stacks._out is None and not list(tmp_path.iterdir())
