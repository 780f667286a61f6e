"""The embedding job's progress line: shards done / total, rows, rows/s, eta; one line per interval."""

from __future__ import annotations

import io

from pipeline.embed.progress import EmbedProgress, bar


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_and_one_at_the_end():
    clock, out = Clock(), io.StringIO()
    progress = EmbedProgress(4, interval_s=10, stream=out, live=False, clock=clock)
    for seconds in (4, 8, 12, 16):  # shards committed at t = 4, 8, 12, 16 s, 128 rows each
        clock.now = 100.0 + seconds
        progress.on_commit(f"shard-{seconds}.tar", {"file": "x.parquet", "rows": 128})
    assert out.getvalue().splitlines() == [
        # t = 12 s: the first shard past the 10 s interval (3 of 4 done, 4 s per shard, one to go)
        "embedded 3/4 shards (75%) | 384 rows | 32.0 rows/s | eta 0:00:04",
        # the last shard always gets its line
        "embedded 4/4 shards (100%) | 512 rows | 32.0 rows/s | eta 0:00:00",
    ]


def test_a_terminal_gets_one_live_line_redrawn_in_place():
    clock, out = Clock(), io.StringIO()
    progress = EmbedProgress(2, stream=out, live=True, clock=clock)
    clock.now += 5
    progress.on_commit("a.tar", {"rows": 10})
    assert out.getvalue().startswith("\r[" + "#" * 12 + "-" * 12 + "] embedded 1/2 shards (50%)")
    assert "\n" not in out.getvalue()
    clock.now += 5
    progress.on_commit("b.tar", {"rows": 10})
    assert out.getvalue().endswith("eta 0:00:00\x1b[K\n")  # the finished bar stays, on its own line


def test_bar():
    assert bar(0, 4, width=8) == "[--------]"
    assert bar(1, 4, width=8) == "[##------]"
    assert bar(4, 4, width=8) == "[########]"
