"""Wide linear layers: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2), one batched matmul for N members."""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..fold import Fold
from ..registry import register_wide, transformers_classes
from .base import WideModule


def wide_linear(fold: Fold, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every member's ``x @ W + b`` in one batched matmul.

    x: (N*B, ..., D_in) member-major, or a broadcast (1, ..., D_in); weight_t: (N, D_in, D_out);
    bias: (N, D_out) or None. Returns (N*B, ..., D_out).
    """
    n = fold.num_members
    if x.shape[0] == 1 and n > 1:  # broadcast: every member's weights on the one row, then expand
        y = wide_linear(fold, x.expand(n, *x.shape[1:]), weight_t, bias)  # (N, ..., D_out)
        return fold.merge(y.unsqueeze(1))
    if x.shape[0] % n:
        raise RuntimeError(f"A wide layer got {x.shape[0]} rows, which do not split into {n} members.")
    # The common path, kept to four ops: small layers are bound by per-op overhead.
    flat = x.reshape(n, -1, x.shape[-1])  # (N, B*..., D_in), member-major rows
    if bias is None:
        y = torch.bmm(flat, weight_t)
    else:
        y = torch.baddbmm(bias.unsqueeze(1), flat, weight_t)  # (N, B*..., D_out)
    return y.view(*x.shape[:-1], y.shape[-1])


@register_wide(nn.Linear, *transformers_classes("falcon.FalconLinear"))  # Falcon's: x @ W.T (+ b), the same map
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
