"""Wide linear layers: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2), one batched matmul for N members."""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..fold import Fold
from ..registry import register_wide
from .base import WideModule


def wide_linear(fold: Fold, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every member's ``x @ W + b`` in one batched matmul.

    x: (N*B, ..., D_in) member-major, or a broadcast (1, ..., D_in); weight_t: (N, D_in, D_out);
    bias: (N, D_out) or None. Returns (N*B, ..., D_out).
    """
    xm = fold.split(x)  # (N, b, ..., D_in)
    flat = xm.reshape(xm.shape[0], -1, xm.shape[-1])  # (N, b*..., D_in)
    if bias is None:
        y = torch.bmm(flat, weight_t)
    else:
        y = torch.baddbmm(bias.unsqueeze(1), flat, weight_t)  # (N, b*..., D_out)
    return fold.merge(y.view(*xm.shape[:-1], y.shape[-1]))


@register_wide(nn.Linear)
class WideLinear(WideModule):
    """N ``nn.Linear`` layers. ``weight``: (N, D_out, D_in), the members' own layout, so a weight tied to a
    ``WideEmbedding`` table (N, V, D) stays one tensor. ``bias``: (N, D_out)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D_in)
        return wide_linear(self.fold, x, self.weight.transpose(1, 2), self.bias)  # weight.T: a view


@register_wide(Conv1D)
class WideConv1D(WideModule):
    """N transformers ``Conv1D`` layers (GPT-2). Conv1D stores its weight transposed, ``(D_in, D_out)``, so
    the stacked weight (N, D_in, D_out) feeds ``baddbmm`` as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D_in)
        return wide_linear(self.fold, x, self.weight, self.bias)
