"""The base class of fused (Flux-style) blocks: one wide module in place of a whole sub-structure.

A block replaces a module *and its children* (an attention layer with its q/k/v/o projections, a gated
MLP) and fuses what the primitives would run separately: one matmul for Q, K and V of every member, one
for gate and up. It reimplements its source's forward, so it registers for exact classes only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..fold import Fold
from ..primitives.base import copy_module, meta_copy


class WideBlock(nn.Module):
    """N members' copies of one block, fused. Subclasses implement ``build``, ``member_state_dict`` and
    ``forward``; plain attributes of the source module (``config``, ``is_causal``, ``scaling``, ...) are
    copied over, since transformers' attention functions read them from the module they are given."""

    source_classes: tuple[type[nn.Module], ...] = ()
    # Blocks whose source modules this block may find inside its own and build itself (LoRA layers as its
    # projections): :func:`hf_wide.structure.block_structure_known` lets exactly these through.
    inner_blocks: tuple[type["WideBlock"], ...] = ()
    own_modules: tuple[type[nn.Module], ...] = ()  # modules inside whose tensors it reads itself (PEFT's ParameterDict)
    # Whether the block holds a tensor every member has equal as the source's module holds it (a LoRA layer's base,
    # :func:`~hf_wide.primitives.base.kept`), so that modules outside it may read it too (tied weights, retied)
    keeps_shared_tensors: bool = False
    # Whether its call takes a tensor per member stacked (N, ...), which is not the members' rows: verification then
    # records its members' outputs rather than calling them on the wide forward's inputs (hf_wide.verify_here)
    takes_stacked_inputs: bool = False

    def __init__(self, fold: Fold, proto: nn.Module):
        super().__init__()
        for name, value in vars(proto).items():
            if not name.startswith("_") and name != "training" and not isinstance(value, (nn.Module, torch.Tensor)):
                setattr(self, name, value)
        self.fold = fold
        object.__setattr__(self, "proto", proto)  # the source on the meta device; not a child

    @property
    def num_members(self) -> int:
        return self.fold.num_members

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return True

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        """Why the block cannot take this instance (None if it can): what the plan says."""
        return None if cls.accepts(module) else f"{cls.__name__} declines this configuration"

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module], fold: Fold) -> "WideBlock":
        if len(mods) != fold.num_members:
            raise ValueError(f"{cls.__name__} needs {fold.num_members} modules, got {len(mods)}.")
        block = cls(fold, meta_copy(mods[0]))
        block.build(mods)
        return block

    def build(self, mods: Sequence[nn.Module]) -> None:
        raise NotImplementedError

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        """Member i's tensors under the source module's own names."""
        raise NotImplementedError

    def to_module(self, i: int, share: bool = False) -> nn.Module:
        """Member i as an ordinary module of the source class, with storage of its own (or, with
        ``share=True``, tensors that are views into the block's)."""
        protos = self.__dict__.get("protos")  # each member's own, where shapes differ (LoRA ranks)
        mod = copy_module(self.proto if protos is None else protos[i])
        state = {k: v.detach() if share else v.detach().clone() for k, v in self.member_state_dict(i).items()}
        mod.load_state_dict(state, strict=True, assign=True)  # keeps the source's requires_grad
        return mod

    def to_modules(self) -> list[nn.Module]:
        return [self.to_module(i) for i in range(self.num_members)]

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, source={type(self.proto).__name__}"


def member_slices(prefix: str, module: nn.Module, i: int) -> dict[str, torch.Tensor]:
    """Member i's views of a wide primitive's tensors, named as in the source block's state dict."""
    buffers = {k: v for k, v in module._buffers.items() if k not in module._non_persistent_buffers_set}
    tensors = {**module._parameters, **buffers}  # not the helpers a primitive derives (a norm's unit affine)
    return {f"{prefix}.{name}": t[i] for name, t in tensors.items() if t is not None}


def fused_parameter(mods: Sequence[nn.Module], names: Sequence[str], attr: str) -> nn.Parameter | None:
    """:func:`stack_cat` as a parameter that trains as its sources do (alike in every member and name: the planner
    refuses a block over parameters some of which are frozen, :func:`~hf_wide.structure.partly_frozen`)."""
    value = stack_cat(mods, names, attr)
    source = getattr(mods[0].get_submodule(names[0]), attr)
    return None if value is None else nn.Parameter(value, requires_grad=source.requires_grad)


def stack_cat(mods: Sequence[nn.Module], names: Sequence[str], attr: str) -> torch.Tensor | None:
    """For each member, concatenate ``getattr(sub, attr)`` of its submodules ``names`` along dim 0, then
    stack the members: N x (sum of D_out_j, ...) -> (N, sum D_out_j, ...). None if the first is None."""
    first = getattr(mods[0].get_submodule(names[0]), attr)
    if first is None:
        return None
    return torch.stack([torch.cat([getattr(m.get_submodule(n), attr).detach() for n in names]) for m in mods])
