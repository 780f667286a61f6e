"""A query image embedded as the indexed output's rows were: its model (checked by the weights' sha256),
its kind (cls / pre_logits), its eval transform (the preprocessing its manifest records, through
`DataConfig.for_eval` and `pipeline.data.decode`), then normalized and rounded as it stored them.

On CPU in float32: rows embedded on a GPU in bf16 differ from it in the third digit or so, far less
than neighbours differ from each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline import storage
from pipeline.data.decode import preprocess_batch
from pipeline.embed.actor import embed_rows, embedding_dim
from pipeline.embed.identity import DEFAULT_OUTPUT_OPTIONS
from pipeline.model_source import load_model_source


def read_image(file: storage.Location | str) -> bytes:
    fs, path = storage.filesystem(file)
    if not fs.isfile(path):
        what = "is a directory" if fs.isdir(path) else "does not exist"
        raise ValueError(f"--image {file} {what}; pass an image file")
    return fs.cat_file(path)


def embed_image(
    image: storage.Location | str, weights: storage.Location | str, source: dict[str, Any], dim: int
) -> np.ndarray:
    """``image`` as the index's rows: float32 ``(1, D)``. ``source`` is the index manifest's record of
    its outputs. One-line ValueErrors: another width, other weights, an image that does not decode."""
    data = read_image(image)
    file = str(image)
    about = source.get("about") or {}
    kind = source.get("embedding") or "cls"
    loaded = load_model_source(weights, image_size=source.get("image_size"))
    width = embedding_dim(loaded.config, kind)
    if width != dim:
        raise ValueError(
            f"--weights {weights} gives D = {width} but the index has D = {dim}; pass the weights the "
            f"indexed output was embedded with ({source.get('model')})"
        )
    want = source.get("weights sha256")
    if want and loaded.sha256 != want:
        raise ValueError(
            f"--weights {weights} (sha256 {loaded.sha256[:12]}) are not the weights the indexed output was "
            f"embedded with (sha256 {want[:12]}); pass those"
        )
    config = loaded.eval_data(preprocessing=about.get("preprocessing") or {})  # the output's own
    batch = {
        "key": np.array(["query"], object),
        "url": np.array([file], object),
        "image": np.array([data], object),
        "label": np.array([-1], np.int64),
        "error": np.array([""], object),
    }
    rows = preprocess_batch(batch, config=config, train=False, epoch=0)
    if rows["error"][0]:
        raise ValueError(
            f"--image {file} does not decode ({rows['error'][0]}); pass a JPEG, PNG or WebP image"
        )
    net = loaded.model(torch.device("cpu"))
    vector = embed_rows(net, rows, pre_logits=kind == "pre_logits", batch_size=1)["embedding"]  # (1, D)
    options = source.get("output") or DEFAULT_OUTPUT_OPTIONS
    if options.get("normalize"):
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    if options.get("dtype") == "float16":
        vector = vector.astype(np.float16)
    return vector.astype(np.float32)
