"""Wide convolutions: N members' convs as one grouped conv over their channels laid side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_wide
from .base import WideModule


@register_wide(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class WideConv(WideModule):
    """N convs, ``weight``: (N, C_out, C_in/g, *k). The members' channels go side by side,
    ``(N*B, C, *sp) -> (b, N*C, *sp)``, and one conv with ``groups = N*g`` computes every member."""

    runs_on_cudnn = True  # float32 in TF32 on CUDA where cuDNN allows it (hf_wide.compare.tf32_possible)

    def setup(self, proto: nn.modules.conv._ConvNd) -> None:
        # A member's attributes, as model code reads them (MobileNetV2's TF padding reads kernel_size and stride)
        self.in_channels, self.out_channels, self.kernel_size = proto.in_channels, proto.out_channels, proto.kernel_size
        self.stride, self.padding, self.dilation = proto.stride, proto.padding, proto.dilation
        self.groups, self.padding_mode = proto.groups, proto.padding_mode
        self._reversed_padding_repeated_twice = proto._reversed_padding_repeated_twice
        self._conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(proto.kernel_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, C_in, *sp)
        xm = self.fold.split(x)  # (N, b, C_in, *sp)
        n, b = xm.shape[:2]
        side = xm.transpose(0, 1).reshape(b, n * xm.shape[2], *xm.shape[3:])  # (b, N*C_in, *sp)
        padding = self.padding
        if self.padding_mode != "zeros":
            side = F.pad(side, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        weight = self.weight.reshape(-1, *self.weight.shape[2:])  # (N*C_out, C_in/g, *k)
        bias = None if self.bias is None else self.bias.reshape(-1)
        y = self._conv(side, weight, bias, self.stride, padding, self.dilation, n * self.groups)  # (b, N*C_out, *sp')
        y = y.view(b, n, -1, *y.shape[2:]).transpose(0, 1)  # (N, b, C_out, *sp')
        return self.fold.merge(y)
