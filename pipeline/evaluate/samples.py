"""A few images from shards, eval-cropped and patchified in this process (no Ray): what the analyze job
measures attention on.

The same read and decode functions as the Ray pipeline (`pipeline.data.rows.read_shard`,
`pipeline.data.decode.preprocess_batch` with ``train=False``), taken in shard order until enough good
images are in hand; bad samples are skipped and counted (`pipeline.data.bad_samples.BadSamples`).
"""

from __future__ import annotations

import numpy as np

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig
from pipeline.data.decode import preprocess_batch
from pipeline.data.rows import read_shard


def eval_patches(shards: list[str], config: DataConfig, count: int) -> tuple[np.ndarray, BadSamples]:
    """The first ``count`` good images of ``shards`` as uint8 patches ``(n, N, P*P*C)``, ``n <= count``
    (fewer when the shards hold fewer), and the bad samples met on the way."""
    bad = BadSamples.from_config(config)
    found: list[np.ndarray] = []
    have = 0
    for url in shards:
        for table in read_shard(config.location(url), config.row_spec, config.block_rows):
            rows = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
            start = 0
            while start < table.num_rows:  # decode only as many rows as are still wanted
                end = start + count - have
                chunk = {name: column[start:end] for name, column in rows.items()}
                batch = bad.filter(preprocess_batch(chunk, config=config, train=False, epoch=0))
                found.append(batch["patches"])
                have += len(batch["patches"])
                if have >= count:
                    return np.concatenate(found), bad
                start = end
    if not have:
        raise ValueError(
            f"no readable image in {len(shards)} shard(s) ({bad.bad} bad samples: "
            f"{', '.join(sorted(bad.by_reason)) or 'none'}); pass --data with images"
        )
    return np.concatenate(found), bad
