"""The ledger of what each epoch consumed (`pipeline.train.input.ledger`) and its audit against the shards
(`pipeline.train.audit`, `jobs/audit.py`), without Ray: the hash that no order changes, a record's round
trip, every rank's additions summed at a checkpoint, and an audit over real tar shards that passes on a
true ledger and names the shard of one altered (a sample counted twice, a shard skipped).

The fault scenarios' own runs are audited where they run (`audited`): the loop's resumes
(tests/train/test_loop.py, test_elastic.py, test_preemption.py, test_feeder.py, test_hang.py) and the
system tests' (a killed worker, moved shards, preemption, node loss and join).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.data.rows import sample_keys
from pipeline.data.shards import shard_id
from pipeline.train.audit import Report, audit, check, checkpoint_state
from pipeline.train.input.ledger import (
    MOD,
    PLAIN,
    Ledger,
    decode_parts,
    encode_part,
    key_hash,
    keys_hash,
    tally,
    tally_keyed,
)
from pipeline.train.input.position import EpochPosition
from pipeline.train.state import TrainState


def audited(out: Path | str, shards: list[str], keys_of: Callable[[str], list[str]], **kwargs) -> Report:
    """The audit of the run under ``out`` (its latest checkpoint) over ``shards``, read with ``keys_of``:
    what `jobs/audit.py` does, for runs whose shards are stand-ins."""
    _, state, _ = checkpoint_state(Path(out))
    return audit(state, shards, kwargs.pop("mixture", None), keys_of, **kwargs)


def sized(sizes: dict[str, int]) -> Callable[[str], list[str]]:
    """The keys of the stand-in streams' shards (``url/index``), ``sizes`` samples each."""
    return lambda url: [f"{shard_id(url)}/{i}" for i in range(sizes[shard_id(url)])]


def test_a_sets_hash_is_the_same_in_any_order_and_moves_with_a_repeat_or_a_gap():
    keys = [f"k{i}" for i in range(100)]
    shuffled = random.Random(0).sample(keys, len(keys))
    assert keys_hash(keys) == keys_hash(shuffled)
    assert keys_hash([*keys, "k3"]) != keys_hash(keys)  # one sample twice
    assert keys_hash(keys[:-1]) != keys_hash(keys)  # one left out
    assert (keys_hash(keys[:40]) + keys_hash(keys[40:])) % MOD == keys_hash(keys)  # parts add up
    rows = [("s0", k, PLAIN) for k in shuffled] + [("s1", "x", PLAIN)]
    assert sorted(tally(rows)) == [("s0", PLAIN, 100, keys_hash(keys)), ("s1", PLAIN, 1, key_hash("x"))]
    # A mixed run's bad samples carry (source, pass): the pass is the part's.
    assert tally_keyed([("s0", "a", 1, 2)]) == [("s0", 2, 1, key_hash("a"))]


def test_a_record_holds_each_part_dense_or_sparse_and_reads_back(world):
    shards = [f"/d/shard-{i}.tar" for i in range(6)]
    ledger = Ledger(shards)
    ledger.trained(tally((url, f"{url}/{i}", PLAIN) for url in shards for i in range(3)))  # every shard
    ledger.counted(tally([(shards[2], "bad-1", PLAIN)]))
    ledger.next_epoch()
    ledger.trained(tally([(shards[4], "k", PLAIN)]))  # one shard of 6: sparse
    record = ledger.gathered(None)
    assert set(record["parts"]) == {"0", "1"} and "slots" in record["parts"]["1"]
    assert "slots" not in record["parts"]["0"] and "bad" in record["parts"]["0"]
    parts = decode_parts(record["parts"])
    assert parts["0"][2] == [3, keys_hash(f"{shards[2]}/{i}" for i in range(3)), 1, key_hash("bad-1")]
    assert parts["1"] == {4: [1, key_hash("k"), 0, 0]}
    again = Ledger.resume(shards, json.loads(json.dumps(record)), step=9, epoch=1)
    assert again.base == parts and again.since is None and again.to_dict() == record
    # Of other shards, or none at all (an older checkpoint): a ledger that begins at the resume.
    assert Ledger.resume(shards[:5], record, step=9, epoch=1).since == {"step": 9, "epoch": 1}
    assert Ledger.resume(shards, {}, step=0, epoch=0).since is None
    assert encode_part({}, 6) == encode_part({0: [0, 0, 0, 0]}, 6)


def _sums(rank: int) -> None:
    shards = ["/d/a.tar", "/d/b.tar"]
    ledger = Ledger.resume(shards, {}, step=0, epoch=0)
    ledger.trained(tally([(shards[rank], f"{rank}-{i}", PLAIN) for i in range(rank + 2)]))
    record = ledger.gathered(None)
    ledger.trained(tally([(shards[0], "late", PLAIN)]))  # after the checkpoint: the next one's
    again = ledger.gathered(None)
    parts = decode_parts(record["parts"])["0"]
    assert parts == {0: [2, keys_hash(["0-0", "0-1"]), 0, 0], 1: [3, keys_hash(["1-0", "1-1", "1-2"]), 0, 0]}
    # Each rank's additions summed once: the second checkpoint adds both ranks' "late" to the first.
    assert decode_parts(again["parts"])["0"][0] == [4, keys_hash(["0-0", "0-1", "late", "late"]), 0, 0]


def test_a_checkpoint_sums_every_ranks_additions_once():
    from tests.distributed import spawn

    spawn(_sums)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from pipeline.data.synthetic import write_synthetic_shards

    return write_synthetic_shards(tmp_path_factory.mktemp("audit"), 24, samples_per_shard=8, image_size=16)


def true_state(urls: list[str], *, epochs: int, current: int) -> TrainState:
    """A checkpoint's state after ``epochs`` finished epochs over ``urls`` and ``current`` samples of the
    next (the first of each shard's, the first shard's first sample bad every epoch)."""
    ledger, position = Ledger(urls), EpochPosition(urls)
    for epoch in range(epochs + 1):
        for url in urls:
            keys = sample_keys(url)
            if epoch == epochs:
                keys = keys[:current]
                position.add((shard_id(url), i, -1) for i in range(current))
            good = keys[1:] if url == urls[0] else keys
            ledger.trained(tally((shard_id(url), k, PLAIN) for k in good))
            ledger.counted(tally((shard_id(url), k, PLAIN) for k in keys[: len(keys) - len(good)]))
        if epoch < epochs:
            ledger.next_epoch()
    ledger.base, ledger.added = ledger.added, {}
    bad = {"total": 24 * epochs + 3 * current, "bad": epochs + (current > 0)}
    return TrainState(step=7, epoch=epochs, ledger=ledger.to_dict(), epoch_consumed=position.to_dict(),
                      bad_samples=[bad])  # fmt: skip


def altered(state: TrainState, part: str, slot: int, change: Callable[[list[int]], list[int]]) -> TrainState:
    parts = decode_parts(state.ledger["parts"])
    parts[part][slot] = change(parts[part].get(slot, [0, 0, 0, 0]))
    ledger = {**state.ledger, "parts": {p: encode_part(e, state.ledger["count"]) for p, e in parts.items()}}
    return TrainState(**{**state.to_dict(), "ledger": ledger})


def test_the_audit_passes_a_true_ledger_and_names_the_shard_of_an_altered_one(shards):
    urls = shards.urls
    state = true_state(urls, epochs=2, current=3)
    report = audit(state, urls, None, sample_keys)
    assert report.ok, report.format()
    assert report.lines == [
        "epoch 0: finished, 24 samples (1 bad): every one once",
        "epoch 1: finished, 24 samples (1 bad): every one once",
        "epoch 2: current, 9 samples (1 bad): every one once",
    ]
    twice = sample_keys(urls[1])[5]  # one sample of the second shard counted twice in epoch 1
    report = audit(altered(state, "1", 1, lambda e: [e[0] + 1, (e[1] + key_hash(twice)) % MOD, *e[2:]]), urls,
                   None, sample_keys)  # fmt: skip
    assert not report.ok and [f.text() for f in report.findings] == [
        f"epoch 1: shard {urls[1]}: 9 counted (0 bad) of 8: 1 repeated"
    ]
    assert report.verdict() == f"1 shard(s) with missing or repeated samples ({urls[1]})"
    skipped = altered(state, "0", 2, lambda e: [0, 0, 0, 0])  # the third shard never read in epoch 0
    assert [f.text() for f in audit(skipped, urls, None, sample_keys).findings] == [
        f"epoch 0: shard {urls[2]}: 0 counted (0 bad) of 8: 8 missing"
    ]
    # One sample for another of the same shard: the count holds, the hash does not.
    swapped = altered(state, "2", 0, lambda e: [e[0], (e[1] + key_hash("x") - key_hash("x2")) % MOD, *e[2:]])
    assert (
        audit(swapped, urls, None, sample_keys).findings[0].text().endswith("some missing, others repeated")
    )
    # The ledger's bad samples are the run's counts.
    counts = TrainState(**{**state.to_dict(), "bad_samples": [{"total": 57, "bad": 2}]})
    assert audit(counts, urls, None, sample_keys).problems == [
        "bad samples: 3 in the ledger, 2 in the run's counts"
    ]


def test_shards_that_are_not_the_runs_or_no_ledger_are_one_line(shards):
    state = true_state(shards.urls, epochs=1, current=0)
    with pytest.raises(
        ValueError, match="the 2 shards found are not the run's \\(3 shards, named otherwise\\)"
    ):
        check(state, shards.urls[:2])
    with pytest.raises(ValueError, match="it holds no ledger"):
        check(TrainState(), shards.urls)
    unreadable = audit(state, shards.urls, None, lambda url: sample_keys(url + ".gone"))
    assert not unreadable.ok and unreadable.problems[0].startswith("unreadable: shard ")


def test_the_job_reads_the_latest_checkpoint_and_exits_1_naming_the_shard(world, shards, tmp_path):
    """`jobs/audit.py --run OUT` over a run directory whose checkpoint (a DCP directory of one tensor: what
    the audit reads is its ``train_state.json`` and ``config.json``) holds the true state, then one whose
    ledger skips a shard."""
    import torch
    import torch.distributed.checkpoint as torch_dcp

    from pipeline import dcp
    from tests.configs import tiny_config
    from tests.job_scripts import run_without_ray

    urls, run = shards.urls, tmp_path / "run"
    state = true_state(urls, epochs=1, current=2)
    checkpoint = run / dcp.checkpoint_name(7)
    torch_dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(checkpoint))
    (checkpoint / dcp.CONFIG).write_text(
        json.dumps({"train": tiny_config(data=shards.dir, out=str(run)).to_dict()})
    )
    (checkpoint / dcp.TRAIN_STATE).write_text(json.dumps(state.to_dict()))
    done = run_without_ray("audit", "--run", str(run), "--threads", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"audit of {run} at {checkpoint.name} (step 7, epoch 1): 3 shards"
    assert done.stdout.splitlines()[-1].startswith(
        "ok: every good sample of 1 finished epoch(s) trained once"
    )
    (checkpoint / dcp.TRAIN_STATE).write_text(
        json.dumps(altered(state, "0", 1, lambda e: [0, 0, 0, 0]).to_dict())
    )
    done = run_without_ray("audit", "--run", str(run))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"epoch 0: shard {urls[1]}: 0 counted (0 bad) of 8: 8 missing" in done.stdout
    assert done.stderr.strip() == f"error: 1 shard(s) with missing or repeated samples ({urls[1]})"
    done = run_without_ray("audit", "--run", str(tmp_path / "none"))
    assert done.returncode == 2 and "holds no complete checkpoint" in done.stderr
