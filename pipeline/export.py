"""The export job: a model vitray trained, as files that timm or transformers load, with a model card.

    --weights -> a run dir, its final/ or a checkpoint_* dir (what vitray wrote; `load_model_source`)
    --to timm -> model.safetensors + config.json (timm's folder format: timm.create_model("local-dir:DIR"))
    --to hf   -> model.safetensors + config.json + preprocessor_config.json (transformers' from_pretrained)
              + README.md: a model card from the run's record (data, objective, steps, its figures)

The conversion is `vit.export`'s; this module resolves the weights, checks the output directory (a rerun
for the same library replaces its own files; anything else there, another library's export included, is
refused, as every job does: `MARKER` says which export a folder holds), writes the files in a local
directory and uploads them with config.json last. One process, no Ray, no GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pipeline import cli, storage
from pipeline.model_source import ModelSource, load_model_source
from pipeline.settings import setting

TARGETS = ("timm", "hf")
CARD = "README.md"
LIBRARY = {"timm": "timm", "hf": "transformers"}


@dataclass(frozen=True)
class ExportConfig(storage.Output):
    """One export; ``jobs/export.py`` maps its flags onto it. Its storage and output section is every
    job's (`pipeline.storage.Output`)."""

    HELP: ClassVar[dict[str, str]] = {"out": "directory for the export (local, s3:// or gs://)"}

    weights: str = setting(
        help="what vitray wrote: a run dir, its final/ export or a checkpoint_* dir", required=True
    )
    to: str = setting(
        help="the library that loads the export: timm, or hf (transformers)", choices=TARGETS, required=True
    )
    encoder_only: bool = setting(
        False, "drop the head, for a head the target has no counterpart of (the embeddings stay the same)"
    )
    square: bool = setting(
        False,
        "export a model trained on native-aspect patches (--patches native) for square images, as the "
        "target's ViT takes them (the same weights; it computes what vitray computes on square input)",
    )


def export_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/export.py`'s command line (one process, no Ray)."""
    return cli.job_parser(
        "jobs/export.py",
        description,
        ExportConfig,
        defaults=ExportConfig(weights="", to="", out=""),
        ray=False,
    )


def command(args: argparse.Namespace) -> int:
    """`jobs/export.py`: `export` of the command line's config, its result printed."""
    if (config := cli.configured(args, ExportConfig)) is not None:
        print(export(config, begin=cli.start_work).format())
    return 0


MARKER = ".vitray-export"  # {"format": "vitray-export", "to": "timm"}: which export a folder holds


def owns(out: storage.Location, entries: dict[str, bool], target: str) -> bool:
    """Whether a folder that is not empty holds an export for ``target`` (`storage.check_output_dir`):
    its marker says so, not its file names (a transformers export writes every name a timm one does).
    A marker naming the other library is a one-line ValueError; a folder without one (a user's, or an
    export from before the marker) is not this export's."""
    if MARKER not in entries:
        return False
    try:
        held = json.loads(storage.read_text(out.join(MARKER))).get("to")
    except (OSError, ValueError, AttributeError):  # not JSON, or not an object
        held = None
    if held == target:
        return True
    what = (
        f"a vitray export for {LIBRARY[held]} (--to {held})"
        if held in LIBRARY
        else f"a {MARKER} that does not read"
    )
    raise ValueError(
        f"--out {out} holds {what}, not one for {LIBRARY[target]}; pick another --out, or pass --overwrite "
        "to replace it"
    )


@dataclass
class ExportResult:
    out: str
    target: str
    files: list[str]
    source: str  # the weights as `ModelSource.describe` gives them
    load: str  # a line of Python that loads the export

    def format(self) -> str:
        return "\n".join(
            [
                f"exported {self.source} for {LIBRARY[self.target]}",
                f"wrote {', '.join(self.files)} to {self.out}",
                f"load it with: {self.load}",
            ]
        )


def export(config: ExportConfig, begin: Callable[[], None] | None = None) -> ExportResult:
    """Run the export; one-line ValueErrors for bad input, raised before anything is written.
    ``begin`` is called when the checks are done and the output is about to be written."""
    from vit.export import check_exportable, save_hf, save_timm

    config.validate()
    out = config.location(config.out)
    storage.check_output_dir(
        out, job="this export", owns=lambda entries: owns(out, entries, config.to), overwrite=config.overwrite
    )
    source = load_vitray(config.location(config.weights))
    if _same_dir(config.out, source.path) or _same_dir(config.out, config.weights):
        raise ValueError(f"--out {config.out} is where the weights are; pick another directory")
    check_exportable(source.config, config.to, config.encoder_only)
    check_patches(source, config)
    record = run_record(source, config.location(source.path))
    eval_crop = record.get("crop_fraction") or 0.875
    interpolation = record.get("interpolation") or "bicubic"
    if begin is not None:
        begin()
    with tempfile.TemporaryDirectory(prefix="vitray-export-") as scratch:
        local = Path(scratch)
        if config.to == "timm":
            options = {"crop_fraction": eval_crop, "interpolation": interpolation}
            files = save_timm(
                local, source.state_dict, source.config, encoder_only=config.encoder_only, **options
            )
        else:
            options = {"interpolation": interpolation}
            files = save_hf(
                local, source.state_dict, source.config, encoder_only=config.encoder_only, **options
            )
        written = json.loads((local / "config.json").read_text())
        # A transformers ViTModel without the pretraining head's hidden layer has no pooler to load.
        no_pooler = written.get("architectures") == ["ViTModel"] and (
            config.encoder_only or source.config.head != "pretrain"
        )
        load = load_line(config.to, config.out, written, no_pooler)
        (local / CARD).write_text(model_card(config, source, record, written, load, no_pooler))
        (local / MARKER).write_text(json.dumps({"format": "vitray-export", "to": config.to}) + "\n")
        # config.json last: it is what both libraries open first, so a half-done upload is no model.
        storage.upload_dir(local, out, commit_last="config.json")
    return ExportResult(config.out, config.to, [*files, CARD], source.describe(), load)


# What each target has of a ViT for native-aspect patch batches (images at their own grids, padded).
NATIVE_TARGET = {
    "timm": "timm's NaFlexViT takes such batches but resamples its position embeddings with antialiasing, "
    "another function than vitray's",
    "hf": "transformers has no ViT that takes them",
}


def check_patches(source: ModelSource, config: ExportConfig) -> None:
    """A one-line ValueError for weights trained on native-aspect patches, which the target's ViT cannot
    take as vitray does, unless ``--square`` asks for the export to square images."""
    native = (source.preprocessing or {}).get("patches") == "native"
    if native and not config.square:
        size = source.config.image_size
        raise ValueError(
            f"--weights {config.weights} were trained on native-aspect patches (--patches native), and "
            f"{NATIVE_TARGET[config.to]}: pass --square to export them for square {size} px images"
        )


def load_vitray(location: storage.Location) -> ModelSource:
    """`load_model_source` for what vitray wrote only: weights of other libraries are refused in one line
    (they load in their own library already)."""
    weights = location.url
    if weights.rstrip("/").endswith((".pth", ".pt", ".bin")) or (
        weights.endswith(".safetensors") and not weights.endswith("weights.safetensors")
    ):
        raise ValueError(
            f"--weights {weights} is a weights file; export takes what vitray wrote: a run dir, its final/ "
            "or a checkpoint_* dir"
        )
    return load_model_source(location, weights_format="vitray")


def _same_dir(a: str, b: str) -> bool:
    a, b = a.rstrip("/"), b.rstrip("/")
    if storage.is_local(a) and storage.is_local(b):
        return Path(storage.local_path(a)).resolve() == Path(storage.local_path(b)).resolve()
    return a == b


# --- the model card ----------------------------------------------------------------------------------------


def run_record(source: ModelSource, where: storage.Location) -> dict[str, Any]:
    """What the weights' own config.json in ``where`` (``source.path`` with the job's options) tells of the
    run that made them (an export's training summary, or a checkpoint's saved configuration): the figures
    the card shows, absent where the record lacks them."""
    meta = _read_json(where.join("config.json"))
    if source.kind == "export":
        training = meta.get("training") or {}
        train = training.get("config") or {}
        step = training.get("step")
    else:  # a checkpoint: its saved run configuration, its step in its name
        training, train = {}, meta.get("train") or {}
        match = re.search(r"(\d+)$", source.path.rstrip("/"))
        step = int(match[1]) if match else None
    task, run, optim = (train.get(k) or {} for k in ("task", "run", "optim"))
    data = source.preprocessing or {}
    record = {
        "objective": meta.get("objective") or task.get("objective"),
        "data": run.get("shards"),
        "eval_data": run.get("eval_shards") or None,
        "step": step,
        "max_steps": training.get("max_steps", optim.get("max_steps")),
        "batch_size": optim.get("batch_size"),
        "optimizer": optim.get("optimizer"),
        "lr": optim.get("lr"),
        "loss": training.get("loss"),
        "accuracy": training.get("accuracy"),
        "eval_accuracy": training.get("eval_accuracy"),
        "crop_fraction": data.get("crop_fraction"),
        "interpolation": data.get("eval_interpolation"),
    }
    return {k: v for k, v in record.items() if v is not None}


def _read_json(file: storage.Location) -> dict[str, Any]:
    try:
        value = json.loads(storage.read_text(file))
    except (OSError, ValueError):
        return {}  # the card says less; the weights were checked as they loaded
    return value if isinstance(value, dict) else {}


def load_line(target: str, out: str, written: dict[str, Any], no_pooler: bool = False) -> str:
    """The line of Python that loads the export in its library."""
    if target == "timm":
        return f'timm.create_model("local-dir:{out}", pretrained=True)'
    pooler = ", add_pooling_layer=False" if no_pooler else ""
    return f'transformers.{written["architectures"][0]}.from_pretrained("{out}"{pooler})'


def model_card(
    config: ExportConfig,
    source: ModelSource,
    record: dict[str, Any],
    written: dict[str, Any],
    load: str,
    no_pooler: bool = False,
) -> str:
    """README.md of the export: how to load it, what goes in, the model, and the run that trained it."""
    c = source.config
    library = LIBRARY[config.to]
    head = _head(c, config)
    if config.to == "timm":
        embedding = "model.forward_head(model.forward_features(x), pre_logits=True)"
        inputs = "`timm.data.resolve_data_config({}, model=model)` gives them, and `timm.data.create_transform` applies them"
    else:
        encoder = "model.vit" if written["architectures"] == ["ViTForImageClassification"] else "model"
        embedding = f"{encoder}(pixel_values=x).last_hidden_state[:, 0]"
        inputs = "`ViTImageProcessor.from_pretrained` (preprocessor_config.json) applies them (it resizes, without a crop)"
    pooling = "the [CLS] token" if c.pool == "cls" else "the mean of the patch tokens"
    model_rows = [
        (
            "variant",
            f"{c.name}: embed_dim {c.embed_dim}, depth {c.depth}, {c.num_heads} heads, MLP {c.mlp_dim}",
        ),
        ("input", f"{c.image_size} x {c.image_size} px, {c.num_channels} channels, patch {c.patch_size}"),
        ("normalization", f"[0, 1] pixels, mean {list(c.mean)}, std {list(c.std)}"),
        *_native_row(source),
        ("embedding", f"{pooling} after the final LayerNorm, {c.embed_dim} values: `{embedding}`"),
        ("head", head),
        ("vitray weights", f"{source.kind} {source.path}, sha256 {source.sha256}"),
    ]
    training_rows = [
        ("objective", record.get("objective")),
        ("data", record.get("data")),
        ("evaluation data", record.get("eval_data")),
        ("steps", _steps(record)),
        ("batch size", record.get("batch_size")),
        ("optimizer", _optimizer(record)),
        ("final training loss", _figure(record.get("loss"))),
        ("training accuracy", _figure(record.get("accuracy"))),
        ("evaluation accuracy", _figure(record.get("eval_accuracy"))),
    ]
    training_rows = [(k, v) for k, v in training_rows if v not in (None, "")]
    pipeline_tag = "image-classification" if "classes" in head else "image-feature-extraction"
    lines = [
        "---",
        f"library_name: {library}",
        f"pipeline_tag: {pipeline_tag}",
        "tags: [vision, vit, vitray]",
        "---",
        "",
        f"# {c.name} for {library}",
        "",
        f"A Vision Transformer trained with vitray, exported by `python jobs/export.py --to {config.to}`.",
        "It computes what the vitray model computes on the same normalized images.",
        "",
        "## Load",
        "",
        "```python",
        f"import {'timm' if config.to == 'timm' else 'transformers'}",
        f"model = {load}",
        "```",
        "",
        *_load_notes(config.to, written, no_pooler),
        f"Input: images resized to {c.image_size} px, scaled to [0, 1], normalized with mean {list(c.mean)} "
        f"and std {list(c.std)}; {inputs}.",
        "",
        "## Model",
        "",
        *_table(model_rows),
        "",
        "## Training",
        "",
        *(_table(training_rows) if training_rows else ["The weights hold no record of their training run."]),
        "",
    ]
    return "\n".join(lines)


def _native_row(source: ModelSource) -> list[tuple[str, str]]:
    data = source.preprocessing or {}
    if data.get("patches") != "native":
        return []
    budget = data.get("max_patches") or source.config.num_patches
    return [
        (
            "trained on",
            f"images at their own aspect ratio, up to {budget} patches each (vitray --patches native); "
            "exported for square input (--square)",
        )
    ]


def _load_notes(target: str, written: dict[str, Any], no_pooler: bool) -> list[str]:
    if target == "timm":
        args = json.dumps(written["model_args"])
        return [
            f'Without the folder loader: `timm.create_model("{written["architecture"]}", pretrained=False, '
            f'**{args})`, then `model.load_state_dict(safetensors.torch.load_file("model.safetensors"))`.',
            "",
        ]
    if no_pooler:
        return [
            "The model has no pooler: `add_pooling_layer=False` keeps transformers from adding one of random "
            "weights (`last_hidden_state` is the same either way).",
            "",
        ]
    return []


def _head(c: Any, config: ExportConfig) -> str:
    if config.encoder_only:
        return "none (exported with --encoder-only)"
    if c.head == "pretrain":
        width = c.pre_logits_dim
        fc = f", then a Linear to {c.num_classes} classes" if c.num_classes else ""
        return f"pretraining head: Linear -> tanh ({width}){fc}; the ViTModel's pooler (`pooler_output`)"
    return f"Linear to {c.num_classes} classes" if c.num_classes else "none"


def _steps(record: dict[str, Any]) -> str | None:
    if "step" not in record:
        return None
    return f"{record['step']} of {record['max_steps']}" if "max_steps" in record else str(record["step"])


def _optimizer(record: dict[str, Any]) -> str | None:
    if "optimizer" not in record:
        return None
    return f"{record['optimizer']}, lr {record['lr']}" if "lr" in record else str(record["optimizer"])


def _figure(value: Any) -> str | None:
    return f"{value:.4f}" if isinstance(value, (int, float)) else None


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows)]
