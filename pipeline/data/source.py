"""The read stage on Ray: a Datasource with one read task per tar shard, streaming rows in tar order.

Each read task runs `pipeline.data.rows.read_shard` for its shard (retrying storage failures itself). The
shard travels as a `pipeline.storage.Location`, its options inside, so Ray worker processes reach the same
endpoint with the same credentials as the driver.
"""

from __future__ import annotations

import functools

from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from pipeline.data.consumed import Consumed
from pipeline.data.rows import Retry, RowSpec, read_shard
from pipeline.storage import Location


class TarShardDatasource(Datasource):
    """One read task per shard, in the order given (Ray keeps that order with ``preserve_order``)."""

    def __init__(
        self,
        shards: list[Location],
        spec: RowSpec,
        *,
        block_rows: int = 256,
        retry: Retry | None = None,
        skip: dict[str, Consumed] | None = None,
    ):
        super().__init__()
        self._shards = list(shards)
        self._spec = spec
        self._block_rows = block_rows
        self._retry = retry or Retry()
        self._skip = skip or {}  # shard URL -> the samples it had given this epoch (read past, not made rows)

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: object | None = None
    ) -> list[ReadTask]:
        # One task per shard whatever `parallelism` asks: the shard is the unit of ordering and resumption.
        return [
            ReadTask(
                functools.partial(
                    read_shard, shard, self._spec, self._block_rows, self._retry, self._skip.get(shard.url)
                ),
                BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=[shard.url]),
                per_task_row_limit=per_task_row_limit,
            )
            for shard in self._shards
        ]

    def estimate_inmemory_data_size(self) -> int | None:
        return None  # unknown without listing sizes; Ray then keeps one block stream per task
