"""``--decode gpu`` without a GPU: the read stage's vetting, the device path's crop and resize against the
CPU path's (PIL), which images go to the CPU and why, a corrupt JPEG inside a batch, the refusals, and a
whole run through Ray whose device decoder refuses every image (the CPU fallback end to end). The same
checks with nvJPEG itself are in tests/system/test_gpu.py (``make test-gpu``)."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import vit
from pipeline.data.config import DataConfig
from pipeline.data.decode import device_decodable, eval_crop_box, open_image, preprocess_batch, vet_batch
from pipeline.embed import device_decode
from pipeline.embed.actor import Embedder, embed_rows
from pipeline.embed.config import EmbedConfig
from pipeline.embed.device_decode import crop_resize, decode_rows
from pipeline.embed.devices import compute_identity
from pipeline.embed.job import prepare, run
from pipeline.embed.output import MANIFEST
from tests.embed.test_job import images_by_key

SIZE, PATCH = 32, 8


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients with noise: enough detail for resampling filters to differ where they differ."""
    g = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    y = np.linspace(0, 255, height)[:, None, None]
    return (0.6 * x + 0.4 * y + g.normal(0, 20, (height, width, 3))).clip(0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90, **options)
    return buf.getvalue()


def png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def cmyk_jpeg(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).convert("CMYK").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def pil_decoder(images: Sequence[bytes], device: torch.device) -> list[torch.Tensor]:
    """A stand-in for nvJPEG: whole JPEGs to RGB (3, H, W), refusing the batch if one cannot decode
    (as torchvision's batched call does)."""
    out = []
    for data in images:
        im = Image.open(io.BytesIO(data))
        if im.format != "JPEG":
            raise RuntimeError("not a JPEG")
        out.append(torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1).to(device))
    return out


def rows(images: list[bytes], errors: list[str] | None = None) -> dict[str, np.ndarray]:
    n = len(images)
    return {
        "key": np.array([f"k{i}" for i in range(n)], dtype=object),
        "url": np.array(["/d/s-0.tar"] * n, dtype=object),
        "image": np.array(images, dtype=object),
        "label": np.arange(n),
        "error": np.array(errors or [""] * n, dtype=object),
    }


def config(**changes) -> DataConfig:
    return DataConfig(image_size=SIZE, patch_size=PATCH, jpeg_draft=False, **changes)


def cpu_patches(batch: dict[str, np.ndarray], data_config: DataConfig) -> dict[str, np.ndarray]:
    return preprocess_batch(dict(batch), config=data_config, train=False, epoch=0, root="/d")


# --- the read stage: headers vetted, bytes left as they are ---------------------------------------


def test_which_images_the_device_decoder_takes():
    pixels = photo(48, 40)
    taken = {
        "baseline 4:2:0": jpeg(pixels),
        "baseline 4:4:4": jpeg(pixels, subsampling=0),
        "baseline 4:2:2": jpeg(pixels, subsampling=1),
        "gray": jpeg(pixels[..., 0]),
    }
    refused = {"progressive": jpeg(pixels, progressive=True), "CMYK": cmyk_jpeg(pixels), "PNG": png(pixels)}
    for name, data in {**taken, **refused}.items():
        assert device_decodable(open_image(data, 10**8)) is (name in taken), name


def test_vetting_keeps_the_bytes_and_makes_error_rows_of_bad_headers():
    pixels = photo(48, 40)
    images = [jpeg(pixels), png(pixels), b"<html>not an image</html>", jpeg(photo(400, 300)), b""]
    batch = rows(images, ["", "", "", "", ""])
    batch["error"][4] = "unreadable shard: connection reset"  # a read error stays as it came
    out = vet_batch(dict(batch), config=config(max_image_pixels=100_000))
    assert list(out["image"]) == images and list(out["key"]) == list(batch["key"])
    assert list(out["device"]) == [True, False, False, False, False]
    assert out["error"][0] == out["error"][1] == ""
    assert out["error"][2].startswith("undecodable image:")
    assert out["error"][3].startswith("image too large:")
    assert out["error"][4] == "unreadable shard: connection reset"


# --- the device path against the CPU path --------------------------------------------------------


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear", "lanczos"])
@pytest.mark.parametrize("shape", [(160, 120), (97, 131), (40, 40), (20, 30)])
def test_crop_resize_is_the_cpu_paths_resample_on_the_same_pixels(shape, interpolation):
    """Given the same decoded pixels, the device crop + resize gives PIL's: at most one level apart
    (PIL's fixed-point weights) on a handful of pixels, whether downscaling or upscaling."""
    width, height = shape
    pixels = photo(width, height, seed=width)
    box = eval_crop_box(width, height, SIZE, 0.875)
    image = Image.fromarray(pixels)
    expected = np.asarray(image.resize((SIZE, SIZE), Image.Resampling[interpolation.upper()], box=box))
    got = crop_resize(torch.from_numpy(pixels).permute(2, 0, 1), box, SIZE, interpolation).numpy()
    diff = np.abs(got.astype(int) - expected.astype(int))
    assert got.shape == (SIZE, SIZE, 3) and got.dtype == np.uint8
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


def test_device_rows_equal_cpu_rows_where_the_decoders_agree():
    """JPEGs through the (stand-in) device decoder, the rest through the CPU path: patches equal to the
    CPU path's rows within the resample's one level, the PNG and the progressive JPEG exactly."""
    data_config = config(crop_fraction=0.75, eval_interpolation="bilinear")
    images = [jpeg(photo(64, 48, 1)), png(photo(50, 70, 2)), jpeg(photo(90, 60, 3), progressive=True)]
    images += [jpeg(photo(33, 41, 4)[..., 0])]  # gray
    batch = vet_batch(rows(images), config=data_config)
    patches, errors = decode_rows(batch, data_config, torch.device("cpu"), decoder=pil_decoder)
    expected = cpu_patches(rows(images), data_config)
    assert list(errors) == [""] * 4
    assert patches.shape == expected["patches"].shape == (4, (SIZE // PATCH) ** 2, PATCH * PATCH * 3)
    diff = np.abs(patches.numpy().astype(int) - expected["patches"].astype(int))
    assert diff.max() <= 1
    np.testing.assert_array_equal(patches.numpy()[[1, 2]], expected["patches"][[1, 2]])


def test_a_corrupt_jpeg_in_a_batch_is_its_own_error_row_and_the_rest_decode():
    data_config = config()
    good = [jpeg(photo(64, 64, seed)) for seed in range(4)]
    truncated = good[1][: len(good[1]) // 2]  # a header that vets, a stream that ends early
    images = [good[0], truncated, good[2], good[3]]
    batch = vet_batch(rows(images), config=data_config)
    assert list(batch["device"]) == [True, False, True, True] and list(batch["error"]) == [""] * 4
    batch["device"][1] = True  # a corrupt stream the end marker does not give away
    calls = []

    def decoder(images: Sequence[bytes], device: torch.device) -> list[torch.Tensor]:
        calls.append(len(images))
        return pil_decoder(images, device)

    patches, errors = decode_rows(batch, data_config, torch.device("cpu"), decoder=decoder)
    assert calls == [4, 1, 1, 1, 1]  # the batch refused, then image by image
    assert errors[1].startswith("truncated image:") and list(errors[[0, 2, 3]]) == ["", "", ""]
    assert not patches[1].any()
    alone, _ = decode_rows(
        vet_batch(rows(good[2:3]), config=data_config), data_config, torch.device("cpu"), decoder=pil_decoder
    )
    np.testing.assert_array_equal(patches[2].numpy(), alone[0].numpy())


def test_vetted_error_rows_pass_through_with_zero_patches_and_no_decode():
    data_config = config()
    batch = vet_batch(rows([jpeg(photo(40, 40)), b"\xff\xd8junk"]), config=data_config)
    seen = []

    def decoder(images: Sequence[bytes], device: torch.device) -> list[torch.Tensor]:
        seen.extend(images)
        return pil_decoder(images, device)

    patches, errors = decode_rows(batch, data_config, torch.device("cpu"), decoder=decoder)
    assert errors[0] == "" and errors[1].startswith("undecodable image:") and len(seen) == 1
    assert not patches[1].any() and patches[0].any()


def test_embed_rows_takes_patches_already_on_the_device():
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", num_classes=4).eval()
    g = np.random.default_rng(0)
    batch = {
        "key": np.array(["a", "b", "c"], dtype=object),
        "url": np.array(["u"] * 3, dtype=object),
        "patches": g.integers(0, 256, (3, 16, 192), dtype=np.uint8),
        "label": np.arange(3),
        "error": np.array(["", "bad", ""], dtype=object),
    }
    numpy_rows = embed_rows(model, batch, batch_size=4)
    tensor_rows = embed_rows(model, {**batch, "patches": torch.from_numpy(batch["patches"])}, batch_size=4)
    np.testing.assert_array_equal(numpy_rows["embedding"], tensor_rows["embedding"])
    assert not tensor_rows["embedding"][1].any()


# --- refusals and identity ------------------------------------------------------------------------


def test_gpu_decode_is_part_of_the_outputs_identity_and_cpu_outputs_keep_theirs():
    assert compute_identity(False) == compute_identity(False, "cpu") == {"device": "cpu", "precision": "fp32"}
    assert compute_identity(True, "gpu") == {"device": "cuda", "precision": "bf16", "decode": "gpu"}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", num_classes=4)
    path = tmp_path_factory.mktemp("export")
    data = DataConfig(image_size=32, patch_size=8, crop_fraction=0.75, eval_interpolation="bilinear")
    vit.save_pretrained(path, model.state_dict(), model.config, extra={"preprocessing": data.to_dict()})
    return str(path)


def test_gpu_decode_refused_in_one_line_where_it_cannot_run(synthetic_shards, export, tmp_path, monkeypatch):
    base = EmbedConfig(data=synthetic_shards.brace_url, weights=export, out=str(tmp_path / "o"), decode="gpu")
    with pytest.raises(ValueError, match=r"--decode gpu decodes on the model actors' GPUs.*pass --gpu"):
        prepare(base)
    with pytest.raises(ValueError, match=r"resizes with bilinear, bicubic, lanczos; .* uses nearest"):
        prepare(base.replace(use_gpu=True, interpolation="nearest"))
    monkeypatch.setattr(device_decode, "check_available", lambda: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(ValueError, match=r"^x$"):
        prepare(base.replace(use_gpu=True))
    with pytest.raises(ValueError, match="--decode must be one of cpu, gpu"):
        base.replace(decode="nvjpeg").validate()
    assert not (tmp_path / "o").exists()


def test_a_run_whose_device_decoder_refuses_every_image_equals_the_cpu_path(
    ray_session, synthetic_shards, export, tmp_path
):
    """Through Ray on CPU: encoded rows to the model actor, the device decoder (nvJPEG, which a CPU
    actor cannot run) refusing every image, each one then decoded on the actor's CPU path: one row per
    key, each the CPU path's embedding of its image, and the output's identity saying where they decoded."""
    cpu = EmbedConfig(
        data=synthetic_shards.brace_url, weights=export, out=str(tmp_path / "gpu"), batch_size=8
    )
    plan = prepare(cpu)
    plan.config = plan.config.replace(decode="gpu")  # past prepare's refusal: the fallback is the point
    plan.header["compute"] = compute_identity(False, "gpu")
    summary = run(plan)
    assert (summary.rows, summary.bad_samples["bad"]) == (48, 0)
    table = pq.read_table(tmp_path / "gpu")
    keys = table.column("key").to_pylist()
    assert sorted(keys) == synthetic_shards.keys
    images = images_by_key(synthetic_shards.urls)
    expected = cpu_patches(rows([images[k] for k in keys]), plan.data_config)["patches"]
    model = vit.VisionTransformer(plan.source.config)
    model.load_state_dict(plan.source.state_dict)
    with torch.inference_mode():
        direct = model.eval().embed(torch.from_numpy(expected)).numpy()
    got = np.asarray(table.column("embedding").to_pylist(), np.float32)
    np.testing.assert_allclose(got, direct, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "gpu" / MANIFEST).read_text())["compute"]["decode"] == "gpu"


def test_the_embedder_decodes_encoded_rows_when_given_a_decode_config(monkeypatch):
    """The actor class as Ray Data builds it: with ``decode_config``, a batch of vetted encoded rows is
    decoded on its device (here the stand-in decoder on CPU) before the forward."""
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", num_classes=4).eval()
    from pipeline.model_source import pack_state_dict

    data_config = config()
    monkeypatch.setattr(device_decode, "nvjpeg", pil_decoder)
    # The actor sets its process's torch threads; this process's later tests keep theirs.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    embedder = Embedder(
        [pack_state_dict(model.state_dict())],
        model.config.to_dict(),
        pre_logits=False,
        batch_size=4,
        use_gpu=False,
        threads=1,
        decode_config=data_config,
    )
    images = [jpeg(photo(64, 48, seed)) for seed in range(3)]
    batch = vet_batch(rows(images), config=data_config)
    out = embedder(batch)
    patches, _ = decode_rows(batch, data_config, torch.device("cpu"), decoder=pil_decoder)
    with torch.inference_mode():
        direct = model.embed(patches).numpy()
    np.testing.assert_allclose(out["embedding"], direct, rtol=1e-5, atol=1e-5)
    assert list(out["error"]) == ["", "", ""] and list(out["key"]) == ["k0", "k1", "k2"]


# --- on a GPU (`make test-gpu`): nvJPEG itself -----------------------------------------------------


@pytest.mark.gpu
def test_nvjpeg_agrees_with_the_cpu_path_and_leaves_what_it_refuses_to_the_cpu():
    """Decoder tolerance: libjpeg-turbo's and nvJPEG's IDCT and chroma upsampling differ by a few
    levels at edges; over these photos the mean difference stays under 2 levels and none over 32.
    A truncated JPEG in the batch is its own error row; progressive, CMYK and PNG images decode on the
    CPU path, exactly as there; and the result is the same from a side stream (the decoder's work is
    synchronized before the crop reads it)."""
    device = torch.device("cuda")
    data_config = config()
    good = [jpeg(photo(160 + 8 * s, 120, s)) for s in range(6)] + [jpeg(photo(97, 131, 7)[..., 0])]
    others = [jpeg(photo(64, 64, 9), progressive=True), cmyk_jpeg(photo(64, 64, 10)), png(photo(50, 50, 11))]
    images = [*good, good[1][: len(good[1]) // 2], *others]
    batch = vet_batch(rows(images), config=data_config)
    patches, errors = decode_rows(batch, data_config, device)
    expected = cpu_patches(rows(images), data_config)
    assert all(e == "" for i, e in enumerate(errors) if i != 7) and errors[7].startswith(
        ("truncated image:", "undecodable image:")
    )
    got = patches.cpu().numpy().astype(int)
    diff = np.abs(got[:7] - expected["patches"][:7].astype(int))
    assert diff.mean() < 2 and diff.max() <= 32, (diff.mean(), diff.max())
    np.testing.assert_array_equal(got[8:], expected["patches"][8:])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        again, _ = decode_rows(batch, data_config, device)
    side.synchronize()
    np.testing.assert_array_equal(again.cpu().numpy(), got)
