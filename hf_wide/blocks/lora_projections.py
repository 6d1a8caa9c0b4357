"""LoRA-adapted projections of one input, fused: q, k and v of an attention, gate and up of a gated MLP.

P projections of N members' ``lora.Linear`` layers that read the same input become one base matmul and one
low-rank update:

    y = x @ W.T + b + scale * (x_m @ A_m.T) @ B_m.T        x_m: member m's rows
    W: (D_out, D_in), the P base weights side by side along the outputs (D_out = sum of theirs); b: (D_out,)
    A: (N, P*r, D_in), member m's P lora_A stacked along the rank; B: (N, D_out, P*r), its lora_B block-diagonal
    scale: (N, P), each member's scaling of each projection (on that projection's rank columns of the update)

``r`` is the largest rank; smaller ones are zero-padded, and the off-diagonal blocks of ``B`` are zeros, so the
update is exact. The members' base weights are one tensor where they are equal (adapters of one base) and
stacked ``(N, D_out, D_in)`` where they differ. Fused blocks (:mod:`hf_wide.blocks.attention`,
:mod:`hf_wide.blocks.mlp`) hold one in place of their projection weights: the P modules' base matmuls, low-rank
products and updates become one of each, a third of the kernels, for GPUs, where small batches (decoding) are
bound by kernel launches. On CPU they are declined (``FUSE_ON_CPU``): measured on the 2-core benchmark machine
(8 members of rank 8, hidden 256, B=1, seq 16, six interleaved runs), the fused Llama ran at 1.15x the ideal
and the projections apart at 1.14x, BERT 1.20x and 1.18x. The block-diagonal ``B`` (P times the bytes) costs
what the fewer calls save; updating each projection's columns of the fused output apart was slower still.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..fold import Fold
from ..primitives.base import keeps_storage, kept, same_value
from ..primitives.linear import WideLinear, wide_linear
from .base import member_slices
from .lora import LoraLinear, WideLoraLinear, lora_refusal
from .lora_parts import adapter_dtype, equal_tensors, member_dropout, one_scale


FUSE_ON_CPU = False  # see the module's docstring; tests set it to run the fused path on CPU


def lora_projections_refusal(layers: Sequence[nn.Module], out: nn.Module | None = None,
                             out_name: str = "out") -> str | None:
    """Why one member's ``layers`` (its projections of one input), with ``out`` (the block's output projection
    after them, if any), cannot be fused as LoRA projections, or None."""
    if LoraLinear is None or not all(type(layer) is LoraLinear for layer in layers):
        return "its projections are not all LoRA layers"
    if layers[0].base_layer.weight.device.type == "cpu" and not FUSE_ON_CPU:
        return "on CPU LoRA projections run apart (fused, they are no faster: see hf_wide.blocks.lora_projections)"
    for layer in layers:
        why = lora_refusal(layer) or (None if type(layer.base_layer) is nn.Linear else
                                      f"its base layers are {type(layer.base_layer).__name__}s, not nn.Linear") or (
            "its adapters are DoRA: projections run apart" if layer.lora_variant else None)
        if why is not None:
            return why
    if len({tuple(layer.lora_A) for layer in layers}) != 1:
        return "its projections hold adapters of different names"
    base_dtype, dtype = layers[0].base_layer.weight.dtype, adapter_dtype(layers)
    if dtype != base_dtype:  # PEFT's autocast_adapter_dtype: WideLoraLinear computes each update as PEFT does
        return f"its adapters are {dtype} over a {base_dtype} base: projections run apart, each update in float32"
    if len({layer.base_layer.bias is None for layer in layers}) != 1:
        return "some of its projections have a bias and some do not"
    if out is not None and type(out) is not nn.Linear:
        return WideLoraLinear.refusal(out) if type(out) is LoraLinear else f"{out_name} is a {type(out)}"
    return None


class WideLoraProjections(nn.Module):
    """``weight`` (D_out, D_in) or (N, D_out, D_in), ``bias`` (D_out,) or (N, D_out) or None, ``lora_A``
    (N, P*r, D_in), ``lora_B`` (N, D_out, P*r), ``scaling`` (N, P); ``sizes``: each projection's D_out."""

    def __init__(self, fold: Fold, layers: Sequence[Sequence[nn.Module]]):  # layers[m][j]: member m, projection j
        super().__init__()
        self.fold = fold
        first = layers[0]
        (self.adapter,) = first[0].lora_A.keys()
        self.sizes = [layer.base_layer.out_features for layer in first]
        p, n = len(first), len(layers)
        ranks = [[layer.r[self.adapter] for layer in member] for member in layers]
        r = self.r = max(max(member) for member in ranks)
        bases = [[layer.base_layer for layer in member] for member in layers]
        weight, dtype = first[0].base_layer.weight, first[0].base_layer.weight.dtype
        same_weight = all(all(same_value(b.weight, bases[0][j].weight) for j, b in enumerate(member))
                          for member in bases[1:])
        same_bias = bases[0][0].bias is None or all(all(same_value(b.bias, bases[0][j].bias)
                                                        for j, b in enumerate(member)) for member in bases[1:])
        if same_weight:  # adapters of one base: its one weight serves every member
            w = torch.cat([b.weight.detach() for b in bases[0]])
        else:
            w = torch.stack([torch.cat([b.weight.detach() for b in member]) for member in bases])
        if bases[0][0].bias is None:
            bias = None
        elif same_bias and same_weight:
            bias = torch.cat([b.bias.detach() for b in bases[0]])
        else:  # each member's own (PEFT's bias="all" or "lora_only" trains the base's biases)
            bias = torch.stack([torch.cat([b.bias.detach() for b in member]) for member in bases])
        self.weight = nn.Parameter(w, requires_grad=weight.requires_grad)  # frozen, as PEFT leaves the base
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=bases[0][0].bias.requires_grad)
        a = weight.new_zeros(n, p * r, weight.shape[1])
        b = weight.new_zeros(n, sum(self.sizes), p * r)
        for i, member in enumerate(layers):
            row = 0
            for j, (layer, rank) in enumerate(zip(member, ranks[i])):
                a[i, j * r:j * r + rank] = layer.lora_A[self.adapter].weight.detach()
                b[i, row:row + self.sizes[j], j * r:j * r + rank] = layer.lora_B[self.adapter].weight.detach()
                row += self.sizes[j]
        trainable = first[0].lora_A[self.adapter].weight.requires_grad
        self.lora_A = nn.Parameter(a, requires_grad=trainable)
        self.lora_B = nn.Parameter(b, requires_grad=trainable)
        self.register_buffer("scaling", torch.tensor(
            [[layer.scaling[self.adapter] for layer in member] for member in layers], dtype=dtype, device=weight.device))
        self.register_buffer("rank", torch.tensor(ranks), persistent=False)
        if keeps_storage():  # our own members (adapters loaded here): theirs become views of these, held once
            self._rebind(layers, ranks)
        # PEFT's dropout on each projection's input, before lora_A (nn.Identity where lora_dropout is 0)
        self.lora_dropout = nn.ModuleList([member_dropout([member[j].lora_dropout[self.adapter] for member in layers])
                                           for j in range(p)])
        self._dropping = any(type(d) is not nn.Identity for d in self.lora_dropout)

    def _rebind(self, layers, ranks) -> None:
        """The members' tensors become views of this module's: the base's own storage is freed with its last
        reference (every member's base layer holds the same tensor objects), the adapters' with theirs."""
        for i, member in enumerate(layers):
            for j, (layer, rank, w, bias) in enumerate(zip(member, ranks[i], *self._bases(i))):
                base = layer.base_layer
                base.weight.data = w.detach()  # (.data: the one Parameter object every member's layer holds)
                if bias is not None:
                    base.bias.data = bias.detach()
                layer.lora_A[self.adapter].weight.data = self.lora_A.detach()[i, j * self.r:j * self.r + rank]
                layer.lora_B[self.adapter].weight.data = self._lora_b(i, j, rank).detach()

    def _bases(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        weight = self.weight if self.weight.dim() == 2 else self.weight[i]
        bias = self.bias if self.bias is None or self.bias.dim() == 1 else self.bias[i]
        return list(weight.split(self.sizes)), [None] * len(self.sizes) if bias is None else list(bias.split(self.sizes))

    def _lora_b(self, i: int, j: int, rank: int) -> torch.Tensor:
        start = sum(self.sizes[:j])
        return self.lora_B[i, start:start + self.sizes[j], j * self.r:j * self.r + rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D_in) -> (N*B, ..., D_out)
        n = self.fold.num_members
        if x.shape[0] % n:
            raise RuntimeError(f"Wide LoRA projections got {x.shape[0]} rows, which do not split into {n} members.")
        if self.training and self._dropping:  # each projection's own dropout mask: its own low-rank product
            r = self.r
            low = torch.cat([torch.bmm(self.lora_A[:, j * r:(j + 1) * r], drop(x).reshape(n, -1, x.shape[-1]).mT)
                             for j, drop in enumerate(self.lora_dropout)], dim=1).mT  # (N, M, P*r)
        else:  # x_m @ A_m.T as A_m @ x_m.T, the rank as the GEMM's rows (see WideLoraLinear)
            rows = x.reshape(n, -1, x.shape[-1])  # (N, M, D_in)
            low = torch.bmm(self.lora_A, rows.transpose(1, 2)).transpose(1, 2)  # (N, M, P*r): a view of (N, P*r, M)
        scale = one_scale(self)
        if scale is None:  # scalings differ between members or projections: each on its rank columns
            low = low * self.scaling.repeat_interleave(self.r, dim=1).unsqueeze(1)  # (N, 1, P*r)
            scale = 1.0
        if self.weight.dim() == 2:  # one matmul with the base's one weight: (N*B, ..., D_out)
            if self.bias is None or self.bias.dim() == 1:
                result = F.linear(x, self.weight, self.bias)
            else:  # and each member's own bias
                result = F.linear(x, self.weight)
                result.view(n, -1, result.shape[-1]).add_(self.bias.unsqueeze(1))
        else:
            result = wide_linear(self.fold, x, self.weight.transpose(1, 2), self.bias)
        result.view(n, -1, result.shape[-1]).baddbmm_(low, self.lora_B.transpose(1, 2), alpha=scale)
        return result

    _scale_key: tuple[int, int] | None = None  # see hf_wide.blocks.lora.one_scale
    _scale: float | None = None

    def member_state_dict(self, i: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Member i's tensors under its layers' own names (``names[j]``: projection j's path)."""
        state = {}
        for j, (name, w, bias) in enumerate(zip(names, *self._bases(i))):
            rank = int(self.rank[i, j])
            state[f"{name}.base_layer.weight"] = w
            if bias is not None:
                state[f"{name}.base_layer.bias"] = bias
            state[f"{name}.lora_A.{self.adapter}.weight"] = self.lora_A[i, j * self.r:j * self.r + rank]
            state[f"{name}.lora_B.{self.adapter}.weight"] = self._lora_b(i, j, rank)
        return state

    def extra_repr(self) -> str:
        shared = "shared" if self.weight.dim() == 2 else "stacked"
        return f"num_members={self.fold.num_members}, sizes={self.sizes}, rank={self.r}, base={shared}"


def output_projection(mods: Sequence[nn.Module], fold: Fold) -> nn.Module:
    """The block's projection after the fused ones, for LoRA members: a :class:`WideLoraLinear` where it is
    adapted, else the base's one ``nn.Linear`` where every member's is equal (adapters of one base: held once), else
    a :class:`WideLinear`."""
    if type(mods[0]) is not nn.Linear:
        return WideLoraLinear.from_modules(mods, fold)
    if all(equal_tensors(m, mods[0]) for m in mods[1:]):
        return kept(mods[0])
    return WideLinear.from_modules(mods, fold)


def output_projection_state(prefix: str, module: nn.Module, i: int) -> dict[str, torch.Tensor]:
    """Member i's tensors of an :func:`output_projection` (or a block's own WideLinear), named under ``prefix``."""
    if isinstance(module, WideLoraLinear):
        return {f"{prefix}.{k}": v for k, v in module.member_state_dict(i).items()}
    if type(module) is nn.Linear:  # the one layer every member shares
        return {f"{prefix}.{k}": v for k, v in module._parameters.items() if v is not None}
    return member_slices(prefix, module, i)
