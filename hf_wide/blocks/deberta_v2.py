"""WideDebertaV2Attention: DeBERTa-v2/v3's disentangled self-attention for N members at once.

DeBERTa's encoder reads its relative-position table (``rel_embeddings.weight``) directly and hands it to
every layer's attention, which projects it with its own key/query weights. So the table cannot be a plain
primitive's: read by the encoder, a stacked ``(N, 2S, D)`` table would reach attention code written for one
``(2S, D)`` table. This block is that attention, written for the stacked table: Q, K and V of every member
in one matmul, each member's relative keys and queries from its own table and weights, then the source's
content-to-position and position-to-content scores on all N*B rows. The encoder declares the read
(``register_stacked_read``), so with these blocks in place DeBERTa runs without a per-member fallback; its
``LayerNorm`` over the table is row-wise, so a wide (or shared) one normalises each member's rows alone.

The source projects all 2S rows of the table (512 in DeBERTa-v3) in every layer, whatever the input's
length; this block projects only the rows the input's relative positions reach: at short inputs that
projection, done once per member, would otherwise be most of the forward.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch
from torch import nn
from transformers.models.deberta_v2.modeling_deberta_v2 import (
    DebertaV2Encoder,
    DisentangledSelfAttention,
    build_relative_position,
    build_rpos,
    make_log_bucket_position,
    scaled_size_sqrt,
)

from ..packing import active as packing_of_this_call
from ..primitives.linear import WideLinear, wide_linear
from ..registry import register_block, register_stacked_read
from .base import WideBlock, fused_parameter, member_slices
from .deberta import four_dims

QKV = ("query_proj", "key_proj", "value_proj")
POSITION_PROJECTIONS = ("pos_key_proj", "pos_query_proj")  # absent with share_att_key


@functools.lru_cache(maxsize=256)
def _bucketed_reach(length: int, buckets: int, max_position: int) -> int:
    """The largest log-spaced bucket among distances 0..length-1, + 1: another device may round the bucket's
    log the other way. Cached: every layer of every forward asks it for the same few lengths."""
    bucketed = make_log_bucket_position(torch.arange(length, dtype=torch.long), buckets, max_position)
    return int(bucketed.abs().max()) + 1


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """DisentangledSelfAttention.transpose_for_scores: (rows, T, H*d) -> (rows*H, T, d)."""
    x = x.view(*x.shape[:-1], heads, -1)
    return x.permute(0, 2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))


@register_block(DisentangledSelfAttention)
class WideDebertaV2Attention(WideBlock):
    """``qkv_weight``: (N, 3*H*d, D) and ``qkv_bias``: (N, 3*H*d), each member's query, key and value
    projections stacked along the outputs; ``pos_key_proj``/``pos_query_proj``: WideLinears (when the source
    has them). ``rel_embeddings`` arrives stacked, (N, 2S, D), or shared by all members, (2S, D)."""

    takes_stacked_inputs = True  # rel_embeddings, where the members' tables differ

    def build(self, mods: Sequence[nn.Module]) -> None:
        self.sizes = [mods[0].get_submodule(n).out_features for n in QKV]
        self.qkv_weight = fused_parameter(mods, QKV, "weight")
        self.qkv_bias = fused_parameter(mods, QKV, "bias")  # the source's projections all have one
        for name in POSITION_PROJECTIONS:
            if hasattr(mods[0], name):
                setattr(self, name, WideLinear.from_modules([getattr(m, name) for m in mods], self.fold))
        if self.relative_attention:
            self.pos_dropout = copy.deepcopy(mods[0].pos_dropout)
        self.dropout = copy.deepcopy(mods[0].dropout)

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        state = {}
        weights, biases = self.qkv_weight[i].split(self.sizes), self.qkv_bias[i].split(self.sizes)
        for name, weight, bias in zip(QKV, weights, biases):
            state[f"{name}.weight"], state[f"{name}.bias"] = weight, bias
        for name in POSITION_PROJECTIONS:
            if name in self._modules:
                state.update(member_slices(name, self._modules[name], i))
        return state

    def _project(self, x: torch.Tensor, part: slice) -> torch.Tensor:
        """Rows of every member through the ``part`` of their fused q/k/v projections: (R, T, D) -> (R, T, P)."""
        return wide_linear(self.fold, x, self.qkv_weight[:, part].transpose(1, 2), self.qkv_bias[:, part])

    def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None, relative_pos=None,
                rel_embeddings=None):  # hidden_states: (N*B, T, D), or (N, K, D) in a packed layer
        heads, q = self.num_attention_heads, self.sizes[0]
        packing = packing_of_this_call()  # hf_wide.packing: the states are the batch's real tokens only
        if query_states is None:
            qkv = self._project(hidden_states, slice(None))  # (N*B, T, 3*H*d)
            query, key, value = (qkv if packing is None else packing.unpack(qkv)).split(self.sizes, dim=-1)
        elif packing is not None:
            raise RuntimeError("A packed layer reached DeBERTa's attention with queries from elsewhere.")
        else:  # the enhanced mask decoder's queries come from elsewhere
            query = self._project(query_states, slice(0, q))
            key, value = self._project(hidden_states, slice(q, None)).split(self.sizes[1:], dim=-1)
        query_layer, key_layer, value_layer = (_heads(t, heads) for t in (query, key, value))  # (N*B*H, T, d)

        scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        scale = scaled_size_sqrt(query_layer, scale_factor)
        attention_scores = torch.bmm(query_layer, key_layer.transpose(-1, -2) / scale.to(dtype=query_layer.dtype))
        if self.relative_attention:
            rel_embeddings = self.pos_dropout(rel_embeddings)
            attention_scores = attention_scores + self.disentangled_attention_bias(
                query_layer, key_layer, relative_pos, rel_embeddings, scale_factor
            )
        attention_scores = attention_scores.view(-1, heads, attention_scores.size(-2), attention_scores.size(-1))

        attention_mask = attention_mask.bool()
        attention_scores = attention_scores.masked_fill(~attention_mask, torch.finfo(query_layer.dtype).min)
        attention_probs = self.dropout(nn.functional.softmax(attention_scores, dim=-1))  # (N*B, H, T, T)
        context = torch.bmm(attention_probs.view(-1, *attention_probs.shape[-2:]), value_layer)
        context = context.view(-1, heads, *context.shape[-2:]).permute(0, 2, 1, 3).contiguous()
        context = context.view(*context.shape[:-2], -1)  # (N*B, T, H*d)
        if packing is not None:
            context = packing.pack(context)  # (N, K, H*d)
        return context, (attention_probs if output_attentions else None)

    def disentangled_attention_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        """The source's content-to-position and position-to-content scores, each member's from its own table
        and projections: (N*B*H, T, T)."""
        if relative_pos is None:
            relative_pos = build_relative_position(query_layer, key_layer, bucket_size=self.position_buckets,
                                                   max_position=self.max_relative_positions)
        att_span = self.pos_ebd_size
        relative_pos = four_dims(relative_pos).to(device=query_layer.device, dtype=torch.long)

        n, heads = self.num_members, self.num_attention_heads
        if rel_embeddings.dim() == 2:  # one table shared by all members
            rel_embeddings = rel_embeddings.unsqueeze(0).expand(n, *rel_embeddings.shape)
        # Only the rows this length's relative positions reach: the source projects all 2S of them.
        first, last = self._rows_reached(max(query_layer.size(-2), key_layer.size(-2)), att_span)
        rel_embeddings = rel_embeddings[:, first:last]  # (N, rows, D)
        batch = query_layer.size(0) // (n * heads)

        def per_row(projected: torch.Tensor) -> torch.Tensor:  # (N, rows, H*d) -> (N*B*H, rows, d)
            layer = _heads(projected, heads).view(n, 1, heads, *projected.shape[1:2], -1)
            return layer.expand(n, batch, *layer.shape[2:]).reshape(-1, *layer.shape[3:])

        q, k, _ = self.sizes
        if self.share_att_key:
            pos_query_layer = per_row(self._project(rel_embeddings, slice(0, q)))
            pos_key_layer = per_row(self._project(rel_embeddings, slice(q, q + k)))
        else:
            if "c2p" in self.pos_att_type:
                pos_key_layer = per_row(self.pos_key_proj(rel_embeddings))
            if "p2c" in self.pos_att_type:
                pos_query_layer = per_row(self.pos_query_proj(rel_embeddings))

        score = 0
        if "c2p" in self.pos_att_type:  # content -> position
            scale = scaled_size_sqrt(pos_key_layer, scale_factor)
            c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))
            c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1) - first
            index = c2p_pos.squeeze(0).expand([query_layer.size(0), query_layer.size(1), relative_pos.size(-1)])
            score += torch.gather(c2p_att, dim=-1, index=index) / scale.to(dtype=c2p_att.dtype)
        if "p2c" in self.pos_att_type:  # position -> content
            scale = scaled_size_sqrt(pos_query_layer, scale_factor)
            # The source passes these two in this order (to parameters named the other way round): kept.
            r_pos = build_rpos(query_layer, key_layer, relative_pos, self.max_relative_positions,
                               self.position_buckets)
            p2c_pos = torch.clamp(-r_pos + att_span, 0, att_span * 2 - 1) - first
            p2c_att = torch.bmm(key_layer, pos_query_layer.transpose(-1, -2))
            index = p2c_pos.squeeze(0).expand([query_layer.size(0), key_layer.size(-2), key_layer.size(-2)])
            score += torch.gather(p2c_att, dim=-1, index=index).transpose(-1, -2) / scale.to(dtype=p2c_att.dtype)
        return score

    def _rows_reached(self, length: int, att_span: int) -> tuple[int, int]:
        """[first, last): the rows of the (2S, D) table that relative positions between ``length`` tokens index,
        once shifted by S and clamped as the source does. Within the buckets' linear range (or without
        buckets) a distance is its own bucket; past it, the log-spaced buckets are computed on the host, in
        eager mode only: compiled graphs then project the whole table, as the source does. A caller's own
        relative positions beyond the reach fail in ``gather``'s bounds check rather than read wrong rows."""
        reach = length - 1
        if self.position_buckets > 0 and self.max_relative_positions > 0 and reach > self.position_buckets // 2:
            if torch.compiler.is_compiling():
                return 0, 2 * att_span
            reach = _bucketed_reach(length, self.position_buckets, self.max_relative_positions)
        return max(0, att_span - reach), min(2 * att_span, att_span + reach + 1)


register_stacked_read(DebertaV2Encoder, "rel_embeddings.weight", consumers=(DisentangledSelfAttention,))
