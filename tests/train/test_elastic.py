"""Resume at another world size or micro-batch size, by sample (`pipeline.train.input.position`): the worker
loop in-process, ranks as processes (gloo), over a stream that stands in for the Ray Data pipeline
with the read stage's columns (``index``, ``shard_size``), its skipping of consumed samples, a seeded
shuffle buffer before bad rows are counted and removed, and the real `rebatch`.

Arithmetic: 6 shards of 8, 9, 14, 7, 11 and 10 samples (59), 3 corrupt (one the last of its shard, so
a shard's size also reaches the position through a bad sample): 56 good samples an epoch, at least 7
in every shard, so a rank's first step is full whichever shard it reads alone. Batch 24 of
micro-batches of 2: 3 per rank step with 4 workers, 6 with 2, 4 with 3. A stop at step 2 falls inside
epoch 0 whatever the layout, with samples still in shuffle buffers.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipeline import dcp
from pipeline.data.dataset import rebatch
from pipeline.data.rows import sample_keys
from pipeline.train.state import TrainState
from tests.configs import tiny_config
from tests.distributed import spawn
from tests.native_rows import as_native
from tests.train.test_audit import audited, sized
from tests.train.test_loop import LocalSession

SIZES = {f"mem://data/shard-{i}": n for i, n in enumerate((8, 9, 14, 7, 11, 10))}
CORRUPT = {"mem://data/shard-1/8", "mem://data/shard-2/0", "mem://data/shard-4/5"}
GOOD = sorted(f"{url}/{i}" for url, n in SIZES.items() for i in range(n) if f"{url}/{i}" not in CORRUPT)
BUFFER = 5  # samples in the stand-in shuffle buffer


def stand_in(sizes: dict[str, int], corrupt: set[str], tag=lambda epoch: ""):
    """A `pipeline.data.dataset.micro_batches` over shards of ``sizes`` whose ``corrupt`` samples are bad;
    a key is ``url/index`` and ``tag(epoch)``."""

    def indexed(shards, data_config, *, epoch, rank, size, bad_samples, data_cpus, root=None, skip=None):
        return _indexed(sizes, corrupt, tag(epoch), shards, data_config, epoch, rank, size, bad_samples, skip)

    return indexed


def _indexed(sizes, corrupt, tag, shards, data_config, epoch, rank, size, bad_samples, skip):
    """`pipeline.data.dataset.micro_batches` without Ray: rows in shard order and tar order, those in
    ``skip`` read past (the last row read of a shard carries its size, as `read_shard` does), through a
    seeded shuffle buffer, bad rows counted and removed, cut by `rebatch`."""
    patches = (data_config.image_size // data_config.patch_size) ** 2
    patch_dim = data_config.patch_size**2 * 3
    skip = skip or {}

    def rows():
        for url in shards:
            n, consumed = sizes[url], skip.get(url)
            kept = [i for i in range(n) if consumed is None or i not in consumed]
            for i in kept:
                yield url, i, n if i == kept[-1] else -1

    def shuffled():
        rng, held = random.Random(f"{epoch}/{rank}"), []
        for row in rows():
            held.append(row)
            if len(held) > BUFFER:
                yield held.pop(rng.randrange(len(held)))
        while held:
            yield held.pop(rng.randrange(len(held)))

    def batches():
        pending = []
        for row in shuffled():
            pending.append(row)
            if len(pending) == size:
                yield batch(pending)
                pending = []
        if pending:
            yield batch(pending)

    def batch(rows):
        keys = [f"{url}/{i}" for url, i, _ in rows]
        g = np.random.default_rng([epoch % 2**32, *(i + 100 * int(url[-1]) for url, i, _ in rows)])
        return bad_samples.filter(
            native(
                {
                    "key": np.array([k + tag for k in keys]),
                    "url": np.array([url for url, _, _ in rows]),
                    "patches": g.integers(0, 256, (len(rows), patches, patch_dim), dtype=np.uint8),
                    "label": g.integers(0, 4, len(rows)),
                    "error": np.array(
                        ["truncated image: test" if k in corrupt else "" for k in keys], dtype=object
                    ),
                    "index": np.array([i for _, i, _ in rows]),
                    "shard_size": np.array([s for _, _, s in rows]),
                }
            )
        )

    def native(rows):  # native-aspect images (``--patches native``): each key its own grid
        return as_native(rows, data_config, epoch) if data_config.native else rows

    yield from rebatch(batches(), size)


indexed_micro_batches = stand_in(SIZES, CORRUPT)


def config(out: Path, world: int, **changes):
    return tiny_config(
        out=str(out), num_workers=world, batch_size=24, micro_batch_size=2, max_steps=9, log_every=1,
        checkpoint_every=100, prefetch_steps=2,
    ).replace(**changes)  # fmt: skip


def _run(
    rank: int, world: int, root: str, runs: list[tuple[str, dict]], mixed=None, ray_address: str | None = None
) -> None:
    """Each of ``runs`` (name, config changes) in turn on ``world`` ranks; rank 0 writes every step's
    (epoch, keys of every rank, bad samples counted on every rank, and per source) to
    ``root``/<name>.json. ``mixed``: (sources, sizes, corrupt) of a mixed run over a `stand_in`
    whose keys end with ``@`` and the epoch number their pass reads with, else the shards of `SIZES`.
    ``ray_address``: the Ray each rank joins, for runs whose pipeline is in a feeder (``data_process``)."""
    from pipeline.train import loop
    from pipeline.train.input import dataplan

    if ray_address is not None:
        import ray

        ray.init(address=ray_address, log_to_driver=False)

    # This process is the test's own.
    if mixed is None:
        dataplan.micro_batches, data = indexed_micro_batches, {"shards": list(SIZES)}
    else:
        mix, sizes, corrupt = mixed
        dataplan.micro_batches = stand_in(sizes, corrupt, tag=lambda epoch: f"@{epoch}")
        data = {"shards": [url for s in mix for url in s["shards"]], "sources": mix}
    steps: list = []

    class Steps(loop.StepWatch):
        def taken(self, step):
            counts = step.bad_samples
            bad = {name: c["bad"] for name, c in counts.sources.items()}
            steps.append((step.epoch, list(step.keys), counts.bad, bad))

    for name, changes in runs:
        cfg = config(Path(root) / changes.pop("dir", name), world, **changes)
        session = LocalSession(torch.device("cpu"), Path(cfg.run.out), rank, world)
        loop_config = {"train": cfg.to_dict(), **data, "data_cpus_per_worker": 1.0}
        summary = loop.Trainer(loop_config, session, Steps()).train()
        dist.barrier()  # every rank's checkpoint files are in place before a resume reads them
        ranks: list = [None] * world
        dist.all_gather_object(ranks, list(steps))
        steps.clear()
        if rank == 0:
            rows = [
                (
                    r[0][0],
                    [one[1] for one in r],
                    sum(one[2] for one in r),
                    dict(sum_counts(one[3] for one in r)),
                )
                for r in zip(*ranks, strict=True)
            ]
            record = {"steps": rows, "error": summary["error"], "bad": summary["bad_samples"]["bad"]}
            (Path(root) / f"{name}.json").write_text(json.dumps(record))


def sum_counts(counts):
    return sum((collections.Counter(c) for c in counts), collections.Counter())


def epochs(*records: dict) -> dict[int, list[str]]:
    """Every key trained, by epoch, over the steps of ``records`` in turn."""
    out = collections.defaultdict(list)
    for record in records:
        for epoch, keys, *_ in record["steps"]:
            out[epoch] += [k for rank in keys for k in rank]
    return out


def bad_at_epoch_ends(*records: dict, per_source: bool = False) -> dict[int, Any]:
    """The run's bad samples counted (all ranks; or per source, a dict) at each epoch's last step."""
    steps = [s for r in records for s in r["steps"]]
    ends = [step for step, nxt in zip(steps, [*steps[1:], (None,)], strict=True) if nxt[0] != step[0]]
    return {step[0]: step[3] if per_source else step[2] for step in ends}


@pytest.mark.slow  # 4 ranks then 2, then 2 ranks then 3: about a minute of CPU (each feeder: more)
@pytest.mark.parametrize(
    ("before", "after", "data_process", "patches"),
    [
        (4, 2, "inline", "square"),
        (2, 3, "inline", "square"),
        (2, 3, "feeder", "square"),
        (3, 2, "inline", "native"),
    ],
)
def test_a_run_resumed_with_other_workers_trains_each_sample_of_the_epoch_once(
    request, tmp_path, before, after, data_process, patches
):
    """Also with native-aspect images, in micro-batches of one token budget."""
    address = None
    if data_process == "feeder":  # every rank's feeder an actor of the shared local Ray
        address = request.getfixturevalue("ray_session").get_runtime_context().gcs_address
    mode = {"patches": patches, "max_patches": 20 if patches == "native" else None}
    stop = {"dir": "stopped", "stop_at_step": 2, "data_process": data_process, **mode}
    straight = ("straight", {"data_process": data_process, **mode})
    joins = address is not None
    spawn(_run, before, str(tmp_path), [straight, ("stopped", dict(stop))], None, address, world_size=before,
          joins_ray=joins)  # fmt: skip
    resumed = ("resumed", {"dir": "stopped", "num_workers": after, "data_process": data_process, **mode})
    spawn(_run, after, str(tmp_path), [resumed], None, address, world_size=after, joins_ray=joins)
    read = {
        name: json.loads((tmp_path / f"{name}.json").read_text())
        for name in ("straight", "stopped", "resumed")
    }
    assert [r["error"] for r in read.values()] == ["", "", ""]
    stopped, resumed = read["stopped"], read["resumed"]
    assert len(stopped["steps"]) == 2 and {e for e, *_ in stopped["steps"]} == {0}
    assert len(read["straight"]["steps"]) == 2 + len(resumed["steps"]) == 9
    # The checkpoint at the stop named samples still in shuffle buffers: consumption is no prefix.
    saved = TrainState.from_dict(
        json.loads((tmp_path / "stopped" / dcp.checkpoint_name(2) / "train_state.json").read_text())
    )
    assert saved.epoch_consumed["partial"], saved.epoch_consumed

    straight, elastic = epochs(read["straight"]), epochs(stopped, resumed)
    complete = sorted(elastic)[:-1]  # the last epoch may have been cut by --max-steps
    assert complete and complete[0] == 0, sorted(elastic)
    for epoch in complete:
        # The multiset of keys: every good sample once, no corrupt one, none twice, as a straight run.
        assert collections.Counter(elastic[epoch]) == collections.Counter(GOOD), epoch
        if epoch in straight and epoch < sorted(straight)[-1]:
            assert collections.Counter(straight[epoch]) == collections.Counter(elastic[epoch]), epoch
    # Each corrupt sample counted once an epoch across the resume: 3 by the end of epoch 0, 6 of 1 ...
    ends = bad_at_epoch_ends(stopped, resumed)
    assert all(ends[e] == len(CORRUPT) * (e + 1) for e in complete), ends
    report = audited(tmp_path / "stopped", list(SIZES), sized(SIZES))  # and its ledger, against the shards
    assert report.ok and report.finished == len(complete), report.format()


def run_in_turn(*configs, watch=None) -> None:
    """Each config's run in this process (one worker) over the shards of `SIZES`, in turn, each without
    an error: a run and its resumes, each step seen by ``watch`` (a `loop.StepWatch`)."""
    from pipeline.train import loop

    for cfg in configs:
        session = LocalSession(torch.device("cpu"), Path(cfg.run.out))
        loop_config = {"train": cfg.to_dict(), "shards": list(SIZES), "data_cpus_per_worker": 1.0}
        assert loop.Trainer(loop_config, session, watch).train()["error"] == ""


@pytest.mark.parametrize("patches", ["square", "native"])
def test_a_resume_at_another_micro_batch_size_goes_on_by_sample(
    world, monkeypatch, tmp_path, capsys, data_process, patches
):
    """One worker, batch 8: 7 steps an epoch. Stopped at step 3 with micro-batches of 4, resumed with
    micro-batches of 2: epoch 0 still trains every good sample once, and counts each bad one once.
    Also with native-aspect images (micro-batches of 4 x 20 tokens, then 2 x 20)."""
    from pipeline.train import loop
    from pipeline.train.input import dataplan

    monkeypatch.setattr(dataplan, "micro_batches", indexed_micro_batches)
    steps: list = []

    class Steps(loop.StepWatch):
        def taken(self, step):
            steps.append((step.epoch, [list(step.keys)], step.bad_samples.bad, {}))

    stopped = config(
        tmp_path, 1, batch_size=8, micro_batch_size=4, max_steps=9, stop_at_step=3, data_process=data_process,
        patches=patches, max_patches=20 if patches == "native" else None,
    )  # fmt: skip
    run_in_turn(stopped, stopped.replace(stop_at_step=None, micro_batch_size=2), watch=Steps())
    record = {"steps": steps}
    if patches == "square":  # native steps hold as many images as their lengths let in
        assert [e for e, *_ in steps] == [0] * 7 + [1] * 2
    saved = json.loads((tmp_path / dcp.checkpoint_name(3) / "train_state.json").read_text())
    assert saved["epoch_consumed"]["partial"]  # stopped inside the epoch
    assert collections.Counter(epochs(record)[0]) == collections.Counter(GOOD)
    assert bad_at_epoch_ends(record)[0] == len(CORRUPT)
    assert "the workers share the samples this epoch had not consumed, each once" in capsys.readouterr().out
    report = audited(tmp_path, list(SIZES), sized(SIZES))
    assert report.ok and report.lines[0] == "epoch 0: finished, 59 samples (3 bad): every one once", (
        report.format()
    )
    if patches == "square":  # 2 steps, 1 bad read (native steps: as many images as fit)
        assert report.lines[1] == "epoch 1: current, 17 samples (1 bad): every one once"


def test_the_real_pipeline_goes_on_by_sample_at_another_micro_batch_size(
    world, ray_session, synthetic_shards, monkeypatch, tmp_path, capsys
):
    """The same resume through Ray Data (read, decode, the shuffle buffer of 1,024 holding the whole
    epoch, so the samples trained before the stop are scattered over all 4 shards): 48 samples, batch
    8, stopped at step 2 with micro-batches of 4, resumed with micro-batches of 2."""
    from pipeline.train import loop

    steps: list = []

    class Steps(loop.StepWatch):
        def taken(self, step):
            steps.append((step.epoch, [list(step.keys)], step.bad_samples.bad))

    stopped = config(tmp_path, 1, batch_size=8, micro_batch_size=4, max_steps=7, stop_at_step=2)
    for cfg in (stopped, stopped.replace(stop_at_step=None, micro_batch_size=2)):
        session = LocalSession(torch.device("cpu"), Path(cfg.run.out))
        loop_config = {"train": cfg.to_dict(), "shards": synthetic_shards.urls, "data_cpus_per_worker": 1.0}
        assert loop.Trainer(loop_config, session, Steps()).train()["error"] == ""
    saved = json.loads((tmp_path / dcp.checkpoint_name(2) / "train_state.json").read_text())
    assert len(saved["epoch_consumed"]["partial"]) > 1  # samples taken from more than one shard
    assert [e for e, _, _ in steps] == [0] * 6 + [1]
    assert sorted(epochs({"steps": steps})[0]) == sorted(synthetic_shards.keys)
    assert "the workers share the samples this epoch had not consumed" in capsys.readouterr().out
    report = audited(tmp_path, synthetic_shards.urls, sample_keys)  # the ledger against the tar shards
    assert report.ok and report.lines[0] == "epoch 0: finished, 48 samples (0 bad): every one once", (
        report.format()
    )
