"""The hybrid ViT's CNN stem (Dosovitskiy et al. 2021, Sec. 3.1 and Appendix D.2): a BiT-style ResNet.

    image (B, C, H, W) -> stem: 7x7/2 conv, GN, ReLU, 3x3/2 max-pool -> stages of bottleneck units
                       -> feature map (B, C', H/S, W/S)

The feature map becomes the token sequence through 1x1 "patches" (the model's patch projection is
then a Linear over C'). As in Big Transfer (Kolesnikov et al. 2020), which the paper's hybrids use:
GroupNorm with 32 groups instead of BatchNorm, weight-standardized convolutions, and TensorFlow's
"SAME" padding, which on an even-sized input pads a strided convolution at the bottom and right
only; the published R50+ViT weights were trained with it, so a symmetric padding would shift
every feature by a pixel against them.

Stage ``i`` holds ``layers[i]`` bottleneck units of width ``width * 2^i`` and outputs
``4 * width * 2^i`` channels; the first stage keeps the resolution, each later one halves it
(the stride sits on the 3x3 convolution). ``L`` stages thus have stride ``S = 4 * 2^(L-1)``: the
paper's R50+ViT-B/16 takes ResNet-50 with its stage 4 removed and those three units moved into
stage 3, ``layers = (3, 4, 9)``, stride 16, ``C' = 1024``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vit.config import ViTConfig

GROUPS = 32  # GroupNorm groups, as in BiT
NORM_EPS = 1e-5
# Inside the square root of the weight variance; the value of the published hybrid weights' reference
# implementation, so that converted weights compute the same function.
WS_EPS = 1e-8


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) padding of one spatial side so that the output has ceil(size / stride) positions."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    if top or bottom or left or right:
        x = F.pad(x, (left, right, top, bottom), value=value)
    return x


class StdConv2d(nn.Conv2d):
    """Conv2d without bias whose kernel is standardized per output channel (zero mean, unit variance)."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, device=None
    ) -> None:
        super().__init__(in_channels, out_channels, kernel, stride=stride, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Standardize in fp32: under FSDP mixed precision the kernel arrives in bf16.
        w = self.weight.float().flatten(1)  # (out, in * k * k)
        var, mean = torch.var_mean(w, dim=1, correction=0, keepdim=True)
        w = ((w - mean) * torch.rsqrt(var + WS_EPS)).view_as(self.weight).to(x.dtype)
        x = _pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, w, stride=self.stride)


class Stem(nn.Module):
    """7x7/2 convolution, GroupNorm, ReLU, 3x3/2 max-pool: ``(B, C, H, W) -> (B, width, H/4, W/4)``."""

    def __init__(self, in_channels: int, width: int, device=None) -> None:
        super().__init__()
        self.conv = StdConv2d(in_channels, width, 7, stride=2, device=device)
        self.norm = nn.GroupNorm(GROUPS, width, eps=NORM_EPS, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x)))
        return F.max_pool2d(_pad_same(x, 3, 2, value=-math.inf), 3, stride=2)


class Downsample(nn.Module):
    """The shortcut of a stage's first unit: 1x1 convolution (with the unit's stride) and GroupNorm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, device=None) -> None:
        super().__init__()
        self.conv = StdConv2d(in_channels, out_channels, 1, stride=stride, device=device)
        self.norm = nn.GroupNorm(GROUPS, out_channels, eps=NORM_EPS, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 convolutions, each with GroupNorm, added to the shortcut, then ReLU."""

    def __init__(self, in_channels: int, width: int, out_channels: int, stride: int = 1, device=None) -> None:
        super().__init__()
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = Downsample(in_channels, out_channels, stride, device=device)
        self.conv1 = StdConv2d(in_channels, width, 1, device=device)
        self.norm1 = nn.GroupNorm(GROUPS, width, eps=NORM_EPS, device=device)
        self.conv2 = StdConv2d(width, width, 3, stride=stride, device=device)
        self.norm2 = nn.GroupNorm(GROUPS, width, eps=NORM_EPS, device=device)
        self.conv3 = StdConv2d(width, out_channels, 1, device=device)
        self.norm3 = nn.GroupNorm(GROUPS, out_channels, eps=NORM_EPS, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(self.conv2(x)))
        return F.relu(self.norm3(self.conv3(x)) + shortcut)


class ResNet(nn.Module):
    """The hybrid's backbone: images ``(B, C, H, W)`` -> feature map ``(B, C', H/S, W/S)``.

    Parameter names: ``stem.{conv, norm}``, ``stages.I.J.{conv1..3, norm1..3, downsample.{conv, norm}}``.
    """

    def __init__(self, config: ViTConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        width = config.backbone_width
        self.stem = Stem(config.num_channels, width, device=device)
        stages = []
        channels = width
        for i, units in enumerate(config.backbone_layers):
            mid, out = width * 2**i, 4 * width * 2**i
            stage = nn.Sequential()
            for j in range(units):
                stride = 2 if i > 0 and j == 0 else 1
                stage.append(Bottleneck(channels, mid, out, stride=stride, device=device))
                channels = out
            stages.append(stage)
        self.stages = nn.ModuleList(stages)

    @torch.no_grad()
    def init_weights(self) -> None:
        """He-normal convolutions (fan-out), GroupNorm ones/zeros; in place, a no-op on meta.

        Weight standardization takes each kernel's scale away, so only the directions drawn matter.
        """
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.GroupNorm):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Match the weights' dtype: under FSDP mixed precision the convolutions hold bf16 weights.
        x = self.stem(x.to(self.stem.norm.weight.dtype))  # (B, width, H/4, W/4)
        for stage in self.stages:
            x = stage(x)
        return x  # (B, C', H/S, W/S)
