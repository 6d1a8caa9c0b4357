"""Wide embeddings: one lookup in the N members' tables laid end to end."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_wide
from .base import WideModule


@register_wide(nn.Embedding)
class WideEmbedding(WideModule):
    """N ``nn.Embedding`` tables, ``weight``: (N, V, D). Member m's ids are offset by ``m*V`` into the
    (N*V, D) view, so all N*B rows are looked up by a single ``F.embedding`` call."""

    def setup(self, proto: nn.Embedding) -> None:
        self.num_embeddings = proto.num_embeddings
        self.embedding_dim = proto.embedding_dim
        self.padding_idx = proto.padding_idx
        if proto.max_norm is not None:
            raise NotImplementedError("WideEmbedding does not support max_norm (it renormalises in place).")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (N*B, ...) or broadcast (1, ...)
        idm = self.fold.split(ids)  # (N, b, ...)
        n = idm.shape[0]
        offsets = torch.arange(n, device=ids.device, dtype=ids.dtype) * self.num_embeddings
        offsets = offsets.view(n, *([1] * (idm.dim() - 1)))
        table = self.weight.view(n * self.num_embeddings, self.embedding_dim)  # (N*V, D)
        out = F.embedding(idm + offsets, table)  # (N, b, ..., D)
        return self.fold.merge(out)
