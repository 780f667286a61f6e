"""MFU (`pipeline.train.observe.mfu`): its denominator, the datasheet peak of exactly the GPU torch reports (or no
MFU at all), and the formula over model FLOPs per image."""

from __future__ import annotations

import pytest
import torch

import vit
from pipeline.train.config import TrainConfig
from pipeline.train.observe.mfu import PEAK_BF16_TFLOPS, achieved_tflops, mfu, peak_tflops, train_flops
from pipeline.train.step.objective import MAEObjective, Objective

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu_named(monkeypatch):
    """Make torch report a GPU of the given name (no CUDA needed)."""

    def name(text: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: text)

    return name


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # the SXM part
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),  # not the SXM peak, though its name holds "H100"
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40", 181.0),  # not the L4's peak, though its name holds "L4"
        ("NVIDIA L40S", 362.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
    ],
)
def test_known_gpus_get_their_own_peak(gpu_named, name, tflops):
    gpu_named(name)
    peak, note = peak_tflops(CUDA)
    assert peak == tflops
    assert name in note and "datasheet" in note


@pytest.mark.parametrize("name", ["NVIDIA H100 SXM5 96GB Prototype", "NVIDIA L4X", "AMD Instinct MI300X", ""])
def test_an_unknown_gpu_gets_no_mfu(gpu_named, name):
    gpu_named(name)
    peak, note = peak_tflops(CUDA)
    assert peak is None
    assert note.endswith("unknown GPU, MFU not reported")


def test_cpu_has_no_mfu():
    assert peak_tflops(torch.device("cpu")) == (None, "no MFU on CPU")


def test_mfu_is_model_flops_per_second_over_every_devices_peak():
    b16 = 3 * 35.2e9  # a ViT-B/16 training image at 224 px
    assert achieved_tflops(1000.0, b16) == pytest.approx(105.6)
    assert mfu(1000.0, b16, 989.0) == pytest.approx(105.6 / 989.0)
    assert mfu(8000.0, b16, 989.0, devices=8) == pytest.approx(mfu(1000.0, b16, 989.0))  # images over all
    assert mfu(1000.0, b16, None) is None and mfu(1000.0, b16, 0.0) is None  # no peak (CPU, unknown GPU)


def test_half_an_h100_trains_about_490_vit_h14_images_a_second():
    # The vit_h14_224 preset's expected figure: 3 x 334.8 GFLOPs an image against 989 TFLOP/s.
    per_image = train_flops(vit.count_flops(vit.get_config("vit_h14")))
    assert per_image / 1e9 == pytest.approx(3 * 334.8, rel=0.01)
    assert mfu(490.0, per_image, PEAK_BF16_TFLOPS["NVIDIA H100 80GB HBM3"]) == pytest.approx(0.5, abs=0.01)


def test_the_objectives_count_three_forwards_per_training_image():
    config = TrainConfig().replace(
        model="vit_tiny_test", image_size=32, num_classes=4, decoder_dim=32, decoder_depth=1
    )
    supervised = Objective(config)
    assert supervised.flops_per_image() == 3 * vit.count_flops(supervised.model_config)
    mae = MAEObjective(config.replace(objective="mae", label_key=None, decoder_num_heads=4))
    forward = vit.count_mae_flops(mae.model_config, mae.mae_config, mae.num_visible)
    assert mae.flops_per_image() == 3 * forward
