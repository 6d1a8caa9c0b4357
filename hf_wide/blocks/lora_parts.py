"""What the wide LoRA layers share (:mod:`hf_wide.blocks.lora`, :mod:`hf_wide.blocks.lora_projections`,
:mod:`hf_wide.blocks.lora_embedding`): the members' dropouts as one module, the adapters' one dtype and one scale,
and whether two base layers hold the same tensors."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ..primitives.base import same_value


class MemberDropout(nn.Module):
    """Each member's own dropout on its rows (``lora_dropout`` differs between members: a sweep over it, say).
    In eval every dropout is the identity, and so is this."""

    def __init__(self, dropouts: Sequence[nn.Module]):
        super().__init__()
        self.dropouts = nn.ModuleList(copy.deepcopy(d) for d in dropouts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D), member-major rows
        if not self.training:
            return x
        return torch.cat([drop(rows) for drop, rows in zip(self.dropouts, x.chunk(len(self.dropouts)))])


def member_dropout(dropouts: Sequence[nn.Module]) -> nn.Module:
    """The members' LoRA dropouts as one module: a copy of theirs where they are alike, else :class:`MemberDropout`."""
    first = dropouts[0]
    if all(type(d) is type(first) and getattr(d, "p", None) == getattr(first, "p", None) for d in dropouts):
        return copy.deepcopy(first)
    return MemberDropout(dropouts)


def adapter_dtype(mods: Sequence[nn.Module]) -> torch.dtype | None:
    """The dtype every member's adapter weights have (float32 over a half-precision base, where PEFT upcasts
    them: ``autocast_adapter_dtype``), or None where they differ."""
    dtypes = {w.dtype for m in mods for d in (m.lora_A, m.lora_B) for w in (d[k].weight for k in d)}
    return dtypes.pop() if len(dtypes) == 1 else None


def one_scale(module: nn.Module) -> float | None:
    """The one value of ``module.scaling`` (every member's, every projection's), for baddbmm's ``alpha``; None
    where they differ, or under torch.compile (a traced graph reads the buffer). Kept in ``module._scale`` until the
    buffer changes (a state dict loaded into it, say), as its (data pointer, version) in ``module._scale_key``."""
    if torch.compiler.is_compiling():
        return None
    scaling = module.scaling
    key = (scaling.data_ptr(), scaling._version)
    if module._scale_key != key:
        values = set(scaling.flatten().tolist())
        module._scale = values.pop() if len(values) == 1 else None
        module._scale_key = key  # last: a thread that reads the new key finds the new scale (writes are atomic)
    return module._scale


def equal_tensors(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold the same parameters: the very tensors, or equal ones."""
    ta, tb = dict(a.named_parameters()), dict(b.named_parameters())
    return ta.keys() == tb.keys() and all(same_value(ta[k], tb[k]) for k in ta)
