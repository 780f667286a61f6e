"""The model actor of the embedding job: loads the model once, then maps patch rows to embedding rows.

`embed_rows` is the batch function (plain numpy in and out, testable without Ray); `Embedder` is the
Ray Data callable class around it. Weights arrive as float32 numpy arrays from the object store
(`pipeline.model_source.pack_state_dict`): on CPU the model's tensors are those arrays themselves,
read-only and shared by every actor of a node; on GPU they are copied to the device once, in bf16,
and ``model.embed`` is compiled (one graph: every forward has the same shape).

Determinism: eval mode, and every forward sees a fixed shape (each chunk padded to ``batch_size``
rows; native-aspect rows are all ``max_patches`` wide), so an image's embedding does not depend on how
the stream was cut into batches or on how many bad samples were taken out beside it. On CUDA the weights themselves are bf16 (not autocast over
float32 weights: no per-forward casts, half the weight memory) and LayerNorm, softmax and the matmuls
accumulate in float32 inside their kernels; on CPU everything is float32, as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import vit
from pipeline.data import native
from pipeline.data.config import DataConfig
from pipeline.embed.device_decode import decode_rows
from pipeline.model_source import inference_model, unpack_state_dict


def embedding_dim(config: vit.ViTConfig, embedding: str) -> int:
    """D of the output: embed_dim for the [CLS] token, the head's hidden width for pre-logits."""
    return config.pre_logits_dim if embedding == "pre_logits" else config.embed_dim


def actor_memory(
    config: vit.ViTConfig, batch_size: int, use_gpu: bool, num_patches: int | None = None
) -> int:
    """Host memory of one actor, in bytes: the float32 weights (shared on a node, counted per actor to
    be safe) plus, on CPU, a forward's largest activations (MLP hidden and attention scores) over
    ``num_patches`` patches an image (None: the model's square grid)."""
    weights = 4 * sum(p.numel() for p in vit.VisionTransformer(config, device="meta").state_dict().values())
    tokens = (num_patches or config.num_patches) + 1
    activations = 0 if use_gpu else 4 * batch_size * tokens * (4 * config.mlp_dim + config.num_heads * tokens)
    return int(weights + activations + (512 << 20))  # + a Ray worker with torch loaded, batches in flight


def embed_rows(
    model: vit.VisionTransformer,
    batch: dict[str, np.ndarray],
    *,
    pre_logits: bool = False,
    batch_size: int = 64,
    device: torch.device | None = None,
) -> dict[str, np.ndarray]:
    """Patch rows -> embedding rows; error rows pass through with zero embeddings and no compute.

    In: ``key``, ``url``, ``patches`` uint8 ``(B, N, P*P*C)`` (numpy, or a tensor already on the
    device: `pipeline.embed.device_decode`), ``label`` int64, ``error`` str; native-aspect rows
    (`pipeline.data.native`) also ``coords``, ``mask`` and ``grid``.
    Out: ``key``, ``url``, ``embedding`` float32 ``(B, D)``, ``label``, ``error``. Good rows go through
    the model in chunks of ``batch_size``, each padded to exactly ``batch_size`` rows (fixed shapes),
    in the model's own weight dtype; embeddings come out as float32.
    """
    device = device or torch.device("cpu")
    errors = batch["error"]
    good = np.flatnonzero(np.fromiter((not e for e in errors), dtype=bool, count=len(errors)))
    dim = embedding_dim(model.config, "pre_logits" if pre_logits else "cls")
    out = np.zeros((len(errors), dim), np.float32)
    if good.size:
        # The model's inputs: patches (B, N, P*P*C), and for native-aspect rows coords, mask, grid.
        inputs = []
        for name in native.INPUTS if "grid" in batch else ("patches",):
            column = batch[name]
            if isinstance(column, torch.Tensor):
                inputs.append(column[torch.from_numpy(good).to(column.device)])  # (G, ...)
            else:
                inputs.append(torch.from_numpy(np.asarray(column)[good]))
        with torch.inference_mode():
            for lo in range(0, len(good), batch_size):
                chunk = [t[lo : lo + batch_size] for t in inputs]
                n = len(chunk[0])
                if n < batch_size:  # zero rows: a native one is all padding (mask False), read by no one
                    chunk = [torch.cat([t, t.new_zeros((batch_size - n, *t.shape[1:]))]) for t in chunk]
                x, *layout = (t.to(device, non_blocking=True) for t in chunk)
                native_input = dict(zip(("coords", "mask", "grid"), layout, strict=True)) if layout else {}
                emb = model.embed(x, pre_logits=pre_logits, **native_input)[:n]  # (n, D)
                out[good[lo : lo + n]] = emb.float().cpu().numpy()
    return {
        "key": batch["key"],
        "url": batch["url"],
        "embedding": out,
        "label": batch["label"],
        "error": errors,
    }


class Embedder:
    """Ray Data callable class: loads the model once per actor, then maps batches with `embed_rows`.
    With ``decode_config`` (``--decode gpu``) its batches are encoded rows, decoded on its device first."""

    def __init__(
        self,
        weights: list[Any],
        config: dict[str, Any],
        *,
        pre_logits: bool,
        batch_size: int,
        use_gpu: bool,
        threads: int,
        decode_config: DataConfig | None = None,
    ):
        import ray

        arrays = weights[0]
        if isinstance(arrays, ray.ObjectRef):
            arrays = ray.get(arrays)
        torch.set_num_threads(threads)
        self.device = torch.device("cuda") if use_gpu else torch.device("cpu")
        self.model = inference_model(
            vit.ViTConfig.from_dict(config),
            unpack_state_dict(arrays),
            self.device,
            dtype=torch.bfloat16 if use_gpu else torch.float32,
            compile=use_gpu,  # the first batch waits for compilation (tens of seconds for ViT-H)
        )
        self.pre_logits, self.batch_size = pre_logits, batch_size
        self.decode_config = decode_config

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.decode_config is not None:  # encoded rows: decoded here (`pipeline.embed.device_decode`)
            patches, errors = decode_rows(batch, self.decode_config, self.device)
            batch = {**batch, "patches": patches, "error": errors}
        return embed_rows(
            self.model, batch, pre_logits=self.pre_logits, batch_size=self.batch_size, device=self.device
        )
