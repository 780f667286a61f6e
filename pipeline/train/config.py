"""What a training run is: a frozen `TrainConfig` of sections, resolved from a preset plus overrides.

Sections: ``arch`` (which model, its head), ``task`` (the objective), ``data`` (`pipeline.data.DataConfig`:
which pixels a sample becomes), ``optim``, ``speed``, ``cluster``, ``run``. Every field is a
`pipeline.settings.setting` with its one doc line: the flags of `jobs/pretrain.py` and
`jobs/finetune.py`, their help and the names validation messages give are made from it, so adding a
knob is adding a field. Code that needs one section takes that section, not the whole config.

Where the sections live, and why: `pipeline.train.sections`. The fields the data section takes from other
sections (patch size, seed, labels, mask) are set by `TrainConfig` and are no flags.

The resolved config is saved beside every checkpoint and in the final export (``version`` 2; the flat
configs of older runs, version 1, still load).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline import settings
from pipeline.data.config import DataConfig
from pipeline.settings import setting
from pipeline.storage import Location
from pipeline.train.sections import (
    ArchConfig,
    ClusterConfig,
    OptimConfig,
    RunConfig,
    SpeedConfig,
    TaskConfig,
    shown_workers,
)

# DataConfig fields that TrainConfig sets from its other sections: no flags of a training job.
DERIVED_DATA_FIELDS = ("patch_size", "mask_ratio", "require_labels", "num_classes", "seed")


@dataclass(frozen=True)
class TrainConfig(settings.Settings):
    """One training run: pretraining or fine-tuning."""

    CONFIG_VERSION: ClassVar[int] = 2

    arch: ArchConfig = setting(help="which network", factory=ArchConfig)
    task: TaskConfig = setting(help="the objective", factory=TaskConfig)
    data: DataConfig = setting(
        help="which pixels a sample becomes", factory=lambda: DataConfig(shuffle_buffer=2000)
    )
    optim: OptimConfig = setting(help="optimization", factory=OptimConfig)
    speed: SpeedConfig = setting(help="speed switches", factory=SpeedConfig)
    cluster: ClusterConfig = setting(help="the run's shape on the cluster", factory=ClusterConfig)
    run: RunConfig = setting(help="inputs, outputs, cadence", factory=RunConfig)

    def __post_init__(self) -> None:
        # The data section's fields owned by other sections follow them.
        supervised = self.task.objective == "supervised"
        derived = {
            "patch_size": None,  # the model's: `data_for`
            # An MAE mask out of range is left to `validate`, which names the flag.
            "mask_ratio": None if supervised or not 0 < self.task.mask_ratio < 1 else self.task.mask_ratio,
            "require_labels": supervised,  # without a label key: refused by `validate`
            "num_classes": self.arch.num_classes if supervised else None,
            "seed": self.run.seed,
        }
        if any(getattr(self.data, k) != v for k, v in derived.items()):
            object.__setattr__(self, "data", dataclasses.replace(self.data, **derived))

    def location(self, url: str) -> Location:
        """``url`` with the job's ``--storage-options`` (the data section holds them; they apply to every
        location the run reads or writes)."""
        return self.data.location(url)

    @property
    def run_dir(self) -> Location:
        """``--out`` as a Location: where every write of the run goes (marker, metrics, checkpoints, final/)."""
        return self.location(self.run.out)

    def data_for(self, patch_size: int) -> DataConfig:
        """The data section with the model's patch size: what the data pipeline runs with."""
        return dataclasses.replace(self.data, patch_size=patch_size)

    def accumulation(self, world: int) -> int | None:
        """Micro-batches per step on each of ``world`` workers: the global ``--batch-size`` over
        ``--micro-batch-size`` x ``world``, or None where that does not divide it. An elastic run keeps
        the global batch through a resize: the accumulation follows the world size."""
        steps, rest = divmod(self.optim.batch_size, self.optim.micro_batch_size * world)
        return None if rest or not steps else steps

    @property
    def last_step(self) -> int:
        stop = self.run.stop_at_step
        return self.optim.max_steps if stop is None else min(stop, self.optim.max_steps)

    def validate(self) -> None:
        """Raise a one-line ValueError for a config that cannot run (before any cluster work)."""
        self.run.validate()
        for section in (self.arch, self.task, self.optim, self.speed, self.cluster):
            section.validate()
        self.check_batch()
        if self.speed.fp8 and not self.cluster.use_gpu:
            raise ValueError("--fp8 needs GPUs (compute capability 8.9+, e.g. H100); drop --fp8 or --cpu")
        if self.task.objective == "supervised" and self.data.label_key is None:
            raise ValueError(
                "--label-key none leaves supervised training without labels; pass a label key "
                "(cls, json:<field>) or --objective mae"
            )
        if self.task.objective != "supervised" and (self.arch.weights or self.run.eval_shards):
            raise ValueError("fine-tuning and --eval-data are supervised; drop --objective mae")
        mixing = [n for n in ("mixup_alpha", "cutmix_alpha") if getattr(self.task, n)]
        if self.data.native and mixing:
            raise ValueError(
                f"{' and '.join(settings.flag(TrainConfig, n) for n in mixing)} blend images pixel by pixel, "
                "and native-aspect images have grids of their own: drop them, or use --patches square"
            )

    def check_batch(self) -> None:
        """A one-line ValueError for a global batch that some world size of ``--num-workers`` cannot
        split into micro-batches: for a range, refused at the start, with the batch sizes that work at
        every size, rather than found at the first resize. Its arithmetic does not grow with the range:
        the sizes that split the batch are divisors of batch / micro-batch (at most ~46,000 tried)."""
        cluster, micro, batch = self.cluster, self.optim.micro_batch_size, self.optim.batch_size
        if isinstance(cluster.num_workers, int):
            if self.accumulation(cluster.num_workers) is None:
                raise ValueError(
                    f"--batch-size {batch} is not a multiple of --micro-batch-size x --num-workers "
                    f"= {micro * cluster.num_workers}; pick a batch size divisible by it"
                )
            return
        low, high = cluster.min_workers, cluster.max_workers
        works = [n for n in _divisors(batch // micro) if low <= n <= high] if batch % micro == 0 else []
        failing = high - low + 1 - len(works)
        if not failing:
            return
        taken = set(works)
        first = list(itertools.islice((n for n in range(low, high + 1) if n not in taken), _SHOWN))
        # The smallest batch that splits at every size: micro x lcm(low..high), named only when it is
        # within 64 batches (the lcm of a wide range is astronomical; it stops growing there).
        unit, most = micro, 64 * batch
        for n in range(low, high + 1):
            unit = math.lcm(unit, micro * n)
            if unit > most:
                break
        raise ValueError(
            f"--batch-size {batch} with --micro-batch-size {micro} does not split over "
            f"{_listed(first, failing)} worker(s) of --num-workers {shown_workers(cluster.num_workers)}"
            + (f" (it does over {_listed(works, len(works))})" if works else "")
            + "; an elastic run keeps the global batch at every size: "
            + (f"pick a multiple of {unit} (e.g. {unit}, {2 * unit}), or " if unit <= most else "")
            + "narrow the range to sizes that split it"
        )

    @classmethod
    def migrate(cls, values: dict[str, Any], version: int) -> dict[str, Any]:
        """A version 1 config (one flat object, as runs before sections saved it) as version 2."""
        renamed = {"data": "shards", "eval_data": "eval_shards", "crop_scale": "scale", "crop_ratio": "ratio"}
        paths = settings.paths(cls)
        nested: dict[str, dict[str, Any]] = {}
        unknown = []
        for key, value in values.items():
            path = paths.get(renamed.get(key, key))
            if path is None:
                unknown.append(key)
                continue
            nested.setdefault(path[0], {})[path[-1]] = value
        if unknown:
            raise ValueError(
                f"TrainConfig version {version} has unknown field(s) {', '.join(sorted(unknown))}"
            )
        return nested


_SHOWN = 6  # sizes a message lists before it counts the rest


def _listed(numbers: list[int], total: int) -> str:
    """``2, 3, 5`` or, of more than `_SHOWN` numbers (``total``), ``65, 66, 67, 68, 69, 70, ... (52 in
    all)``."""
    shown = ", ".join(map(str, numbers[:_SHOWN]))
    return shown if total <= _SHOWN else f"{shown}, ... ({total:,} in all)"


def _divisors(number: int) -> list[int]:
    """The divisors of ``number`` (>= 1) in order, in about sqrt(number) steps."""
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return small + [number // d for d in reversed(small) if d * d != number]


def worker_config(loop_config: dict[str, Any]) -> TrainConfig:
    """The run's config on a worker, as the driver resolved it (`pipeline.train.driver.fit`'s loop config):
    the saved form with the real storage options and URLs, which come inside the run directory's and the
    weights' Locations (the saved form holds no credential); without them, as saved."""
    config = TrainConfig.from_dict(loop_config["train"])
    out, weights = loop_config.get("out"), loop_config.get("weights")
    if weights is not None:
        config = config.replace(weights=weights.url)
    return config if out is None else config.replace(storage_options=dict(out.options) or None, out=out.url)
