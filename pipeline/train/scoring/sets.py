"""The shards a run's scores are made on, checked and carved before any cluster work (no Ray, no torch here):
the checkpoint probe's two sets (`check_sets`) and the validation split of ``--keep-best eval``
(`validation_split`).

The validation split is --val-data, or with ``--keep-best eval`` and none given the last `VAL_SHARE` of the
shards of a plain --data (one at least), held out from training: never --eval-data, which may be the test
set. The same --data always holds out the same shards, so a resume trains on what the run began with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.data.dataset import check_shards
from pipeline.data.shards import ShardError, expand_shards, shard_id

VAL_SHARE = 0.05  # of --data's shards held out as the validation split when --val-data is not given


def label_key(config: Any) -> str:
    """The probe sets' label member: --probe-label-key, whose auto is the run's --label-key, else cls (an
    MAE run's --label-key none: the usual member)."""
    key = config.scoring.probe_label_key
    return (config.data.label_key or "cls") if key == "auto" else key


def check_sets(config: Any) -> None:
    """Before any cluster work, a one-line ValueError where the probe's sets cannot serve: a URL that matches
    nothing, a first shard without images or labels (the probe's label key), or the two sets sharing a
    shard (the probe would be scored on images it was fit on)."""
    from pipeline.train.step.model import model_config

    scoring = config.scoring
    if not scoring.probing:
        return
    data = dataclasses.replace(
        config.data_for(model_config(config).patch_size),
        label_key=label_key(config),
        require_labels=True,
        num_classes=None,
    )
    names = []
    for flag, urls in (
        ("--probe-data", scoring.probe_shards),
        ("--probe-eval-data", scoring.probe_eval_shards),
    ):
        try:
            shards = expand_shards(config.location(urls))
            check_shards(shards, data)
        except ShardError as e:
            raise ShardError(f"{flag}: {e}") from e
        names.append({shard_id(url) for url in shards})
    shared = sorted(names[0] & names[1])
    if shared:
        raise ValueError(
            f"--probe-data and --probe-eval-data share {len(shared)} shard(s) (first: {shared[0]}): the probe "
            "would be scored on images it was fit on; pass held-out shards to --probe-eval-data"
        )


def validation_split(config: Any, shards: list[str], *, mixed: bool) -> tuple[list[str], list[str]]:
    """(the shards training reads, the validation split's): --val-data's own (checked like --data, and
    apart from it), or with --keep-best eval and no --val-data the last `VAL_SHARE` of ``shards`` (one at
    least), held out from training; else none. A one-line ValueError where neither can be had."""
    scoring = config.scoring
    if scoring.val_shards:
        from pipeline.train.step.model import model_config

        val = expand_shards(config.location(scoring.val_shards))
        check_shards(val, config.data_for(model_config(config).patch_size))
        shared = sorted({shard_id(u) for u in val} & {shard_id(u) for u in shards})
        if shared:
            raise ValueError(
                f"--val-data and --data share {len(shared)} shard(s) (first: {shared[0]}): the head would be "
                "scored on images it trained on; pass held-out shards"
            )
        return shards, val
    if scoring.keep_best != "eval":
        return shards, []
    if mixed:
        raise ValueError(
            "--keep-best eval holds out part of a plain --data as its validation split; with sources mixed by "
            "weight, pass --val-data (held-out labeled shards)"
        )
    held = max(1, round(VAL_SHARE * len(shards)))
    workers = config.cluster.max_workers
    if len(shards) - held < workers:
        raise ValueError(
            f"--keep-best eval holds out {held} of the {len(shards)} shards of --data as its validation split, "
            f"which leaves fewer than the {workers} workers need; pass --val-data (held-out labeled shards), "
            "or write more, smaller shards (jobs/make_shards.py --samples-per-shard)"
        )
    return shards[:-held], shards[-held:]
