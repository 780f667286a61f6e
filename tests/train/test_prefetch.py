"""The data thread that builds the next steps' input: same input as building it in the step, errors
reach the training thread, and stopping it never hangs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples
from pipeline.train.input.prefetch import Prefetcher


def micro_batch(i: int, size: int = 4) -> dict[str, np.ndarray]:
    patches = np.full((size, 3, 6), i, dtype=np.uint8)
    patches.flags.writeable = False  # as Ray hands them out
    keys = np.array([f"shard-{i // 2}/{i}-{j}" for j in range(size)])
    return {
        "patches": patches,
        "label": np.arange(size) + i,
        "url": np.array([f"shard-{i // 2}"] * size),
        "key": keys,
    }


def stream(n: int, fail: BaseException | None = None, closed: threading.Event | None = None):
    try:
        for i in range(n):
            yield micro_batch(i)
        if fail is not None:
            raise fail
    finally:
        if closed is not None:
            closed.set()


def steps(prefetcher: Prefetcher) -> list:
    out = []
    while True:
        step = prefetcher.next()
        out.append(step)
        if step.ran_dry or step.error:
            prefetcher.close()
            return out


@pytest.mark.parametrize("depth", [1, 3])
def test_the_thread_builds_what_the_step_would_build_itself(depth):
    def run(depth: int) -> list:
        bad = BadSamples()
        return steps(
            Prefetcher(
                stream(5), accum=2, columns=("patches", "label"), bad_samples=bad, pin=False, depth=depth
            )
        )

    inline, threaded = run(0), run(depth)
    assert [s.samples for s in threaded] == [8, 8, 4] and threaded[-1].ran_dry
    # Each step's keys, in the order the step takes them: micro-batches 0-1, 2-3, then 4 alone.
    assert [s.keys for s in threaded] == [
        [f"shard-{i // 2}/{i}-{j}" for i in ids for j in range(4)] for ids in ((0, 1), (2, 3), (4,))
    ]
    for a, b in zip(inline, threaded, strict=True):
        assert len(a.micro_batches) == len(b.micro_batches)
        for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
    assert threaded[0].micro_batches[1][0].dtype == torch.uint8
    assert threaded[0].micro_batches[1][0].shape == (4, 3, 6)


def test_a_data_error_is_a_line_and_a_crash_is_raised_in_the_training_thread():
    over_budget = Prefetcher(
        stream(3, fail=BadSampleBudgetError("12 of 100 samples are bad")),
        accum=2, columns=("patches", "label"), bad_samples=BadSamples(), pin=False, depth=2,
    )  # fmt: skip
    last = steps(over_budget)[-1]
    assert last.error == "12 of 100 samples are bad" and last.samples == 4

    crashing = Prefetcher(
        stream(2, fail=OSError("connection reset")),
        accum=2, columns=("patches", "label"), bad_samples=BadSamples(), pin=False, depth=2,
    )  # fmt: skip
    crashing.next()
    with pytest.raises(OSError, match="connection reset"):
        crashing.next()
    crashing.close()


def test_closing_early_stops_the_thread_and_closes_the_stream():
    closed = threading.Event()
    prefetcher = Prefetcher(
        stream(1000, closed=closed),
        accum=2, columns=("patches", "label"), bad_samples=BadSamples(), pin=False, depth=2,
    )  # fmt: skip
    prefetcher.next()  # the thread is now blocked handing over the steps after this one
    prefetcher.close()
    assert closed.is_set() and not prefetcher._thread.is_alive()


def test_each_step_carries_the_bad_sample_counts_as_of_its_input():
    bad = BadSamples()

    def counted():
        for i in range(4):
            bad.total += 4
            yield micro_batch(i)

    prefetcher = Prefetcher(
        counted(), accum=2, columns=("patches", "label"), bad_samples=bad, pin=False, depth=2
    )
    first, second = prefetcher.next(), prefetcher.next()
    prefetcher.close()
    assert (first.bad_samples.total, second.bad_samples.total) == (8, 16)
    assert first.bad_samples is not bad


@pytest.mark.gpu
def test_pinned_buffers_are_reused_once_their_copies_are_done():
    prefetcher = Prefetcher(
        stream(40), accum=2, columns=("patches", "label"), bad_samples=BadSamples(), pin=True, depth=2
    )
    pointers, device = set(), torch.device("cuda")
    for i in range(10):
        step = prefetcher.next()
        on_device = step.to_device(device)
        prefetcher.release(step)
        assert step.micro_batches[0][0].is_pinned()
        pointers.update(t.data_ptr() for mb in step.micro_batches for t in mb)
        assert torch.equal(on_device[1][0].cpu(), torch.full((4, 3, 6), 2 * i + 1, dtype=torch.uint8))
    prefetcher.close()
    # At most (depth + 2) steps of 2 micro-batches x 2 columns are ever allocated.
    assert len(pointers) <= 4 * 2 * 2


@pytest.mark.gpu
def test_pinned_buffers_hold_micro_batches_of_changing_shapes_without_pinning_again():
    """Native-aspect micro-batches change shape every step (rows x length, one token budget): each
    column is a view of a pinned block that is pinned once, at the largest size it holds."""
    shapes = [(4, 8, 6), (8, 4, 6), (2, 16, 6), (4, 8, 6)] * 3

    def changing():
        for i, shape in enumerate(shapes):
            n = shape[0]
            yield {
                "key": np.array([f"k{i}-{j}" for j in range(n)]),
                "patches": np.full(shape, i, np.uint8),
                "label": np.full(n, i, np.int64),
            }

    prefetcher = Prefetcher(
        changing(), accum=1, columns=("patches", "label"), bad_samples=BadSamples(), pin=True, depth=2
    )
    blocks, device = set(), torch.device("cuda")
    for i, shape in enumerate(shapes):
        step = prefetcher.next()
        on_device = step.to_device(device)
        prefetcher.release(step)
        assert torch.equal(on_device[0][0].cpu(), torch.full(shape, i, dtype=torch.uint8))
        blocks.update(b.data_ptr() for buf in step.buffers for k, b in buf.items() if k.endswith("/block"))
    prefetcher.close()
    # At most (depth + 2) buffers: the patches pinned once each (every shape holds 192 values), the
    # labels at most twice (4 rows, then 8): not once a step.
    assert len(blocks) <= 4 * 3 < len(shapes) * 2


@pytest.mark.parametrize("depth", [0, 2])
def test_a_stream_that_ran_dry_gives_its_short_tail_then_empty_inputs(depth):
    """The stream's last micro-batch is short (the data pipeline's remainder): it is trained like the
    others; after the input where the stream ran dry, every input is empty, with the final counts,
    so the rank joins the epoch's remaining steps with nothing."""
    bad = BadSamples()

    def tail():
        for i in range(2):
            bad.total += 4
            yield micro_batch(i)
        bad.total += 3
        yield micro_batch(2, size=3)

    prefetcher = Prefetcher(
        tail(), accum=2, columns=("patches", "label"), bad_samples=bad, pin=False, depth=depth
    )
    taken = [prefetcher.next() for _ in range(4)]
    prefetcher.close()
    assert [(s.samples, s.ran_dry, len(s.micro_batches)) for s in taken] == [
        (8, False, 2), (3, True, 1), (0, True, 0), (0, True, 0)
    ]  # fmt: skip
    assert taken[1].micro_batches[0][0].shape == (3, 3, 6) and taken[1].keys[-1] == "shard-1/2-2"
    assert [s.bad_samples.total for s in taken] == [8, 11, 11, 11]
    assert taken[2].keys == [] and taken[2].error == "" and taken[2].bad_samples is not taken[3].bad_samples


@pytest.mark.parametrize("depth", [0, 2])
def test_the_final_counts_are_known_once_the_stream_has_run_dry_before_the_dry_input_is_taken(depth):
    """The loop starts the next epoch's pipeline once it sees them: with a thread, as soon as the thread
    has found the stream's end (while up to `depth` built steps still wait to train); inline, with the
    input where it ran dry. Never after an error."""
    bad, taken = BadSamples(), []

    def counted():
        for i in range(5):
            bad.total += 4
            yield micro_batch(i)

    prefetcher = Prefetcher(
        counted(), accum=2, columns=("patches", "label"), bad_samples=bad, pin=False, depth=depth
    )
    if depth:
        deadline = time.monotonic() + 10
        while prefetcher.ran_dry() is None and time.monotonic() < deadline:  # the thread reads 3 steps ahead
            time.sleep(0.01)
        assert prefetcher.ran_dry() is not None  # before any step was taken
    dry = []
    for _ in range(5):
        taken.append(prefetcher.next())
        dry.append(prefetcher.ran_dry() is not None)
    prefetcher.close()
    assert [s.ran_dry for s in taken] == [False, False, True, True, True]
    assert dry == ([True] * 5 if depth else [False, False, True, True, True])
    final = prefetcher.ran_dry()
    assert final.total == 20 and final is not bad  # a copy of the counts, as the stream ended them

    failing = Prefetcher(
        stream(3, fail=BadSampleBudgetError("too many bad samples")), accum=2,
        columns=("patches", "label"), bad_samples=BadSamples(), pin=False, depth=depth,
    )  # fmt: skip
    assert [s.error for s in steps(failing)][-1] == "too many bad samples"
    assert failing.ran_dry() is None
