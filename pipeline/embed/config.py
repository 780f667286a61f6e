"""What an embedding run is: one frozen dataclass that the command line of ``jobs/embed.py`` fills."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline import cli, settings
from pipeline.data.config import MAX_IMAGE_SIZE, DataConfig, EvalOverrides
from pipeline.data.native import MAX_PATCHES, PATCH_MODES
from pipeline.model_source import Weights
from pipeline.settings import MAX_COUNT, setting
from pipeline.storage import Output

MAX_ACTORS = 65_536  # model actors: one GPU each, far above any cluster's GPUs
MAX_CPUS = 1_024  # CPUs of one actor: a node's, at most

EMBEDDINGS = ("cls", "pre_logits")
DTYPES = ("float32", "float16")  # how the embedding column is stored
DECODERS = ("cpu", "gpu")  # where images decode (`pipeline.embed.device_decode`)
CPU_BATCH_SIZE, GPU_BATCH_SIZE = 64, 256  # default images per forward
# What `--label-key auto` means: the training run's label key, else this.
DEFAULT_LABEL_KEY = "cls"


@dataclass(frozen=True)
class EmbedConfig(EvalOverrides, Weights, Output):
    """One embedding run; the command line of ``jobs/embed.py`` maps onto it field by field. Its
    sections, shared with the other jobs that read a trained model: the storage and output
    (`pipeline.storage.Output`), the weights (`pipeline.model_source.Weights`), the evaluation
    transform over the model's own (`pipeline.data.config.EvalOverrides`)."""

    HELP: ClassVar[dict[str, str]] = {"overwrite": "redo every shard, replacing what --out holds"}

    data: str = setting(
        help="shard URL(s): path, directory, glob, brace range, s3://, gs://; comma-separated; or named "
        "sources, NAME=URLS,... or a .yaml file, as training's (every source's shards, weights unused)",
        required=True,
    )
    embedding: str = setting(
        "cls",
        "cls: [CLS] token after the final LayerNorm; pre_logits: the pretraining head's hidden layer",
        choices=EMBEDDINGS,
    )
    normalize: bool = setting(
        False, "L2-normalize each embedding (unit length: inner product is then cosine similarity)"
    )
    dtype: str = setting(
        "float32", "storage type of the embedding column (float16: half the bytes)", choices=DTYPES
    )
    image_size: int | None = setting(
        None, "input resolution (none: the model's; others resample pos_embed)", ge=1, le=MAX_IMAGE_SIZE
    )
    patches: str | None = setting(
        None,
        "square (resize, center crop) or native (each image whole, at its own aspect ratio, up to "
        "--max-patches patches) (none: as the model was trained)",
        choices=PATCH_MODES,
    )
    max_patches: int | None = setting(
        None,
        "with native patches: the most patches an image becomes (none: the model's own, else (image "
        "size / patch size)^2)",
        ge=4,
        le=MAX_PATCHES,
    )
    batch_size: int | None = setting(
        None, "images per forward pass (none: 64 on CPU, 256 per GPU)", ge=1, le=MAX_COUNT
    )
    concurrency: int = setting(1, "model actors, one GPU each on GPU", ge=1, le=MAX_ACTORS)
    # Chosen by --gpu / --cpu or from the cluster (`pipeline.embed.devices.choose_device`).
    use_gpu: bool = setting(False, "one GPU per model actor, bf16", flag=None)
    cpus_per_actor: float = setting(
        1.0,
        "CPUs per model actor, its torch threads on CPU (1 with GPUs or a cluster; "
        "this machine's cores / --concurrency on a local CPU run when not given)",
        gt=0,
        le=MAX_CPUS,
    )
    label_key: str | None = setting(
        "auto",
        "label member (cls) or json:<field>; none for unlabeled shards (auto: the training run's, else cls)",
    )
    max_bad_fraction: float = setting(0.01, "share of corrupt samples that fails the job", ge=0, le=1)
    max_lost_shards: int = setting(
        0,
        "shards that give no readable sample (zeros, an HTML page, an empty tar) before the job fails",
        ge=0,
        le=MAX_COUNT,
    )
    # The data stage's own setting, passed to it (`pipeline.embed.job.eval_data_config`): the model's
    # actors run wherever their GPUs are, only the read + decode tasks follow the label.
    decode_nodes: str | None = setting(
        None, settings.help_of(DataConfig.__dataclass_fields__["decode_nodes"]), metavar="KEY=VALUE"
    )

    decode: str = setting(
        "cpu",
        "where images decode: cpu (Ray Data's read tasks), or gpu (JPEGs by nvJPEG on the model actor's "
        "GPU, other images on its CPUs; needs --gpu's device and torchvision)",
        choices=DECODERS,
    )

    def validate(self) -> None:
        super().validate()
        DataConfig(decode_nodes=self.decode_nodes)  # its one-line refusal, before the weights load

    def forward_batch_size(self) -> int:
        """Images per forward: ``batch_size``, else 64 on CPU (a few hundred MB of activations at 224 px)
        and 256 on a GPU, where ViT-B/16 to ViT-H/14 at 224 px need that many to keep it busy."""
        return self.batch_size or (GPU_BATCH_SIZE if self.use_gpu else CPU_BATCH_SIZE)

    def output_options(self) -> dict[str, Any]:
        """How the embeddings are stored: part of the output's identity, its manifest and every footer."""
        return {"normalize": self.normalize, "dtype": self.dtype}


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/embed.py`'s command line: the settings, --cpu / --gpu, Ray's flags."""
    parser = cli.job_parser(
        "jobs/embed.py", description, EmbedConfig, defaults=EmbedConfig(data="", weights="", out="")
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run the model on CPU even where the cluster has GPUs"
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="one GPU per model actor, bf16, asked of the cluster (an autoscaler brings GPU nodes)",
    )
    return parser
