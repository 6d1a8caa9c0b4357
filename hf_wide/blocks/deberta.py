"""WideDebertaAttention: DeBERTa (v1)'s disentangled self-attention for N members at once.

As in DeBERTa-v2 (see ``deberta_v2.py``), the encoder reads its relative-position table directly and hands
it to every layer's attention; the encoder declares that read, so the table is stacked ``(N, 2M, D)`` and
this block, written for the stacked table, gives each member its own relative keys and queries. The rest
is the source's forward on all N*B rows: the fused ``in_proj`` (one matmul, no bias, q/k/v interleaved per
head), the raw ``q_bias``/``v_bias``, content-to-position and position-to-content scores, and the
talking-head projections.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers.models.deberta.modeling_deberta import (
    DebertaEncoder,
    DisentangledSelfAttention,
    build_relative_position,
    build_rpos,
    c2p_dynamic_expand,
    compute_attention_span,
    p2c_dynamic_expand,
    scaled_size_sqrt,
    uneven_size_corrected,
)

from ..packing import active as packing_of_this_call
from ..primitives.linear import WideLinear
from ..registry import register_block, register_stacked_read
from .base import WideBlock, member_slices

PROJECTIONS = ("in_proj", "pos_proj", "pos_q_proj", "head_logits_proj", "head_weights_proj")


def four_dims(relative_pos: torch.Tensor) -> torch.Tensor:
    """Relative positions (T, T), (B, T, T) or (B, H, T, T) as 4-d, as both DeBERTa sources take them."""
    if relative_pos.dim() == 2:
        return relative_pos.unsqueeze(0).unsqueeze(0)
    if relative_pos.dim() == 3:
        return relative_pos.unsqueeze(1)
    if relative_pos.dim() != 4:
        raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")
    return relative_pos


@register_block(DisentangledSelfAttention)
class WideDebertaAttention(WideBlock):
    """``in_proj``, ``pos_proj``, ``pos_q_proj``, ``head_logits_proj``, ``head_weights_proj``: WideLinears
    (where the source has them); ``q_bias``, ``v_bias``: (N, H*d). ``rel_embeddings`` arrives stacked,
    (N, 2M, D), or shared by all members, (2M, D)."""

    takes_stacked_inputs = True  # rel_embeddings, where the members' tables differ

    def build(self, mods: Sequence[nn.Module]) -> None:
        for name in PROJECTIONS:
            if isinstance(getattr(mods[0], name, None), nn.Linear):
                setattr(self, name, WideLinear.from_modules([getattr(m, name) for m in mods], self.fold))
        self.q_bias = nn.Parameter(torch.stack([m.q_bias.detach() for m in mods]), mods[0].q_bias.requires_grad)
        self.v_bias = nn.Parameter(torch.stack([m.v_bias.detach() for m in mods]), mods[0].v_bias.requires_grad)
        if self.relative_attention:
            self.pos_dropout = copy.deepcopy(mods[0].pos_dropout)
        self.dropout = copy.deepcopy(mods[0].dropout)

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        state = {"q_bias": self.q_bias[i], "v_bias": self.v_bias[i]}
        for name in PROJECTIONS:
            if name in self._modules:
                state.update(member_slices(name, self._modules[name], i))
        return state

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """DisentangledSelfAttention.transpose_for_scores: (rows, T, H*e) -> (rows, H, T, e)."""
        return x.view(*x.shape[:-1], self.num_attention_heads, -1).permute(0, 2, 1, 3)

    def _per_member(self, bias: torch.Tensor) -> torch.Tensor:
        """A (N, H*d) bias as (N, 1, H, 1, d): against (N, B, H, T, d) activations."""
        return bias.view(bias.shape[0], 1, self.num_attention_heads, 1, -1)

    def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None, relative_pos=None,
                rel_embeddings=None):  # hidden_states: (N*B, T, D), or (N, K, D) in a packed layer
        if query_states is not None:
            raise NotImplementedError("hf-wide's DeBERTa attention does not take separate query_states (the source's "
                                      "path for them handles 2-d inputs only).")
        n = self.num_members
        projected = self.in_proj(hidden_states)  # (N*B, T, 3*H*d)
        packing = packing_of_this_call()  # hf_wide.packing: the states are the batch's real tokens only
        if packing is not None:
            projected = packing.unpack(projected)
        query_layer, key_layer, value_layer = self._heads(projected).chunk(3, dim=-1)
        shape = query_layer.shape  # (N*B, H, T, d)
        query_layer = (query_layer.view(n, -1, *shape[1:]) + self._per_member(self.q_bias)).view(shape)
        value_layer = (value_layer.view(n, -1, *shape[1:]) + self._per_member(self.v_bias)).view(shape)

        rel_att = 0
        scale_factor = 1 + len(self.pos_att_type)
        scale = scaled_size_sqrt(query_layer, scale_factor)
        query_layer = query_layer / scale.to(dtype=query_layer.dtype)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))  # (N*B, H, T, T)
        if self.relative_attention and rel_embeddings is not None and relative_pos is not None:
            rel_embeddings = self.pos_dropout(rel_embeddings)
            rel_att = self.disentangled_att_bias(query_layer, key_layer, relative_pos, rel_embeddings, scale_factor)
        attention_scores = attention_scores + rel_att
        if "head_logits_proj" in self._modules:
            attention_scores = self.head_logits_proj(attention_scores.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

        attention_mask = attention_mask.bool()
        attention_scores = attention_scores.masked_fill(~attention_mask, torch.finfo(query_layer.dtype).min)
        attention_probs = self.dropout(nn.functional.softmax(attention_scores, dim=-1))
        if "head_weights_proj" in self._modules:
            attention_probs = self.head_weights_proj(attention_probs.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        context = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context = context.view(*context.shape[:-2], -1)  # (N*B, T, H*d)
        if packing is not None:
            context = packing.pack(context)  # (N, K, H*d)
        return context, (attention_probs if output_attentions else None)

    def disentangled_att_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        """The source's scores, each member's from its own table and projections: (N*B, H, T, T)."""
        if relative_pos is None:
            relative_pos = build_relative_position(query_layer, key_layer)
        relative_pos = four_dims(relative_pos)
        n = self.num_members
        att_span = compute_attention_span(query_layer, key_layer, self.max_relative_positions)
        relative_pos = relative_pos.long()
        if rel_embeddings.dim() == 2:  # one table shared by all members
            rel_embeddings = rel_embeddings.unsqueeze(0).expand(n, *rel_embeddings.shape)
        middle = self.max_relative_positions
        rel_embeddings = rel_embeddings[:, middle - att_span: middle + att_span]  # (N, 2s, D)

        def per_member(x: torch.Tensor) -> torch.Tensor:  # (N*B, H, T, e) -> (N, B, H, T, e)
            return x.view(n, -1, *x.shape[1:])

        score = 0
        if "c2p" in self.pos_att_type:  # content -> position
            pos_key_layer = self._heads(self.pos_proj(rel_embeddings)).unsqueeze(1)  # (N, 1, H, 2s, d)
            c2p_att = torch.matmul(per_member(query_layer), pos_key_layer.transpose(-1, -2)).flatten(0, 1)
            c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)
            score += torch.gather(c2p_att, dim=-1, index=c2p_dynamic_expand(c2p_pos, query_layer, relative_pos))
        if "p2c" in self.pos_att_type:  # position -> content
            pos_query_layer = self._heads(self.pos_q_proj(rel_embeddings)).unsqueeze(1)  # (N, 1, H, 2s, d)
            pos_query_layer = pos_query_layer / scaled_size_sqrt(pos_query_layer, scale_factor)
            r_pos = build_rpos(query_layer, key_layer, relative_pos)
            p2c_pos = torch.clamp(-r_pos + att_span, 0, att_span * 2 - 1)
            p2c_att = torch.matmul(per_member(key_layer), pos_query_layer.transpose(-1, -2).to(dtype=key_layer.dtype))
            p2c_att = torch.gather(p2c_att.flatten(0, 1), dim=-1,
                                   index=p2c_dynamic_expand(p2c_pos, query_layer, key_layer)).transpose(-1, -2)
            score += uneven_size_corrected(p2c_att, query_layer, key_layer, relative_pos)
        return score


register_stacked_read(DebertaEncoder, "rel_embeddings.weight", consumers=(DisentangledSelfAttention,))
