"""MFU's denominator: the datasheet peak of exactly the GPU torch reports, or no MFU at all."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.step import peak_tflops

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
