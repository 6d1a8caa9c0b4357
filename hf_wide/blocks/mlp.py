"""WideMLP: gated MLPs with gate and up fused into one matmul for every member, and plain two-layer MLPs.

Gated (Llama, Mistral, Qwen2): ``down(act(gate(x)) * up(x))`` becomes one matmul with the members' gate
and up weights side by side, ``act(g) * u``, and one matmul for down. Plain (ViT): ``fc2(act(fc1(x)))``
with both matmuls called directly, without a module call per projection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mistral.modeling_mistral import MistralMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
from transformers.models.vit.modeling_vit import ViTMLP

from ..primitives.base import meta_copies
from ..primitives.linear import WideLinear, wide_linear
from ..registry import register_block
from .base import WideBlock, fused_parameter, member_slices
from .lora import WideLoraLinear
from .lora_projections import (
    WideLoraProjections,
    lora_projections_refusal,
    output_projection,
    output_projection_state,
)


@register_block(LlamaMLP, MistralMLP, Qwen2MLP)
class WideGatedMLP(WideBlock):
    """``gate_up_weight``: (N, 2*I, D), gate rows then up rows; ``gate_up_bias``: (N, 2*I) or None;
    ``down_proj``: a WideLinear. LoRA members (gate and up ``lora.Linear`` layers) hold ``lora_gate_up``, a
    :class:`WideLoraProjections`, instead of the two, and an :func:`output_projection` ``down_proj`` (a
    :class:`WideLoraLinear` where it is adapted too)."""

    inner_blocks = (WideLoraLinear,)  # LoRA-adapted projections: fused as such (see hf_wide.blocks.lora_projections)

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        gate_up = [module.gate_proj, module.up_proj]
        if any(type(p) is not nn.Linear for p in gate_up):  # adapted gate and up: both, one base each
            why = lora_projections_refusal(gate_up, module.down_proj, "down_proj")
            return None if why is None else f"gate_proj, up_proj: {why}"
        if type(module.down_proj) is not nn.Linear:  # the only lora.Linear: the block would not build it
            return f"down_proj is a {type(module.down_proj).__qualname__} but gate and up are not adapted"
        if (module.gate_proj.bias is None) != (module.up_proj.bias is None):
            return "one of gate_proj and up_proj has a bias: no one fused bias"
        return None

    def build(self, mods: Sequence[nn.Module]) -> None:
        self.intermediate = mods[0].gate_proj.out_features
        if type(mods[0].gate_proj) is nn.Linear:
            self.gate_up_weight = fused_parameter(mods, ("gate_proj", "up_proj"), "weight")
            self.gate_up_bias = fused_parameter(mods, ("gate_proj", "up_proj"), "bias")
        else:  # LoRA members: the base's gate and up in one matmul, the members' updates in one more
            self.lora_gate_up = WideLoraProjections(self.fold, [[m.gate_proj, m.up_proj] for m in mods])
            object.__setattr__(self, "protos", meta_copies(mods, self.proto))  # each member's ranks
        downs = [m.down_proj for m in mods]
        lora = "lora_gate_up" in self._modules
        self.down_proj = output_projection(downs, self.fold) if lora else WideLinear.from_modules(downs, self.fold)
        self.act_fn = mods[0].act_fn

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        state = output_projection_state("down_proj", self.down_proj, i)
        if "lora_gate_up" in self._modules:
            return {**self.lora_gate_up.member_state_dict(i, ("gate_proj", "up_proj")), **state}
        gate_w, up_w = self.gate_up_weight[i].split(self.intermediate)
        state.update({"gate_proj.weight": gate_w, "up_proj.weight": up_w})
        if self.gate_up_bias is not None:
            state["gate_proj.bias"], state["up_proj.bias"] = self.gate_up_bias[i].split(self.intermediate)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, T, D)
        if "lora_gate_up" in self._modules:
            gate_up = self.lora_gate_up(x)  # (N*B, T, 2I)
        else:
            gate_up = wide_linear(self.fold, x, self.gate_up_weight.transpose(1, 2), self.gate_up_bias)  # (N*B, T, 2I)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


@register_block(ViTMLP)
class WidePlainMLP(WideBlock):
    """``fc1``, ``fc2``: WideLinears; the activation in between, as in the source."""

    ACTIVATION = {ViTMLP: "activation_fn"}

    def build(self, mods: Sequence[nn.Module]) -> None:
        self.fc1 = WideLinear.from_modules([m.fc1 for m in mods], self.fold)
        self.fc2 = WideLinear.from_modules([m.fc2 for m in mods], self.fold)
        self.act = getattr(mods[0], self.ACTIVATION[type(mods[0])])

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        return {**member_slices("fc1", self.fc1, i), **member_slices("fc2", self.fc2, i)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, T, D)
        h = wide_linear(self.fold, x, self.fc1.weight.transpose(1, 2), self.fc1.bias)  # (N*B, T, I)
        return wide_linear(self.fold, self.act(h), self.fc2.weight.transpose(1, 2), self.fc2.bias)
