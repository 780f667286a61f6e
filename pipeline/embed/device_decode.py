"""The embedding job's ``--decode gpu``: JPEGs decoded on the model actor's GPU, the eval crop made there.

The read tasks leave the images encoded (`pipeline.data.decode.vet_batch`: headers vetted, each row
told whether nvJPEG takes it), and the model actor turns a batch of them into patches on its device:

    vetted rows -> the JPEGs nvJPEG takes, decoded as one batch (torchvision ``decode_jpeg``, device=cuda)
                -> each image: the eval crop box (`pipeline.data.decode.eval_crop_box`) resampled on the
                   device as PIL resamples it on the CPU path (`crop_resize`: the same filter weights)
                -> every other image, and any JPEG the device refused: the CPU path, `transform_image`
                -> uint8 patches (B, N, P*P*3) on the device, and each row's error

A corrupt JPEG fails the batched call as a whole; the batch is then decoded image by image, and an image
the device still refuses goes to the CPU path, which either decodes it or names what is wrong with it
(that sample's error row, as on the CPU path: never a failed batch). The decoder runs outside the
current CUDA stream's order (torchcodec#1634 reports the same of nvJPEG behind torchvision), so the
stream is synchronized after it, before any kernel reads what it wrote.

Pixels differ from the CPU path's within decoder tolerance: the IDCTs are not bit-exact (nor are
PIL's fixed-point filter weights), and the CPU path's DCT-domain downscale (``jpeg_draft``) has no
counterpart here (the full image is decoded, as the CPU path does with ``jpeg_draft`` off). tests/embed/test_device_decode.py
states the tolerance. Pixels are the model's input, so ``--decode gpu`` is part of an output's identity
(`pipeline.embed.devices.compute_identity`): its rows never mix with CPU-decoded ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.data.config import DataConfig
from pipeline.data.decode import Box, decode_sample, eval_crop_box, pin_pil
from vit.patchify import patchify

# PIL's resampling filters as functions of the distance in (filter-scaled) source pixels, with their
# support: those whose box resize a matrix product here reproduces (PIL's "box" takes its window's
# edges otherwise, and "nearest" is no filter: both refused by --decode gpu).
FILTERS: dict[str, tuple[float, Callable[[torch.Tensor], torch.Tensor]]] = {
    "bilinear": (1.0, lambda x: (1 - x.abs()).clamp(min=0)),
    "bicubic": (
        2.0,
        lambda x: torch.where(
            x.abs() < 1,
            (1.5 * x.abs() - 2.5) * x.abs() ** 2 + 1,
            torch.where(x.abs() < 2, ((x.abs() - 5) * x.abs() + 8) * x.abs() * -0.5 + 2, 0.0),
        ),
    ),
    "lanczos": (3.0, lambda x: torch.where(x.abs() < 3, torch.sinc(x) * torch.sinc(x / 3), 0.0)),
}

# Encoded JPEGs -> RGB uint8 (3, H, W) tensors on the device, one per input; raises on any it refuses.
JpegDecoder = Callable[[Sequence[bytes], torch.device], list[torch.Tensor]]


def nvjpeg(images: Sequence[bytes], device: torch.device) -> list[torch.Tensor]:
    """A batch of JPEGs decoded by nvJPEG through torchvision, to RGB (gray ones widened)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = [torch.from_numpy(np.frombuffer(data, np.uint8).copy()) for data in images]
    decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    torch.cuda.current_stream(device).synchronize()  # the decoder does not order itself on this stream
    return decoded


def check_available() -> None:
    """``--decode gpu`` before any cluster work: torchvision's JPEG decoder must be importable."""
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as e:
        raise ValueError(
            f"--decode gpu needs torchvision's decode_jpeg (import failed: {type(e).__name__}); install "
            "torchvision built for this torch and CUDA, or pass --decode cpu"
        ) from None


def resample_weights(
    length: int, lo: float, hi: float, size: int, interpolation: str, device: torch.device
) -> torch.Tensor:
    """``(size, length)``: each output pixel's weights over one axis of the source, for the part
    ``[lo, hi)`` resampled to ``size`` pixels, as PIL computes them for a resize with a box (the filter
    widened by the downscale factor: antialiased; each row normalized to sum to 1)."""
    support, kernel = FILTERS[interpolation]
    scale = (hi - lo) / size
    widen = max(scale, 1.0)
    centers = lo + (torch.arange(size, dtype=torch.float64, device=device) + 0.5) * scale
    source = torch.arange(length, dtype=torch.float64, device=device) + 0.5
    distance = (source[None, :] - centers[:, None]) / widen
    weights = torch.where(distance.abs() < support, kernel(distance), 0.0)
    return (weights / weights.sum(dim=1, keepdim=True)).float()


def crop_resize(image: torch.Tensor, box: Box, size: int, interpolation: str) -> torch.Tensor:
    """uint8 ``(3, H, W)`` -> the ``box`` (source pixels, fractional) resampled to uint8
    ``(size, size, 3)`` on the image's device: PIL's ``resize(box=...)`` as two matrix products,
    horizontal then vertical, each rounded to uint8 as PIL's passes are."""
    height, width = image.shape[-2:]
    along_x = resample_weights(width, box[0], box[2], size, interpolation, image.device)  # (S, W)
    along_y = resample_weights(height, box[1], box[3], size, interpolation, image.device)  # (S, H)
    rows = (image.float() @ along_x.T).add_(0.5).floor_().clamp_(0, 255)  # (3, H, S)
    out = (along_y @ rows).add_(0.5).floor_().clamp_(0, 255)  # (3, S, S)
    return out.to(torch.uint8).permute(1, 2, 0)


def decode_rows(
    batch: dict[str, Any], config: DataConfig, device: torch.device, *, decoder: JpegDecoder | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """Vetted rows (`vet_batch`) -> ``(patches, error)``: uint8 patches ``(B, N, P*P*3)`` on ``device``
    (zeros on error rows) and each row's error ("" when good), in the eval transform of ``config``.
    ``decoder``: the JPEG decoder (default `nvjpeg`)."""
    pin_pil(config)
    images, size = batch["image"], config.image_size
    errors = np.array([str(e) for e in batch["error"]], dtype=object)
    pixels = torch.zeros((len(images), size, size, 3), dtype=torch.uint8, device=device)
    todo = [i for i in range(len(images)) if not errors[i]]
    on_device = [i for i in todo if batch["device"][i]]
    decoded = _decode(decoder or nvjpeg, [images[i] for i in on_device], device)
    for i, image in zip(on_device, decoded, strict=True):
        if image is not None:
            height, width = image.shape[-2:]
            box = eval_crop_box(width, height, size, config.crop_fraction)
            pixels[i] = crop_resize(image, box, size, config.eval_interpolation)
    refused = {i for i, image in zip(on_device, decoded, strict=True) if image is None}
    for i in todo:
        if i in refused or not batch["device"][i]:
            cpu_pixels, errors[i] = decode_sample(images[i], config, train=False, rng=None)
            if cpu_pixels is not None:
                pixels[i] = torch.from_numpy(cpu_pixels.copy()).to(device)
    return patchify(pixels, config.patch_size), errors


def _decode(decoder: JpegDecoder, images: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """The batch in one call; if the decoder refuses it, image by image (None where it refuses one)."""
    if not images:
        return []
    try:
        return list(decoder(images, device))
    except Exception:
        pass  # a corrupt or unsupported image in the batch: find which, one at a time
    out: list[torch.Tensor | None] = []
    for data in images:
        try:
            out.append(decoder([data], device)[0])
        except Exception:
            out.append(None)
    return out
