"""WideAttention: Q, K and V of every member in one matmul, then one attention call over all N*B rows.

Covers the attention modules whose forward is "project q/k/v, (rotary), (cache), attention interface,
(output projection)": BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA (``query/key/value``, output projection in the
next module),
Llama, Mistral, Qwen2 (``q_proj/k_proj/v_proj/o_proj``, rotary, grouped KV heads), ViT, DistilBERT
(``q_lin/k_lin/v_lin/out_lin``) and ALBERT (output projection, dropout and residual layer norm inside).
The attention itself goes through transformers' attention interface (sdpa, eager, ...) exactly as the
source does.
GPT-2 (``c_attn``) and Phi-3 (``qkv_proj``) already fuse their projections, so their primitives suffice.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Sequence

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.albert.modeling_albert import AlbertAttention
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.camembert.modeling_camembert import CamembertSelfAttention
from transformers.models.distilbert.modeling_distilbert import DistilBertSelfAttention
from transformers.models.electra.modeling_electra import ElectraSelfAttention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.roberta.modeling_roberta import RobertaSelfAttention
from transformers.models.vit.modeling_vit import ViTAttention
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaSelfAttention

from ..packing import active as packing_of_this_call
from ..packing import keys_from
from ..primitives.base import meta_copies
from ..primitives.linear import WideLinear, wide_linear
from ..primitives.norm import WideLayerNorm
from ..registry import register_block
from ..versions import pop_cache
from .base import WideBlock, fused_parameter, member_slices
from .lora import WideLoraLinear
from .lora_projections import (
    WideLoraProjections,
    lora_projections_refusal,
    output_projection,
    output_projection_state,
)


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """Where a family keeps its projections and how its forward is called."""

    qkv: tuple[str, str, str]
    out: str | None  # output projection inside the module (None: BERT keeps it in BertSelfOutput)
    head_dim: str  # attribute holding the head size
    dropout: str  # attribute holding the attention dropout probability ("dropout.p" for BERT)
    arg_names: tuple[str, ...]  # positional order of the source forward's arguments
    rotary: bool = False
    residual_norm: tuple[str, str] | None = None  # (dropout, norm): ALBERT's norm(x + dropout(out)) inside


BERT = AttentionLayout(("query", "key", "value"), None, "attention_head_size", "dropout.p",
                       ("hidden_states", "attention_mask", "cache"))
LLAMA = AttentionLayout(("q_proj", "k_proj", "v_proj"), "o_proj", "head_dim", "attention_dropout",
                        ("hidden_states", "position_embeddings", "attention_mask", "cache"), rotary=True)
VIT = AttentionLayout(("q_proj", "k_proj", "v_proj"), "o_proj", "head_dim", "attention_dropout",
                      ("hidden_states", "attention_mask"))
DISTILBERT = AttentionLayout(("q_lin", "k_lin", "v_lin"), "out_lin", "attention_head_size", "dropout.p",
                             ("hidden_states", "attention_mask"))
ALBERT = AttentionLayout(("query", "key", "value"), "dense", "attention_head_size", "attention_dropout.p",
                         ("hidden_states", "attention_mask"), residual_norm=("output_dropout", "LayerNorm"))
LAYOUTS = {
    BertSelfAttention: BERT, RobertaSelfAttention: BERT, ElectraSelfAttention: BERT,
    XLMRobertaSelfAttention: BERT, CamembertSelfAttention: BERT,  # RoBERTa's code under other names (5.23-5.24)
    LlamaAttention: LLAMA, MistralAttention: LLAMA, Qwen2Attention: LLAMA,
    ViTAttention: VIT, DistilBertSelfAttention: DISTILBERT, AlbertAttention: ALBERT,
}


@register_block(*LAYOUTS)
class WideAttention(WideBlock):
    """``qkv_weight``: (N, D_q + 2*D_kv, D) — each member's q, k and v weights stacked along the outputs;
    ``qkv_bias``: (N, D_q + 2*D_kv) or None; ``o_proj``: a WideLinear (or absent). LoRA members (q, k and v
    ``lora.Linear`` layers) hold ``lora_qkv``, a :class:`WideLoraProjections`, instead of the two, and their
    ``o_proj`` is an :func:`output_projection` (a :class:`WideLoraLinear` where it is adapted too)."""

    inner_blocks = (WideLoraLinear,)  # LoRA-adapted projections: fused as such (see hf_wide.blocks.lora_projections)

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        layout = LAYOUTS[type(module)]
        projections = [module.get_submodule(n) for n in layout.qkv]
        out = None if layout.out is None else module.get_submodule(layout.out)
        if any(type(p) is not nn.Linear for p in projections):  # adapted q, k and v: all of them, one base each
            why = lora_projections_refusal(projections, out, layout.out)
            return None if why is None else f"{layout.qkv}: {why}"
        if out is not None and type(out) is not nn.Linear:  # the only lora.Linear: the block would not build it
            return f"{layout.out} is a {type(out).__qualname__} but q, k and v are not adapted: planned by its parts"
        with_bias = [p.bias is not None for p in projections]
        if not (all(with_bias) or not any(with_bias)):
            return "some of q, k and v have a bias and some do not: no one fused bias"
        return None

    def build(self, mods: Sequence[nn.Module]) -> None:
        layout = self.layout = LAYOUTS[type(mods[0])]
        source = sys.modules[type(mods[0]).__module__]  # the family's own eager attention and rotary code
        self._eager = source.eager_attention_forward
        self._rotary = source.apply_rotary_pos_emb if layout.rotary else None
        self.sizes = [mods[0].get_submodule(n).out_features for n in layout.qkv]
        projections = [[m.get_submodule(n) for n in layout.qkv] for m in mods]
        if type(projections[0][0]) is nn.Linear:
            self.qkv_weight = fused_parameter(mods, layout.qkv, "weight")
            self.qkv_bias = fused_parameter(mods, layout.qkv, "bias")
        else:  # LoRA members: the base's q, k and v in one matmul, the members' updates in one more
            self.lora_qkv = WideLoraProjections(self.fold, projections)
            object.__setattr__(self, "protos", meta_copies(mods, self.proto))  # each member's ranks
        if layout.out is not None:
            outs = [m.get_submodule(layout.out) for m in mods]
            lora = "lora_qkv" in self._modules
            self.o_proj = output_projection(outs, self.fold) if lora else WideLinear.from_modules(outs, self.fold)
        if layout.residual_norm is not None:
            dropout, norm = layout.residual_norm
            self.out_dropout = copy.deepcopy(getattr(mods[0], dropout))
            self.post_norm = WideLayerNorm.from_modules([getattr(m, norm) for m in mods], self.fold)
        self._head_dim = getattr(mods[0], layout.head_dim)
        # The attention's dropout as the members hold it: a float (Llama's), or an nn.Dropout whose p their forward
        # reads (BERT's dropout.p), held here as such, so that what sets every nn.Dropout's p after fusion (TRL's
        # disable_dropout_in_model) sets this one's too: copied as a float, it stayed on
        owner, _, attr = layout.dropout.rpartition(".")
        if owner:
            setattr(self, owner, copy.deepcopy(mods[0].get_submodule(owner)))
        else:
            self._dropout_p = getattr(mods[0], attr)

    def _attention_dropout(self) -> float:
        owner, _, attr = self.layout.dropout.rpartition(".")
        return getattr(getattr(self, owner), attr) if owner else self._dropout_p

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        if "lora_qkv" in self._modules:
            state = self.lora_qkv.member_state_dict(i, self.layout.qkv)
        else:
            state = {}
            for name, weight in zip(self.layout.qkv, self.qkv_weight[i].split(self.sizes)):
                state[f"{name}.weight"] = weight
            if self.qkv_bias is not None:
                for name, bias in zip(self.layout.qkv, self.qkv_bias[i].split(self.sizes)):
                    state[f"{name}.bias"] = bias
        if self.layout.out is not None:
            state.update(output_projection_state(self.layout.out, self.o_proj, i))
        if self.layout.residual_norm is not None:
            state.update(member_slices(self.layout.residual_norm[1], self.post_norm, i))
        return state

    def forward(self, *args, **kwargs):
        kwargs.update(zip(self.layout.arg_names, args))
        hidden_states = kwargs.pop("hidden_states")  # (N*B, T, D), or (N, K, D) in a packed encoder
        attention_mask = kwargs.pop("attention_mask", None)
        position_embeddings = kwargs.pop("position_embeddings", None)
        cache = pop_cache(kwargs)  # transformers 5.24 calls it cache, earlier releases past_key_values

        packing = packing_of_this_call()  # hf_wide.packing: the states are the batch's real tokens only
        if packing is not None and (cache is not None or self._rotary is not None):
            raise RuntimeError("A packed encoder reached an attention with a cache or rotary positions.")
        every_token = None if packing is None else keys_from()  # an encoder's last layer, at first tokens only
        if every_token is not None:
            query, kv = self._first_token_projections(hidden_states, every_token, packing)
            # query: (N*B, 1, D_q), each row's first token; kv: (N*B, T, 2*D_kv)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
                attention_mask = attention_mask[..., :1, :]  # (.., 1, T): the first token's row
            query = query.view(*query.shape[:-1], -1, self._head_dim).transpose(1, 2)
            key, value = (t.view(*kv.shape[:-1], -1, self._head_dim).transpose(1, 2)
                          for t in kv.split(self.sizes[1:], dim=-1))
            input_shape = query.shape[:1] + query.shape[2:3]
        else:
            qkv = self._projections(hidden_states)  # (N*B, T, D_q + 2*D_kv), or (N, K, ...) packed
            if packing is not None:
                qkv = packing.unpack(qkv)  # (N*B, T, D_q + 2*D_kv), zeros at padded positions
            input_shape = qkv.shape[:-1]
            hidden_shape = (*input_shape, -1, self._head_dim)
            query, key, value = (t.view(hidden_shape).transpose(1, 2) for t in qkv.split(self.sizes, dim=-1))
        # query: (N*B, H, T, hd) (T = 1 at first tokens only); key, value: (N*B, H_kv, T, hd)

        if self._rotary is not None:
            cos, sin = position_embeddings
            query, key = self._rotary(query, key, cos, sin)
        if cache is not None:
            if isinstance(cache, EncoderDecoderCache):
                cache = cache.self_attention_cache
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)

        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager)
        if getattr(self, "sliding_window", None) is not None:  # Qwen2: per layer
            kwargs["sliding_window"] = self.sliding_window
        elif type(self.proto) is MistralAttention:
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
        attn_output, attn_weights = interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self._attention_dropout(), scaling=self.scaling, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (N*B, T, H*hd)
        if every_token is not None:
            attn_output = attn_output.view(hidden_states.shape[:-1] + attn_output.shape[-1:])  # (N, B, H*hd)
        elif packing is not None:
            attn_output = packing.pack(attn_output)  # (N, K, H*hd)
        if self.layout.out is not None:
            attn_output = self.o_proj(attn_output)
        if self.layout.residual_norm is not None:  # ALBERT: norm(x + dropout(out)) inside the attention
            attn_output = self.post_norm(hidden_states + self.out_dropout(attn_output))
        return attn_output, attn_weights

    def _projections(self, x: torch.Tensor) -> torch.Tensor:  # (N*B, T, D) -> (N*B, T, D_q + 2*D_kv)
        if "lora_qkv" in self._modules:
            return self.lora_qkv(x)
        return wide_linear(self.fold, x, self.qkv_weight.transpose(1, 2), self.qkv_bias)

    def _first_token_projections(self, firsts: torch.Tensor, every_token: torch.Tensor, packing
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries of each row's first token, ``(N*B, 1, D_q)``, and the keys and values of every token, padded
        ``(N*B, T, 2*D_kv)``, from ``firsts`` (N, B, D) and ``every_token`` (N, K, D): the packed states."""
        d_q = self.sizes[0]
        if "lora_qkv" in self._modules:  # one fused LoRA update: q of every token too, and its first tokens taken
            qkv = packing.unpack(self.lora_qkv(every_token))  # (N*B, T, D_q + 2*D_kv)
            return qkv[:, :1, :d_q], qkv[..., d_q:]
        weight, bias = self.qkv_weight.transpose(1, 2), self.qkv_bias  # (N, D, D_q + 2*D_kv), (N, D_q + 2*D_kv)
        query = wide_linear(self.fold, firsts, weight[..., :d_q], None if bias is None else bias[:, :d_q])
        kv = wide_linear(self.fold, every_token, weight[..., d_q:], None if bias is None else bias[:, d_q:])
        return query.reshape(-1, 1, d_q), packing.unpack(kv)
