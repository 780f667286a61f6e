"""The one place that chains the data stages, and the batches a consumer takes from them.

    shards (in the order given) -> read: one task per shard, rows {key, url, image, label, error}
                                   (with ``decode_nodes``: only on the Ray nodes that carry that label)
                                -> map_batches(preprocess_batch), fused into the read task
                                -> rows {key, url, patches uint8 (N, P*P*C), label int64, error}
                                   (``encoded``, evaluation: vet_batch instead, the images left encoded
                                   for a GPU to decode; `pipeline.embed.device_decode`)
                                -> (training with mask_ratio) map_batches(mask_batch), fused too:
                                   patches -> {visible, masked, ids_shuffle}
                                -> iter_batches: seeded local shuffle, bad rows counted and removed
                                -> rebatch / micro_batches: exactly ``size`` good samples each (the
                                   stream's last one: what is left, so every good sample is taken)
                                -> (native-aspect rows) by_token_budget: micro-batches of ``size`` x
                                   max_patches tokens, images of like lengths together (`native.pack`)

Determinism: the dataset keeps ``preserve_order`` in its own context, so rows come shard by shard in
the given order and in tar order within a shard; the seeds are pure functions (`pipeline.data.config`).
The training loop builds one dataset per rank per epoch from ``shard_order(...)[rank::world_size]``,
which makes a resumed run match an uninterrupted one. Each rank's pipeline (that one, and fine-tuning's
evaluation) is quiet and held to its share of the CPUs by `for_one_rank`.

Ray is imported inside the functions that need it: this module imports without Ray (and never torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from pipeline.data.bad_samples import BadSamples
from pipeline.data.config import DataConfig, shuffle_seed
from pipeline.data.consumed import Consumed
from pipeline.data.decode import preprocess_batch, vet_batch
from pipeline.data.masking import mask_batch
from pipeline.data.native import pack
from pipeline.data.rows import raise_lost_shard
from pipeline.data.shards import ShardError, dataset_root, open_shard
from pipeline.data.tar import iter_samples, open_tar_stream

if TYPE_CHECKING:
    import ray.data

Batch = dict[str, np.ndarray]


def build_dataset(
    shards: list[str],
    config: DataConfig,
    *,
    train: bool,
    epoch: int = 0,
    root: str | None = None,
    skip: dict[str, Consumed] | None = None,
    encoded: bool = False,
) -> ray.data.Dataset:
    """A streaming dataset of patch rows over ``shards`` in the given order, one read task per shard.

    Training crops and masks are seeded by each shard's name relative to ``root``, the directory of
    the whole dataset (default: `dataset_root` of ``shards``; a rank reading a slice passes the root
    of all of them), so copies of the same shards elsewhere give the same samples.

    Rows: ``key`` str, ``url`` str, ``patches`` uint8 ``(N, P*P*C)``, ``label`` int64 (-1 when absent),
    ``error`` str ("" when good; else the reason, with zero patches). Output order is deterministic:
    shard by shard as given, tar order inside a shard.
    With ``config.mask_ratio`` and ``train``, `pipeline.data.masking.mask_batch` replaces ``patches``
    by ``visible``, ``masked`` and ``ids_shuffle`` (evaluation datasets are never masked).
    ``skip`` (shard URL -> `Consumed`): samples the read stage passes over, before decoding them.
    ``encoded`` (evaluation only): the images stay encoded, their headers vetted (`decode.vet_batch`:
    rows keep ``image`` bytes and gain ``device``), for a consumer that decodes them on its GPU.
    """
    import ray.data

    from pipeline.data.source import TarShardDatasource

    if not shards:
        raise ShardError(
            "no shards to read; pass at least one shard URL (see pipeline.data.shards.expand_shards)"
        )
    if encoded and train:
        raise ValueError("encoded rows are for evaluation: training crops are drawn where images decode")
    root = dataset_root(shards) if root is None else root
    source = TarShardDatasource(
        [config.location(url) for url in shards],
        config.row_spec,
        block_rows=config.block_rows,
        retry=config.retry,
        skip=skip,
    )
    # With --decode-nodes, every stage of the read task carries the same label selector: Ray fuses
    # stages only when their remote arguments agree, and the fused task then runs on those nodes alone.
    where = config.label_selector
    # override_num_blocks = one per shard: Ray would otherwise split read outputs, which blocks fusion.
    ds = ray.data.read_datasource(
        source, override_num_blocks=len(shards), concurrency=config.read_concurrency, label_selector=where
    )
    stage, kwargs = (
        (vet_batch, {"config": config})
        if encoded
        else (preprocess_batch, {"config": config, "train": train, "epoch": epoch, "root": root})
    )
    ds = ds.map_batches(
        stage,
        batch_size=None,  # whole read blocks: keeps Read->MapBatches fused (a batch_size would split them)
        batch_format="numpy",
        zero_copy_batch=True,
        fn_kwargs=kwargs,
        label_selector=where,
    )
    if train and config.mask_ratio is not None:
        # Masked autoencoding: the mask is drawn here too, fused into the same read task.
        ds = ds.map_batches(
            mask_batch,
            batch_size=None,
            batch_format="numpy",
            zero_copy_batch=True,
            fn_kwargs={"config": config, "epoch": epoch, "root": root},
            label_selector=where,
        )
    # This dataset's own context (a copy made at read time), not the process-global one.
    ds.context.execution_options.preserve_order = True
    ds.context.target_max_block_size = config.block_bytes
    # Reservation splits the CPU budget between operators and a shared pool; with our single fused
    # operator it left CPUs idle (BENCHMARKS.md, "Data pipeline").
    ds.context.op_resource_reservation_enabled = False
    return ds


def iter_batches(
    ds: ray.data.Dataset,
    batch_size: int,
    config: DataConfig,
    *,
    epoch: int,
    rank: int = 0,
    shuffle: bool,
    bad_samples: BadSamples | None = None,
    drop_last: bool = False,
    prefetch_batches: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Numpy batches of ``ds``; with ``shuffle``, through a seeded local shuffle buffer.

    With ``bad_samples``, error rows are recorded and removed (batches may then be smaller than
    ``batch_size``) and the bad-sample budget is checked after every batch and at the end; a shard
    lost to storage raises `ShardLostError` (its samples are unknown: not one bad sample).
    """
    use_buffer = shuffle and config.shuffle_buffer > 0
    batches = ds.iter_batches(
        batch_size=batch_size,
        batch_format="numpy",
        drop_last=drop_last,
        prefetch_batches=prefetch_batches,
        local_shuffle_buffer_size=config.shuffle_buffer if use_buffer else None,
        local_shuffle_seed=shuffle_seed(config.seed, epoch, rank) if use_buffer else None,
    )
    for batch in batches:
        if bad_samples is not None:
            raise_lost_shard(batch)
            batch = bad_samples.filter(batch)
            bad_samples.check_budget()
        yield batch
    if bad_samples is not None:
        bad_samples.check_budget(final=True)


def check_shards(shards: list[str], config: DataConfig, *, probe: int = 16) -> None:
    """Fail fast, before any Ray work, when the first shard cannot be what the job expects.

    Reads up to ``probe`` samples of the first shard: a `ShardError` if it cannot be opened, holds no
    image member, (with ``require_labels``) carries no label member at all, holds more labels outside
    ``[0, num_classes)`` than the bad-sample share allows (a wrong class count), or not one label that
    reads (a wrong label key). Some unreadable labels among readable ones are bad samples, each that
    sample's error row, not a wrong key.
    """
    if not shards:
        raise ShardError("no shards to read; pass at least one shard URL")
    url, spec = shards[0], config.row_spec
    try:
        with open_shard(config.location(url)) as fileobj:
            samples = []
            for sample in iter_samples(open_tar_stream(fileobj, url)):
                samples.append(sample)
                if len(samples) >= probe:
                    break
    except OSError as e:
        raise ShardError(f"cannot open shard {url}: {e}; check the path and credentials") from e
    if not samples:
        raise ShardError(f"shard {url} is empty (no tar member); point at WebDataset .tar shards")
    if all(s.error and not s.members for s in samples):  # not one member read: not a tar at all
        raise ShardError(
            f"shard {url} is not a readable tar archive ({samples[0].error}); point at WebDataset .tar "
            "shards (plain or gzipped)"
        )
    seen = sorted({ext for s in samples for ext in s.members})
    if not any(spec.image(s) is not None for s in samples):
        raise ShardError(
            f"shard {url} holds no image member among its first {len(samples)} samples (members: "
            f"{', '.join(seen) or 'none'}); name its image extension with --image-keys, or point at "
            "image shards"
        )
    if spec.require_labels and not any(spec.label_member in s.members for s in samples):
        raise ShardError(
            f"shard {url} carries no label member .{spec.label_member} in its first {len(samples)} samples "
            f"(members: {', '.join(seen)}); name it with --label-key, or pretrain without labels "
            "(--objective mae)"
        )
    labeled = [(s.key, spec.label(s)) for s in samples if spec.label_member in s.members]
    for kind, advice in (
        ("label out of range", "set --num-classes to the dataset's class count, or fix the labels"),
        (
            "bad label",
            "check --label-key (cls, or json:FIELD for a field of the .json member), or fix the labels",
        ),
    ):
        bad = [(key, error) for key, (_, error) in labeled if error.startswith(kind)]
        allowed = config.max_bad_fraction * len(labeled) if kind == "label out of range" else len(labeled) - 1
        if bad and len(bad) > allowed:
            key, error = bad[0]
            what = "out of range" if kind == "label out of range" else "unreadable"
            raise ShardError(
                f"shard {url}: {len(bad)} of the first {len(labeled)} labels are {what} (key {key!r}: "
                f"{error.split(': ', 1)[1]}); {advice}"
            )


def rebatch(batches: Iterator[Batch], size: int) -> Iterator[Batch]:
    """Cut a stream of uneven batches (corrupt samples removed) into batches of exactly `size`, but
    for the last: a short remainder at the end is one smaller batch, so every sample is taken. Fixed
    shapes keep compiled graphs from recompiling; under compile the step pads an epoch's one short
    batch back to `size` (`pipeline.train.step.objective.Objective.forward`)."""
    pending: list[Batch] = []
    count = 0
    for batch in batches:
        n = len(batch["label"])
        if not pending and n == size:
            yield batch
            continue
        pending.append(batch)
        count += n
        while count >= size:
            merged = {k: np.concatenate([b[k] for b in pending]) for k in pending[0]}
            yield {k: v[:size] for k, v in merged.items()}
            pending = [{k: v[size:] for k, v in merged.items()}]
            count -= size
    if count:
        yield {k: np.concatenate([b[k] for b in pending]) for k in pending[0]}


def by_token_budget(batches: Iterator[Batch], config: DataConfig, size: int) -> Iterator[Batch]:
    """A rank's micro-batches as training takes them: native-aspect rows cut into micro-batches of
    ``size`` x ``max_patches`` tokens (`pipeline.data.native.pack`); square ones as they come."""
    if not config.native:
        return batches
    return pack(batches, size, config.patch_budget, config.mask_ratio)


def micro_batches(
    shards: list[str],
    config: DataConfig,
    *,
    epoch: int,
    rank: int,
    size: int,
    bad_samples: BadSamples,
    data_cpus: float,
    root: str,
    skip: dict[str, Consumed] | None = None,
) -> Iterator[Batch]:
    """One training rank's micro-batches for one epoch: every good sample once, exactly `size` each
    but the last, which holds what is left (`rebatch`).

    ``skip``: the samples of each shard the epoch had consumed before (`build_dataset`).
    Raises the data pipeline's one-line errors (bad-sample budget passed, shards without labels).
    """
    if not shards:
        return
    dataset = for_one_rank(
        build_dataset(shards, config, train=True, epoch=epoch, root=root, skip=skip), data_cpus
    )
    batches = iter_batches(
        dataset, size, config, epoch=epoch, rank=rank, shuffle=True, bad_samples=bad_samples
    )
    yield from rebatch(batches, size)


def for_one_rank(dataset: ray.data.Dataset, data_cpus: float) -> ray.data.Dataset:
    """``dataset`` set up as one rank's own pipeline (training's, one per rank per epoch; fine-tuning's
    evaluation): quiet, since the progress bars and start banners of so many short pipelines would
    drown the training log, which reports data wait and throughput itself; and held to ``data_cpus``,
    its share of the cluster's spare CPUs, so that together the ranks' pipelines neither starve the
    training workers nor each other. Only this dataset's own context changes."""
    from ray.data import ExecutionResources

    context = dataset.context
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    context.execution_options.resource_limits = ExecutionResources(cpu=data_cpus)
    return dataset
