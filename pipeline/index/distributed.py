"""An index built past one machine (``jobs/index.py --ray-tasks N``): trained once, filled by Ray tasks.

    driver   trained_index: an empty flat index, or ivfpq's coarse quantizer and codebooks trained once
             on a sample of every file, serialized (faiss.serialize_index) into the object store
    tasks    one a group of consecutive output files (`file_groups`): a copy of the trained index, the
             group's rows streamed in and added with their ids in the whole index (`build.add_rows`),
             returned serialized with their keys and urls
    driver   the shards merged in file order (``merge_from``: ivf lists append, flat rows concatenate),
             then `build.commit` writes what the in-process build writes

The result is the index the in-process build makes, byte for byte: every row is encoded against the
same trained quantizer, the same record batches are read (batches never span files), and an inverted
list or a flat array gets its rows in the same order. Only training runs once, in the driver; HNSW is a
graph over every row and has no such merge, so ``--ray-tasks`` refuses it (`IndexConfig.validate`).

The driver still holds the whole index (the merged one, plus one shard as it merges), as the in-process
build does; what the tasks spread is the reading, decoding and encoding of the rows. Each task asks
Ray for one CPU (`TASK_CPUS`) and FAISS in a task uses as many threads (Ray sets ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from pipeline.embed.reader import OutputReader
from pipeline.index import build as local

TASK_CPUS = 1


def file_groups(plan: local.IndexPlan, tasks: int) -> list[tuple[list[OutputReader], int]]:
    """At most ``tasks`` groups of consecutive files with about as many rows each, in order, as
    (readers over the group's files, the id of the group's first row)."""
    files = [(r, location) for r in plan.readers for location in r.files]
    total = sum(plan.file_rows)
    groups: dict[int, list[tuple[OutputReader, Any, int]]] = {}
    before = 0
    for (reader, location), rows in zip(files, plan.file_rows, strict=True):
        # A file goes to the group its middle row falls in: groups stay contiguous and balanced.
        group = min(tasks - 1, int((before + rows / 2) * tasks / max(total, 1)))
        groups.setdefault(group, []).append((reader, location, rows))
        before += rows
    out, first = [], 0
    for members in groups.values():
        readers: list[OutputReader] = []
        last = None
        for reader, location, _ in members:
            if reader is last:
                readers[-1].files.append(location)
            else:
                readers.append(dataclasses.replace(reader, files=[location]))
            last = reader
        out.append((readers, first))
        first += sum(rows for _, _, rows in members)
    return out


# Two objects: the shard is freed once merged, while the keys (read back zero-copy, so pinning the
# object they arrived in) stay until the commit.
@ray.remote(num_cpus=TASK_CPUS, num_returns=2)
def add_shard(
    trained: np.ndarray, readers: list[OutputReader], dim: int, batch_rows: int, first_id: int
) -> tuple[np.ndarray, tuple[list[pa.Array], list[pa.Array]]]:
    """One group's rows added to a copy of the trained index: the shard serialized, (keys, urls)."""
    import faiss

    index = faiss.deserialize_index(trained)
    keys, urls = local.add_rows(index, readers, dim, batch_rows, first_id)
    return faiss.serialize_index(index), (keys, urls)


def build(plan: local.IndexPlan) -> local.BuildSummary:
    """Train in this process, add in ``plan.config.ray_tasks`` Ray tasks, merge in file order, commit.
    Ray must be initialized (`pipeline.cli.connect_ray`). A task's error ends the build with its own
    line, the other tasks cancelled."""
    import faiss

    start = time.perf_counter()
    blob = faiss.serialize_index(local.trained_index(plan))
    train_s = time.perf_counter() - start
    # The driver merges into a copy read back as the tasks read theirs: FAISS merges only indexes of
    # one class, and reading gives the metric's own (IndexFlat -> IndexFlatIP or IndexFlatL2).
    index, trained = faiss.deserialize_index(blob), ray.put(blob)
    groups = file_groups(plan, plan.config.ray_tasks)
    pending = [
        add_shard.remote(trained, readers, plan.spec.dim, plan.config.batch_rows, first)
        for readers, first in groups
    ]
    keys: list[pa.Array] = []
    urls: list[pa.Array] = []
    rows = None
    try:
        while pending:  # file order: the merged lists hold their rows as one process adds them
            # Popped before it is read: a merged shard's last reference goes, and the store frees it.
            shard, rows = pending.pop(0)
            index.merge_from(faiss.deserialize_index(ray.get(shard)), 0)
            del shard
            shard_keys, shard_urls = ray.get(rows)
            keys += shard_keys
            urls += shard_urls
    except ray.exceptions.RayTaskError as e:
        for shard, _ in pending:
            ray.cancel(shard)
        # Every error left unread is read here: Ray prints a traceback for each one dropped unread
        # ("Unhandled error"), the failed task's keys among them, after the job's one line.
        _drain([rows, *(ref for pair in pending for ref in pair)])
        if isinstance(e.cause, ValueError):  # a file that does not read: the line the file gave
            raise ValueError(str(e.cause)) from e
        raise
    return local.commit(plan, index, keys, urls, start=start, train_s=train_s)


def _drain(refs: list[ray.ObjectRef | None], timeout_s: float = 60.0) -> None:
    """Read each of ``refs`` and drop what it holds, errors included (a cancelled task's, a failed one's)."""
    for ref in refs:
        if ref is None:
            continue
        with contextlib.suppress(Exception):  # dropped: the build already fails with the first error
            ray.get(ref, timeout=timeout_s)
