"""Wide embeddings: one lookup in the N members' tables laid end to end."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_wide, transformers_classes
from .base import WideModule


def no_padding_gradient(out: torch.Tensor, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """``out`` (the rows looked up for ``ids``, shaped as ``ids`` plus one dim) with no gradient through the rows of
    the padding token, as ``F.embedding(..., padding_idx=p)`` gives none to row p: a lookup in members' tables laid end
    to end, one padding row each, cannot say so itself. The values are unchanged."""
    if padding_idx is None or not out.requires_grad:
        return out
    return torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)


@register_wide(nn.Embedding)
class WideEmbedding(WideModule):
    """N ``nn.Embedding`` tables, ``weight``: (N, V, D). Member m's ids are offset by ``m*V`` into the
    (N*V, D) view, so all N*B rows are looked up by a single ``F.embedding`` call."""

    def setup(self, proto: nn.Embedding) -> None:
        self.num_embeddings = proto.num_embeddings
        self.embedding_dim = proto.embedding_dim
        self.padding_idx = proto.padding_idx
        self.scale_grad_by_freq = proto.scale_grad_by_freq
        if proto.max_norm is not None:
            raise NotImplementedError("WideEmbedding does not support max_norm (it renormalises in place).")
        offsets = torch.arange(self.num_members, device=self.weight.device) * self.num_embeddings
        self.register_buffer("offsets", offsets.view(-1, 1), persistent=False)  # (N, 1): member m starts at m*V

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (N*B, ...) or broadcast (1, ...)
        n = self.num_members
        broadcast = ids.shape[0] == 1 and n > 1  # (position ids): every member's rows, then expanded to the batch
        flat = ids.reshape(1 if broadcast else n, -1)  # (N or 1, B*...)
        # member m's ids index rows m*V.. of the (N*V, D) table; counted per member, for scale_grad_by_freq too
        out = F.embedding(flat + self.offsets, self.weight.view(-1, self.embedding_dim),
                          scale_grad_by_freq=self.scale_grad_by_freq)  # (N, B*..., D)
        out = no_padding_gradient(out, flat, self.padding_idx)
        if broadcast:
            return self.fold.merge(out.view(n, *ids.shape, self.embedding_dim))
        return out.view(*ids.shape, self.embedding_dim)


@register_wide(*transformers_classes("gemma.GemmaTextScaledWordEmbedding", "gemma2.Gemma2TextScaledWordEmbedding",
                                     "gemma3.Gemma3TextScaledWordEmbedding", "bart.BartScaledWordEmbedding",
                                     "mbart.MBartScaledWordEmbedding", "m2m_100.M2M100ScaledWordEmbedding",
                                     "biogpt.BioGptScaledWordEmbedding", "xglm.XGLMScaledWordEmbedding"))
class WideScaledWordEmbedding(WideEmbedding):
    """N scaled word embeddings: an ``nn.Embedding`` whose forward multiplies the lookup by ``embed_scale``,
    sqrt(hidden) or 1. ``weight``: (N, V, D). Gemma's scale is a non-persistent buffer, applied in the
    weight's dtype: ``embed_scale`` (N,), each member's own; BART's is a float, the same in every member
    (its config's)."""

    def setup(self, proto: nn.Embedding) -> None:
        super().setup(proto)
        if "embed_scale" not in self._buffers:
            self.embed_scale = proto.embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (N*B, ...) or broadcast (1, ...)
        y = self.fold.split(super().forward(ids))  # (N, b, ..., D)
        scale = self.embed_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(self.weight.dtype).view(-1, *([1] * (y.dim() - 1)))  # (N, 1, ...)
        return self.fold.merge(y * scale)
