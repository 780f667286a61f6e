"""The sections of a training run (`pipeline.train.config.TrainConfig`), each a frozen dataclass of
settings (`pipeline.settings.setting`: one field, one doc line, one flag) that validates itself; the
messages name the flags through the same declaration.

Where the sections live: the training sections here, beside each other, rather than in the modules that
read them (`optim.py`, `model.py`, `objective.py` import torch), so that printing or checking a config
never loads torch; the data section is `pipeline.data.DataConfig` itself, owned by the data room, which
every job that reads shards shares.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

from pipeline import settings
from pipeline.data.mixture import EXHAUSTED, is_sources_file, parse_sources
from pipeline.settings import MAX_COUNT, MAX_SEED, setting
from vit.config import REGULARIZATION_FIELDS

OBJECTIVES = ("supervised", "mae")  # pipeline.train.step.objective has one class for each
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("cosine", "linear")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DATA_PROCESSES = ("inline", "feeder")  # pipeline.train.input.feeder runs the second
HEAD_INITS = ("zero", "probe")  # pipeline.train.finetune starts the new head from one of them
# The largest group of training workers (--num-workers N or MAX): far above any Ray cluster run so far
# (Ray documents clusters of ~2,000 nodes), and the bound that keeps the checks over a range quick.
MAX_WORKERS = 65_536
# The widest and deepest an MAE decoder may be set: far above any published one (MAE's: 512 wide, 8 deep).
MAX_WIDTH, MAX_DEPTH = 16_384, 1_024
# CPUs one worker may reserve: a node's, at most (the largest today have a few hundred).
MAX_CPUS = 1_024


def worker_count(text: str) -> int | tuple[int, int]:
    """``"8"`` -> 8, a fixed group; ``"2-8"`` -> (2, 8), elastic (``--num-workers``). MIN = MAX is a
    fixed group too."""
    low, dash, high = text.strip().partition("-")
    try:
        counts = (int(low), int(high)) if dash else int(low)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not N or MIN-MAX (whole numbers, e.g. 8 or 2-8)"
        ) from e
    return counts[0] if isinstance(counts, tuple) and counts[0] == counts[1] else counts


def shown_workers(num_workers: int | tuple[int, int]) -> str:
    """``--num-workers`` as written: ``8`` or ``2-8``."""
    return str(num_workers) if isinstance(num_workers, int) else f"{num_workers[0]}-{num_workers[1]}"


@dataclass(frozen=True)
class ArchConfig(settings.Settings):
    """Which network is trained, and from what."""

    model: str = setting("vit_b16", "model variant, e.g. vit_b16, vit_h14 (see vit.VARIANTS)")
    num_classes: int = setting(1000, "number of label classes of the head", ge=1, le=MAX_COUNT)
    model_overrides: dict[str, Any] = setting(
        help="ViTConfig fields that replace the variant's, as JSON", factory=dict, flag=None
    )
    weights: str | None = setting(
        None, "pretrained weights: export (final/), run dir, checkpoint_* dir or weights file"
    )
    head_init: str = setting(
        "zero",
        "fine-tuning's new head: zero (the ViT paper's) or probe (LP-FT: a linear probe fit on the "
        "pretrained model's embeddings of up to 10,000 training images, eval crop, then everything trains)",
        choices=HEAD_INITS,
    )
    drop_path_rate: float = setting(
        0.0,
        "stochastic depth: block i of D drops each residual branch per sample at this rate x i/(D-1) "
        "(0: off; DeiT: 0.1)",
        ge=0,
        lt=1,
    )
    dropout: float = setting(
        0.0,
        "dropout after the position embeddings, the attention projection and both MLP layers (0: off)",
        ge=0,
        lt=1,
    )

    def validate(self) -> None:
        super().validate()
        both = sorted(set(REGULARIZATION_FIELDS) & set(self.model_overrides))
        if both:
            raise ValueError(
                f"model_overrides may not set {', '.join(both)}: use {settings.flag(type(self), both[0])}"
            )


@dataclass(frozen=True)
class TaskConfig(settings.Settings):
    """The objective: supervised classification, or MAE (He et al. 2022)."""

    objective: str = setting(
        "supervised",
        "supervised (labels, classifier) or mae (masked autoencoding, no labels)",
        choices=OBJECTIVES,
    )
    mask_ratio: float = setting(
        0.75, "MAE: share of each image's patches hidden from the encoder", gt=0, lt=1
    )
    norm_pix_loss: bool = setting(True, "MAE: reconstruct each patch's standardized pixels, not raw ones")
    decoder_dim: int = setting(512, "MAE: width of the decoder's tokens", ge=1, le=MAX_WIDTH)
    decoder_depth: int = setting(8, "MAE: decoder blocks", ge=1, le=MAX_DEPTH)
    decoder_num_heads: int = setting(
        16, "MAE: decoder attention heads (must divide the decoder's width)", ge=1, le=MAX_WIDTH
    )
    label_smoothing: float = setting(
        0.0, "supervised: share of each target spread evenly over all classes (0: off; DeiT: 0.1)", ge=0, lt=1
    )
    mixup_alpha: float = setting(
        0.0,
        "supervised: Mixup, each micro-batch blended with itself reversed by a weight ~ Beta(a, a) "
        "(0: off; DeiT: 0.8)",
        ge=0,
        le=100,  # Beta(a, a) past a = 100 is 0.5 within a few percent: no mix of its own
    )
    cutmix_alpha: float = setting(
        0.0,
        "supervised: CutMix, a box of the reversed micro-batch pasted in, its share ~ Beta(a, a) "
        "(0: off; DeiT: 1.0)",
        ge=0,
        le=100,
    )
    mix_prob: float = setting(
        1.0, "with --mixup-alpha or --cutmix-alpha: chance that a micro-batch is mixed", ge=0, le=1
    )
    switch_prob: float = setting(
        0.5, "with --mixup-alpha and --cutmix-alpha: chance that a mixed micro-batch takes CutMix", ge=0, le=1
    )

    def validate(self) -> None:
        super().validate()
        if self.objective == "supervised":
            return
        soft = [n for n in ("label_smoothing", "mixup_alpha", "cutmix_alpha") if getattr(self, n)]
        if soft:
            raise ValueError(
                f"{', '.join(settings.flag(type(self), n) for n in soft)}: soft targets of supervised "
                f"training; drop them for --objective {self.objective}"
            )
        if self.decoder_dim % 4 or self.decoder_dim % self.decoder_num_heads:
            raise ValueError(
                f"--decoder-dim {self.decoder_dim} must be a multiple of 4 and of --decoder-num-heads "
                f"{self.decoder_num_heads}, e.g. 512 with 16 heads"
            )


@dataclass(frozen=True)
class OptimConfig(settings.Settings):
    """Optimization; the defaults are the ViT paper's pretraining recipe."""

    optimizer: str = setting(
        "adamw", "adamw, or sgd with momentum (the paper's fine-tuning)", choices=OPTIMIZERS
    )
    momentum: float = setting(0.9, "SGD momentum", ge=0, lt=1)
    batch_size: int = setting(
        4096, "global batch: images per optimizer step across all workers", ge=1, le=MAX_COUNT
    )
    micro_batch_size: int = setting(
        64, "images per worker per forward/backward (accumulation covers the rest)", ge=1, le=MAX_COUNT
    )
    # No recipe trains at a rate past 100 (LARS at a batch of 32k: ~13), nor decays weights past 10.
    lr: float = setting(1e-3, "peak learning rate, after warmup", gt=0, le=100)
    min_lr: float = setting(0.0, "learning rate at the end of the decay", ge=0, le=100)
    weight_decay: float = setting(0.1, "weight decay (not on biases, norms, pos/CLS embeddings)", ge=0, le=10)
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas B1,B2", metavar="B1,B2", ge=0, lt=1)
    warmup_steps: int = setting(10_000, "linear warmup steps", ge=0, le=MAX_COUNT)
    max_steps: int = setting(100_000, "optimizer steps of the schedule", ge=1, le=MAX_COUNT)
    lr_schedule: str = setting("cosine", "decay after warmup: cosine or linear", choices=LR_SCHEDULES)
    grad_clip: float = setting(
        1.0, "global gradient-norm clipping threshold (0: no clipping; DeiT trains without)", ge=0, le=1e9
    )
    max_skipped_steps: int = setting(
        5, "steps in a row skipped for a non-finite loss or gradient that fail the run", ge=1, le=MAX_COUNT
    )
    layer_decay: float = setting(
        1.0,
        "layer-wise lr decay: block i of D trains at lr x decay^(D - i), the embeddings at decay^(D + 1), "
        "the final norm and head at lr (MAE/BEiT fine-tuning: 0.65-0.75; 1: off)",
        gt=0,
        le=1,
    )
    ema_decay: float | None = setting(
        None,
        "keep an exponential moving average of the weights, decay per step, exported as final_ema/ "
        "(none: off; DeiT: 0.99996)",
        ge=0,
        lt=1,
    )
    ema_every: int = setting(
        1,
        "with --ema-decay: steps between EMA updates, each then by decay^N (the same horizon in steps)",
        ge=1,
        le=MAX_COUNT,
    )

    def validate(self) -> None:
        super().validate()
        if self.warmup_steps >= self.max_steps and self.max_steps > 1:
            raise ValueError(
                f"--warmup-steps {self.warmup_steps} leaves no decay within --max-steps {self.max_steps}; "
                "use fewer warmup steps"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"--min-lr {self.min_lr:g} must be in [0, --lr {self.lr:g}]: the schedule decays from --lr "
                "to it; pass a smaller --min-lr"
            )
        if self.ema_decay is None and self.ema_every != 1:
            raise ValueError(
                f"--ema-every {self.ema_every} needs --ema-decay (e.g. 0.9999); pass it or drop --ema-every"
            )


@dataclass(frozen=True)
class SpeedConfig(settings.Settings):
    """Speed switches; each computes what its default does (tests/train/test_speed_paths.py)."""

    activation_checkpointing: bool = setting(False, "recompute blocks in backward")
    ac_mode: str = setting(
        "full", "with --activation-checkpointing: full, alternate (every other block) or ops",
        choices=("full", "alternate", "ops"),
    )  # fmt: skip
    compile: bool = setting(False, "torch.compile the model (see --compile-scope)")
    compile_scope: str = setting(
        "blocks", "with --compile: blocks (one graph per block) or model (the whole forward)",
        choices=("blocks", "model"),
    )  # fmt: skip
    optimizer_impl: str = setting(
        "auto", "AdamW kernels: auto (fused on CUDA, else foreach), fused, foreach, for-loop",
        choices=("auto", "fused", "foreach", "for-loop"),
    )  # fmt: skip
    fp8: bool = setting(
        False, "float8 training of the blocks' Linear layers (torchao; H100 or newer; with --compile)"
    )
    prefetch_steps: int = setting(
        8,
        "steps of input built ahead on a background thread, hence the steps the next epoch's "
        "pipeline starts ahead (0: built by the step)",
        ge=0,
        le=256,  # each one is a step's input held in memory (and, with a feeder, a call in flight)
    )
    data_process: str = setting(
        "inline", "where each worker's data pipeline runs: inline (a thread of the training process) or "
        "feeder (a process of its own on the worker's node, step inputs through shared memory)",
        choices=DATA_PROCESSES,
    )  # fmt: skip

    def validate(self) -> None:
        super().validate()
        if self.fp8 and importlib.util.find_spec("torchao") is None:
            raise ValueError("--fp8 needs the torchao package: pip install 'vitray[fp8]'")


@dataclass(frozen=True)
class ClusterConfig(settings.Settings):
    """The shape of the run on the cluster."""

    num_workers: int | tuple[int, int] = setting(
        2,
        "training workers (one GPU each unless --cpu); MIN-MAX: elastic, started with MIN at least, "
        "grown or shrunk from the latest checkpoint as nodes join or leave (docs/scaling.md)",
        metavar="N|MIN-MAX",
        parse=worker_count,
        ge=1,
        le=MAX_WORKERS,
    )
    use_gpu: bool = setting(True, "train on GPU workers (NCCL); --cpu: CPU workers (gloo)", negative="cpu")
    cpus_per_worker: float = setting(
        1.0, "CPUs reserved per training worker; the rest decode data", gt=0, le=MAX_CPUS
    )
    placement_strategy: str = setting(
        "PACK", "workers over nodes: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD", choices=PLACEMENTS
    )
    data_cpus_per_worker: float | None = setting(
        None,
        "decode CPUs of each worker's data pipeline (none: the cluster's spare CPUs, re-read each epoch)",
        gt=0,
        le=MAX_CPUS,
    )
    shard_group_size: int | None = setting(
        None,
        "workers per FSDP shard group; groups replicate each other (HSDP) (none: the workers of a node)",
        ge=1,
        le=MAX_WORKERS,
    )
    shared_out: bool = setting(
        False, "a local --out is one filesystem mounted at the same path on every node"
    )

    @property
    def min_workers(self) -> int:
        """The fewest workers the run trains with: ``--num-workers`` N, or MIN of MIN-MAX."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        """The most workers the run trains with (what must hold for every size: shards, CPUs, one node)."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @property
    def world_sizes(self) -> range:
        """Every worker count the run may train with."""
        return range(self.min_workers, self.max_workers + 1)

    def validate(self) -> None:
        low, high = self.min_workers, self.max_workers
        if not isinstance(self.num_workers, int) and not 1 <= low <= high <= MAX_WORKERS:
            raise ValueError(
                f"--num-workers {shown_workers(self.num_workers)} must be N or MIN-MAX with "
                f"1 <= MIN <= MAX <= {MAX_WORKERS:,}, e.g. 8 or 2-8"
            )
        settings.check(self)  # every bound declared above, before any arithmetic over the range
        group = self.shard_group_size
        # A group divides every size of the range: one size it divides, or a group of one.
        if group is not None and not (group == 1 or (low == high and low % group == 0)):
            raise ValueError(
                f"--shard-group-size {group} does not divide --num-workers {shown_workers(self.num_workers)}"
                f"{' at every size' if low < high else ''}; use a divisor of it "
                "(usually the GPUs of one node), or leave it out"
            )


@dataclass(frozen=True)
class RunConfig(settings.Settings):
    """What the run reads and writes, and when."""

    shards: str = setting(
        "",
        "shard URL(s): path, directory, glob, brace range, s3://, gs://; comma-separated; or sources mixed "
        "by weight, NAME=URLS:WEIGHT,... or a .yaml file (README, 'Mixing sources')",
        flag="data",
    )
    source_exhausted: str = setting(
        "cycle",
        "with mixed sources, what one that runs out does: cycle (its next pass, new shard order; the "
        "epoch ends once every source has done a pass) or end (the epoch ends)",
        choices=EXHAUSTED,
    )
    eval_shards: str = setting(
        "", "held-out shards evaluated every --eval-every steps and at the end (labeled)", flag="eval-data"
    )
    out: str = setting("", "run directory (local path, s3:// or gs://); rerun with the same --out to resume")
    overwrite: bool = setting(
        False, "write into an --out that holds files no training run wrote (they may be replaced)"
    )
    seed: int = setting(0, "seed of initialization, shard order, crops and shuffling", ge=0, le=MAX_SEED)
    eval_every: int = setting(
        0, "steps between evaluations of --eval-data (0: only at the end)", ge=0, le=MAX_COUNT
    )
    log_every: int = setting(10, "steps between log lines / metrics.jsonl rows", ge=1, le=MAX_COUNT)
    checkpoint_every: int = setting(1000, "steps between checkpoints", ge=1, le=MAX_COUNT)
    keep_checkpoints: int = setting(3, "checkpoints kept (oldest deleted first)", ge=1, le=MAX_COUNT)
    async_checkpoint: bool = setting(
        True,
        "save checkpoints beside training: a step waits only for the state's copy to host memory, "
        "not for the write and upload (off: it waits for both)",
    )
    max_failures: int = setting(
        3, "worker-group restarts from the latest checkpoint after a failure", ge=0, le=MAX_COUNT
    )
    stop_at_step: int | None = setting(
        None, "end this run at that step (schedule unchanged); rerun to continue", ge=1, le=MAX_COUNT
    )
    hang_timeout: float | None = setting(
        None,
        "seconds in which no worker finishing a step is a hang: every worker's stacks go to <out>/hangs/ and "
        "the attempt fails, to restart from its latest checkpoint (default: 20 x the median step, at least "
        "600; an attempt's first step: at least 600 whatever is set; 0: never)",
        ge=0,
        le=1e7,
    )
    price_per_device_hour: float | None = setting(
        None,
        "what a worker's device costs an hour: the time lost to failures is also given in money "
        "(the summary, metrics.jsonl's goodput)",
        ge=0,
        le=1e9,
    )
    tensorboard: bool = setting(False, "also write TensorBoard event files under <out>/tensorboard/")
    wandb: str | None = setting(
        None, "also log to this Weights & Biases project (WANDB_MODE=offline: no network)", metavar="PROJECT"
    )

    def validate(self) -> None:
        if not self.shards:
            raise ValueError(
                "no training data: pass --data with a shard URL (path, glob, brace range, s3://...)"
            )
        if not is_sources_file(self.shards):  # a YAML file is read with the data (`prepare_data`)
            parse_sources(self.shards)  # a mixture's syntax and weights (one line)
        if not self.out:
            raise ValueError(
                "no output location: pass --out with a run directory (local path, s3:// or gs://)"
            )
        super().validate()
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb needs the wandb package: pip install 'vitray[wandb]'")


# `--keep-best`: the score that ranks a run's checkpoints (`pipeline.train.scoring.best`).
KEEP_BEST = ("probe", "knn", "eval", "loss")


@dataclass(frozen=True)
class ScoringConfig(settings.Settings):
    """What each checkpoint is worth: the probe beside training, the validation split, the best one kept
    (`pipeline.train.scoring`)."""

    probe_shards: str = setting(
        "",
        "labeled shards the checkpoint probe fits its linear probe and k-NN on, at every checkpoint, off the "
        "training workers (with --probe-eval-data)",
        flag="probe-data",
    )
    probe_eval_shards: str = setting(
        "", "labeled shards the checkpoint probe scores (held out from --probe-data)", flag="probe-eval-data"
    )
    probe_label_key: str = setting(
        "auto",
        "label member of the probe's shards, cls or json:<field> (auto: the run's --label-key, else cls)",
    )
    probe_cpus: float = setting(
        1.0,
        "CPUs of the probe's task: its torch threads (Ray schedules it beside the workers)",
        gt=0,
        le=MAX_CPUS,
    )
    probe_gpu: bool = setting(
        False, "run the probe's model on a GPU of its own, in bf16 (never a training one)"
    )
    probe_timeout: float = setting(
        3600.0,
        "seconds a probe may take before it is stopped and recorded as failed (the run's end waits at most "
        "twice this for its last one: the one before may still run)",
        gt=0,
        le=10**7,
    )
    keep_best: str | None = setting(
        None,
        "keep the best checkpoint by this score (never deleted by --keep-checkpoints, which then keeps the best "
        "ones and the latest) and export it as best/ beside final/: probe, knn (the checkpoint probe's), eval "
        "(the supervised head on --val-data), loss (the training loss)",
        choices=KEEP_BEST,
    )
    val_shards: str = setting(
        "",
        "held-out labeled shards the supervised head is scored on at every checkpoint, val_accuracy (with "
        "--keep-best eval and none given: carved from --data; the test set never)",
        flag="val-data",
    )

    @property
    def probing(self) -> bool:
        """Whether every checkpoint is probed (`pipeline.train.scoring.probe`)."""
        return bool(self.probe_shards)

    def validate(self) -> None:
        super().validate()
        flag = functools.partial(settings.flag, type(self))
        if bool(self.probe_shards) != bool(self.probe_eval_shards):
            given, missing = ("probe_shards", "probe_eval_shards")[:: 1 if self.probe_shards else -1]
            raise ValueError(
                f"{flag(given)} needs {flag(missing)}: the probe fits on one labeled set and scores another"
            )
        if self.keep_best in ("probe", "knn") and not self.probing:
            raise ValueError(
                f"--keep-best {self.keep_best} ranks checkpoints by the checkpoint probe: pass {flag('probe_shards')} "
                f"and {flag('probe_eval_shards')} (labeled shards), or --keep-best loss"
            )
