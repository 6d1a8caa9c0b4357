"""Rewrites: a template module kept as it is, but for one method that runs a child's tensors on an input without
the batch dim.

MPNet's encoder computes one position bias for the whole batch: its ``relative_attention_bias`` embedding looks
up a ``(T, T)`` bucket table, and the result is expanded to the batch. Fused, that table has one row of weights
per member, and the bias must be each member's on its rows; no module of the encoder's can be swapped to do
that, so without a rewrite the whole encoder runs as one vectorised fallback. The rewrite is a subclass of the
source class (:func:`~hf_wide.registry.register_rewrite`) whose method reads the child's stacked weight,
``(N, ...)`` (or its one shared copy), and returns the folded ``(N*B, ...)`` result; everything else, the layers
included, runs as planned: wide linears, fused blocks. The planner uses a rewrite only while the children it
reads are stacked or shared, and verification checks the rewritten module's output with the rest (a kept module
that disagrees becomes a fallback).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

from .packing import active as packing_of_this_call
from .primitives.embedding import WideEmbedding
from .registry import register_rewrite


@register_rewrite(MPNetEncoder, reads=("relative_attention_bias",))
class WideMPNetEncoder(MPNetEncoder):
    """MPNet's encoder; each member's position bias from its own ``relative_attention_bias`` table."""

    def compute_position_bias(self, x, position_ids=None, num_buckets=32):
        if position_ids is not None:  # the encoder never passes them (nor could the source handle them)
            raise NotImplementedError("hf-wide's MPNet encoder computes the position bias without position_ids.")
        packing = packing_of_this_call()  # hf_wide.packing: x is the batch's real tokens only, (N, K, D)
        rows, length = (x.shape[0], x.shape[1]) if packing is None else (x.shape[0] * packing.batch, packing.length)
        position = torch.arange(length, dtype=torch.long, device=x.device)
        buckets = self.relative_position_bucket(position[None, :] - position[:, None], num_buckets=num_buckets)
        if type(self.relative_attention_bias) not in (WideEmbedding, nn.Embedding):  # the planner sees to it
            raise RuntimeError("hf-wide's MPNet encoder needs its relative_attention_bias stacked or shared.")
        table = self.relative_attention_bias.weight  # (N, K, H) stacked, or (K, H): one copy for every member
        values = table[..., buckets, :]  # (N, T, T, H) or (T, T, H)
        values = values.reshape(-1, length, length, table.shape[-1]).permute(0, 3, 1, 2)  # (n, H, T, T), n in {N, 1}
        n = values.shape[0]  # (N*B, H, T, T) below: the padded layout, which the attentions use in a packed encoder
        return values[:, None].expand(n, rows // n, *values.shape[1:]).reshape(rows, *values.shape[1:]).contiguous()
