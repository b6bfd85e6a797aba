"""The hybrid's ResNet stem (paper Sec. 3.1 "Hybrid Architecture"), as in the official code.

Convolutions are weight-standardised at run time, normalisation is GroupNorm(32), units are
post-activation bottlenecks, and every convolution and the max-pool use TensorFlow's `SAME` padding,
which pads more after than before when the total is odd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ResNetConfig


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF `SAME` padding of one axis: (before, after), the extra pixel going after."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2d(nn.Conv2d):
    """Conv2d with weight standardisation `(w - mean) / (std + 1e-5)` over (Cin, kh, kw), and `SAME` padding."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, eps: float = 1e-5):
        super().__init__(cin, cout, kernel, stride=stride, padding=0, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / (std + self.eps)
        x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, w, None, self.stride)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class Bottleneck(nn.Module):
    """Post-activation bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (4x width), GroupNorm after each conv."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1, self.gn1 = StdConv2d(cin, width, 1), group_norm(width)
        self.conv2, self.gn2 = StdConv2d(width, width, 3, stride), group_norm(width)
        self.conv3, self.gn3 = StdConv2d(width, cout, 1), group_norm(cout)
        self.needs_projection = cin != cout or stride != 1
        if self.needs_projection:
            self.conv_proj, self.gn_proj = StdConv2d(cin, cout, 1, stride), group_norm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.gn_proj(self.conv_proj(x)) if self.needs_projection else x
        y = F.relu(self.gn1(self.conv1(x)))
        y = F.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return F.relu(residual + y)


class ResNetStem(nn.Module):
    """Root conv 7x7/2 + GroupNorm + ReLU + max-pool 3x3/2, then stages of bottlenecks (stride 2 after the first).

    `forward` returns the feature map (B, C, H/stride, W/stride); `forward_intermediates` also the named
    intermediate outputs (`conv_root`, `gn_root`, `block1`, ...), as the official code would record them.
    """

    def __init__(self, config: ResNetConfig, in_chans: int = 3):
        super().__init__()
        width = 64 * config.width_factor
        self.conv_root = StdConv2d(in_chans, width, 7, stride=2)
        self.gn_root = group_norm(width)
        stages, cin = [], width
        for i, units in enumerate(config.units):
            stage_width = width * 2**i
            blocks = [Bottleneck(cin, stage_width, 1 if i == 0 else 2)]
            blocks += [Bottleneck(4 * stage_width, stage_width, 1) for _ in range(units - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = 4 * stage_width
        self.stages = nn.ModuleList(stages)
        self.out_channels = config.out_channels

    def forward_intermediates(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out: dict[str, torch.Tensor] = {}
        x = out["conv_root"] = self.conv_root(x)
        x = out["gn_root"] = self.gn_root(x)
        x = pad_same(F.relu(x), 3, 2, value=float("-inf"))
        x = F.max_pool2d(x, 3, 2)
        for i, stage in enumerate(self.stages):
            x = out[f"block{i + 1}"] = stage(x)
        return x, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_intermediates(x)[0]

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, StdConv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # The official code starts each residual branch at zero (gn3 scale = 0), so units begin as identities.
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.gn3.weight)
