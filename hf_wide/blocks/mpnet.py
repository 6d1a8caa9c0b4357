"""WideMPNetAttention: MPNet's self-attention for N members at once.

MPNet's attention is its own code, not transformers' attention interface: the scores get the encoder's relative
position bias (``(N*B, H, T, T)``, each member's from its own table: :mod:`hf_wide.rewrites`) and the additive mask,
then an eager softmax. This block is that code on all N*B rows, with Q, K and V of every member in one matmul; the
ops after the projections are the source's, in its order. In a packed encoder (:mod:`hf_wide.packing`) it projects
the real tokens only and scatters Q, K and V to the padded layout for the scores.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import nn
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

from ..packing import active as packing_of_this_call
from ..primitives.linear import WideLinear, wide_linear
from ..registry import register_block
from .base import WideBlock, fused_parameter, member_slices

QKV = ("q", "k", "v")


@register_block(MPNetSelfAttention)
class WideMPNetAttention(WideBlock):
    """``qkv_weight``: (N, 3*A, D) and ``qkv_bias``: (N, 3*A), each member's q, k and v stacked along the outputs
    (A: all heads' size); ``o``: a WideLinear."""

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        kinds = {name: type(module.get_submodule(name)) for name in (*QKV, "o")}
        if any(kind is not nn.Linear for kind in kinds.values()):  # LoRA members: the model's code around them
            return f"its projections are {sorted({k.__name__ for k in kinds.values()})}: planned by their parts"
        return None

    def build(self, mods: Sequence[nn.Module]) -> None:
        self.qkv_weight = fused_parameter(mods, QKV, "weight")
        self.qkv_bias = fused_parameter(mods, QKV, "bias")
        self.o = WideLinear.from_modules([m.o for m in mods], self.fold)
        self.dropout = copy.deepcopy(mods[0].dropout)

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        state = {}
        for name, weight, bias in zip(QKV, self.qkv_weight[i].chunk(3), self.qkv_bias[i].chunk(3)):
            state[f"{name}.weight"], state[f"{name}.bias"] = weight, bias
        state.update(member_slices("o", self.o, i))
        return state

    def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
        # hidden_states: (N*B, T, D), or (N, K, D) in a packed encoder
        qkv = wide_linear(self.fold, hidden_states, self.qkv_weight.transpose(1, 2), self.qkv_bias)
        packing = packing_of_this_call()
        if packing is not None:
            qkv = packing.unpack(qkv)  # (N*B, T, 3*A), zeros at padded positions
        hidden_shape = (*qkv.shape[:-1], -1, self.attention_head_size)
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in qkv.split(self.all_head_size, dim=-1))
        # q, k, v: (N*B, H, T, d)
        attention_scores = torch.matmul(q, k.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if position_bias is not None:
            attention_scores += position_bias
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = self.dropout(nn.functional.softmax(attention_scores, dim=-1))  # (N*B, H, T, T)
        c = torch.matmul(attention_probs, v).permute(0, 2, 1, 3).contiguous()
        c = c.view(*c.shape[:-2], self.all_head_size)  # (N*B, T, A)
        if packing is not None:
            c = packing.pack(c)  # (N, K, A)
        o = self.o(c)
        return (o, attention_probs) if output_attentions else (o,)
