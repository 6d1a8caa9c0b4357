"""The per-member fallback: run each member's own module on its slice of the rows.

Always correct, slower than a wide primitive, and reported by the plan. Used for modules no builder
covers: raw ``nn.Parameter``s read in a forward that no block knows, a module that mixes batch rows, or
a weight used outside its own module by code that expects one member's (DeBERTa's relative embeddings,
when one of the attention blocks they feed is not fused).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..fold import Fold


class PerMemberFallback(nn.Module):
    """N copies of one module; member m runs on rows ``[m*B, (m+1)*B)`` and the outputs are concatenated."""

    def __init__(self, mods: Sequence[nn.Module], fold: Fold):
        super().__init__()
        self.fold = fold
        self.members = nn.ModuleList(mods)

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module], fold: Fold) -> "PerMemberFallback":
        return cls(mods, fold)

    def to_module(self, i: int, share: bool = False) -> nn.Module:
        return self.members[i] if share else copy.deepcopy(self.members[i])

    def to_modules(self) -> list[nn.Module]:
        return list(self.members)

    @property
    def num_members(self) -> int:
        return self.fold.num_members

    def __getattr__(self, name: str):
        # Model code reads attributes of its submodules (ViT checks
        # ``embeddings.patch_embeddings.projection.weight.dtype``): members share an architecture, so
        # member 0 answers for all.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["members"][0], name)

    def forward(self, *args, **kwargs):
        n = self.num_members
        rows = self.fold.rows
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if rows is None:  # called outside a wide forward: take the rows from the first batched input
            rows = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), n)
        batch = rows // n

        def member_slice(t, m):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows:
                return t[m * batch : (m + 1) * batch]  # (B, ...)
            return t  # broadcast (1, ...) inputs, scalars and non-tensors are the same for every member

        outputs = []
        for m, module in enumerate(self.members):
            m_args, m_kwargs = pytree.tree_unflatten([member_slice(t, m) for t in leaves], spec)
            outputs.append(module(*m_args, **m_kwargs))
        return _concat_members(outputs, batch)


def _concat_members(outputs: list, batch: int):
    """Concatenate N members' outputs along the rows, expanding broadcast (1, ...) outputs to B rows."""
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = []
    for parts in zip(*(leaves for leaves, _ in flat)):
        first = parts[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            if first.shape[0] == 1 and batch != 1:  # a broadcast output, e.g. (1, T, D)
                parts = [p.expand(batch, *p.shape[1:]) for p in parts]
            elif first.shape[0] != batch:
                raise RuntimeError(
                    f"A per-member module returned a tensor of shape {tuple(first.shape)} for {batch} rows: "
                    "its output has no batch dim, so the members' outputs cannot be folded."
                )
            merged.append(torch.cat(parts, dim=0))  # (N*B, ...)
        else:
            merged.append(first)
    return pytree.tree_unflatten(merged, spec)
