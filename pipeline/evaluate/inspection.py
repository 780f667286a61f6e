"""The analyze job: a model's weights and a few images in, the paper's Fig. 7 panels and their numbers out.

    --weights -> load (as the embedding job does: export, run dir, checkpoint, timm/torchvision/HF file)
    --data    -> the first --images good images, the model's eval crop (`DataConfig.for_eval`), in this process
              -> patch-embedding filters: principal components             -> patch_embedding_filters.png
              -> position embeddings: cosine similarity, patch by patch    -> position_embedding_similarity.png
              -> attention maps of every block: mean attention distance    -> attention_distance.png
              -> analysis.json: the numbers behind the three

One process, no Ray: a few dozen forward passes through explicit attention maps, on the GPU where there
is one (``cpu`` keeps it on CPU).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import storage
from pipeline.data.shards import expand_shards
from pipeline.evaluate import analysis, figures, reconstruction
from pipeline.evaluate.attention import attention_distances, patch_distances
from pipeline.evaluate.config import AnalyzeConfig
from pipeline.evaluate.samples import eval_patches
from pipeline.model_source import load_model_source

FILTERS_PNG = "patch_embedding_filters.png"
POSITIONS_PNG = "position_embedding_similarity.png"
ATTENTION_PNG = "attention_distance.png"
ANALYSIS_JSON = "analysis.json"


@dataclass
class AnalysisResult:
    out: str
    files: list[str]  # what was written under out
    numbers: dict[str, Any]  # analysis.json

    def format(self) -> str:
        n = self.numbers
        layers = n["mean_attention_distance"]
        means = [float(np.mean(heads)) for heads in layers]
        position = n["position_embedding_similarity"]
        lines = [
            f"model: {n['model']['name']} ({n['model']['image_size']} px, patch {n['model']['patch_size']}), "
            f"{n['images']} images ({n['bad_samples']} bad samples skipped)",
            "mean attention distance (px, mean over heads) by layer: " + ", ".join(f"{m:.1f}" for m in means),
            f"  (uniform attention: {n['uniform_attention_distance']:.1f} px)",
            f"position embedding similarity: adjacent {position['adjacent']:.3f}, distant {position['distant']:.3f}",
        ]
        lines.append(f"wrote {', '.join(self.files)} to {self.out}")
        return "\n".join(lines)


def device_for(config: AnalyzeConfig) -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not config.cpu else "cpu")


OUTPUTS = (FILTERS_PNG, POSITIONS_PNG, ATTENTION_PNG, ANALYSIS_JSON, reconstruction.MAE_PNG)


def analyze(
    config: AnalyzeConfig, log: Callable[[str], None] = print, begin: Callable[[], None] | None = None
) -> AnalysisResult:
    """Run the analysis; one-line ValueErrors for bad input, raised before any image is decoded.
    ``begin`` is called when the checks are done and the output is about to be written."""
    config.validate()
    out = config.location(config.out)
    storage.check_output_dir(  # a rerun replaces its own files; anything else there is the user's
        out,
        job="the analysis",
        owns=lambda entries: all(name in OUTPUTS or storage.is_temporary(name) for name in entries),
        overwrite=config.overwrite,
    )
    figures.check_matplotlib()
    start = time.perf_counter()
    shards = expand_shards(config.location(config.data))
    weights = config.location(config.weights)
    source = load_model_source(weights, weights_format=config.weights_format, model=config.model)
    model_config = source.config
    device = device_for(config)
    model = source.model(device)
    log(f"{source.describe()} on {device}; {len(shards)} shard(s)")

    data_config = source.eval_data(
        config,
        # The panels are of the model's square grid (attention distances over it, its position
        # embeddings), whatever patches the model was trained with.
        patches="square",
        label_key=None,  # no labels needed
        require_labels=False,
        storage_options=config.storage_options,
    )
    patches, bad = eval_patches(shards, data_config, config.images)
    if len(patches) < config.images:
        log(f"note: --data holds {len(patches)} readable images, fewer than --images {config.images}")

    grid = (model_config.grid_size, model_config.grid_size)
    pixels_per_patch = model_config.image_size / model_config.grid_size
    batches = (
        torch.from_numpy(patches[i : i + config.batch_size])
        for i in range(0, len(patches), config.batch_size)
    )
    distances, seen = attention_distances(model, batches, device=device)
    uniform = float(patch_distances(grid, pixels_per_patch).mean())
    similarity = analysis.position_similarity(model.pos_embed.detach().cpu().numpy(), grid)

    numbers: dict[str, Any] = {
        "model": {
            "name": model_config.name,
            "image_size": model_config.image_size,
            "patch_size": model_config.patch_size,
            "depth": model_config.depth,
            "num_heads": model_config.num_heads,
            "weights_sha256": source.sha256,
            "weights": source.path,
        },
        "images": seen,
        "bad_samples": bad.bad,
        "mean_attention_distance": distances.round(4).tolist(),  # [layer][head], pixels
        "uniform_attention_distance": round(uniform, 4),
        "position_embedding_similarity": analysis.similarity_by_neighbourhood(similarity),
    }
    if begin is not None:
        begin()
    with tempfile.TemporaryDirectory() as scratch:
        local = Path(out.local_path) if out.is_local else Path(scratch)
        local.mkdir(parents=True, exist_ok=True)
        files = []
        proj = getattr(model.patch_embed, "proj", None)
        if isinstance(proj, torch.nn.Linear) and proj.in_features == model_config.patch_dim:
            weight = proj.weight.detach().cpu().numpy()  # (D, P*P*C)
            components, share = analysis.patch_filter_components(
                weight, model_config.patch_size, model_config.num_channels
            )
            numbers["patch_embedding_filters"] = {
                "components": len(share),
                "variance_share": share.round(4).tolist(),
            }
            files.append(Path(figures.plot_patch_filters(components, share, str(local / FILTERS_PNG))).name)
        else:  # a hybrid: the patch embedding reads CNN features, not pixels
            numbers["patch_embedding_filters"] = {"skipped": "the patch embedding does not read pixels"}
        files.append(Path(figures.plot_position_similarity(similarity, str(local / POSITIONS_PNG))).name)
        path = figures.plot_attention_distance(
            distances,
            str(local / ATTENTION_PNG),
            image_size=model_config.image_size,
            uniform=uniform,
            images=seen,
        )
        files.append(Path(path).name)
        # An MAE run's weights: its reconstructions too, with the decoder from the run's checkpoint.
        mae = reconstruction.mae_figure(weights, patches, data_config, str(local / reconstruction.MAE_PNG))
        if mae is not None:
            numbers["mae_reconstruction"] = mae
            files += [reconstruction.MAE_PNG] if "skipped" not in mae else []
        numbers["seconds"] = round(time.perf_counter() - start, 2)
        (local / ANALYSIS_JSON).write_text(json.dumps(numbers, indent=1) + "\n")
        files.append(ANALYSIS_JSON)
        if not out.is_local:
            storage.upload_dir(local, out)
    return AnalysisResult(config.out, files, numbers)
