"""The per-member fallback: run each member's own module on its slice of the rows.

Always correct, slower than a wide primitive, and reported by the plan. Used for modules no builder
covers: raw ``nn.Parameter``s read in a forward that no block knows, a module that mixes batch rows, or
a weight used outside its own module by code that expects one member's (DeBERTa's relative embeddings,
when one of the attention blocks they feed is not fused).

A fallen-back module that is handed the model's cache gets its member's rows of it
(:mod:`~hf_wide.primitives.member_cache`): the members must not each append their B rows to the one cache of
N*B, nor read each other's state.

Some modules take token rows, not batch rows: a mixture of experts flattens its input to (N*B*T, D)
before its router and experts see it. For those classes (:func:`takes_token_rows`) every tensor whose leading dim
splits into N blocks is split so, member-major, and the outputs are concatenated whatever their rows.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from transformers.cache_utils import Cache

from ..fold import Fold, enter_member_code, leave_member_code
from ..registry import transformers_classes
from . import member_cache
from .base import copy_module
from .roles import rows_and_batched

# MoE routers and experts: called on (N*B*T, D) tokens, member-major, with (N*B*T, k) expert choices.
TOKEN_ROWS = tuple(transformers_classes(*(f"{family}.{prefix}{part}" for family, prefix in [
    ("mixtral", "Mixtral"), ("olmoe", "Olmoe"), ("qwen2_moe", "Qwen2Moe"), ("qwen3_moe", "Qwen3Moe")
] for part in ("TopKRouter", "Experts"))))


def token_rows(module: nn.Module) -> bool:
    """Whether ``module`` is called on token rows (:func:`takes_token_rows`), a PEFT layer around one too (a LoRA on
    Mixtral's router, or on its experts' parameters: loops of them split batch rows, and failed unverified)."""
    base = module.get_base_layer() if callable(getattr(module, "get_base_layer", None)) else module
    return takes_token_rows(type(base))


@functools.cache  # asked on every call of a loop
def takes_token_rows(module_class: type) -> bool:
    """Whether ``module_class`` is called on token rows: the classes in :data:`TOKEN_ROWS`, every experts class that
    dispatches to transformers' experts implementations (``use_experts_implementation``: grouped_mm, batched_mm, ...)
    and the routers beside them (a class named ``*Router*`` in the same modeling file). Vectorised as if they took
    batch rows, a router routed every member's tokens for every member, and the experts' gather then indexed past
    its member's tokens: an IndexError on the CPU, which verification caught, but a device-side assert on CUDA,
    which loses the device (Jamba and Qwen3-Next on an H100)."""
    if module_class in TOKEN_ROWS or _dispatches_to_experts(module_class):
        return True
    if "router" not in module_class.__name__.lower():
        return False
    module = sys.modules.get(module_class.__module__)
    return any(isinstance(c, type) and _dispatches_to_experts(c) for c in vars(module).values()) if module else False


def _dispatches_to_experts(module_class: type) -> bool:
    code = getattr(getattr(module_class, "forward", None), "__code__", None)
    return code is not None and code.co_filename == _EXPERTS_DISPATCH


try:
    from transformers.integrations import moe as _moe

    _EXPERTS_DISPATCH = _moe.__file__  # the file whose ``forward`` wraps a decorated experts class's own
except ImportError:  # a transformers without experts implementations
    _EXPERTS_DISPATCH = None


class PerMemberFallback(nn.Module):
    """N copies of one module; member m runs on rows ``[m*B, (m+1)*B)`` and the outputs are concatenated."""

    expands_broadcasts = True  # False where it is the whole model: its outputs go to the caller as they are

    def __init__(self, mods: Sequence[nn.Module], fold: Fold):
        super().__init__()
        self.fold = fold
        self.members = nn.ModuleList(mods)
        self.token_rows = token_rows(mods[0])

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module], fold: Fold) -> "PerMemberFallback":
        return cls(mods, fold)

    def to_module(self, i: int, share: bool = False) -> nn.Module:
        """Member i's module: a copy, or (``share=True``) a copy of its structure holding the same tensors, so
        that re-tying the copy's weights leaves the fallback's own module as it is."""
        member = self.members[i]
        if not share:
            return copy_module(member)
        tensors = {id(t): t for t in (*member.parameters(), *member.buffers())}
        return copy_module(member, tensors)

    def to_modules(self) -> list[nn.Module]:
        return list(self.members)

    @property
    def num_members(self) -> int:
        return self.fold.num_members

    def __getattr__(self, name: str):
        # Model code reads attributes of its submodules (ViT checks
        # ``embeddings.patch_embeddings.projection.weight.dtype``): members share an architecture, so
        # member 0 answers for all. A submodule answers as a fallback of its own over every member's, so
        # that calling it (XMOD calls ``self.output.LayerNorm``) runs each member's on its rows; the
        # planner moves a fallback up to such callers where the trace sees them.
        try:
            return super().__getattr__(name)
        except AttributeError:
            members = self._modules["members"]
            value = getattr(members[0], name)
            if is_own_method(value, members[0]):  # PEFT's ``generate`` on its model: every member's, on its rows
                return per_member_method(self.fold, [getattr(m, name) for m in members], self.token_rows)
            if not isinstance(value, nn.Module):
                return value
            views = self.__dict__.setdefault("_submodule_views", {})  # not children: no second state dict
            if name not in views:
                views[name] = PerMemberFallback([getattr(m, name) for m in members], self.fold)
            return views[name]

    @property
    def input_roles(self) -> dict[str, list[bool | None]]:
        """Which of its inputs carry the folded rows, per structure of its inputs: see
        :mod:`~hf_wide.primitives.roles` (the trace's, then what its calls taught it)."""
        return self.__dict__.setdefault("_roles", {})

    def forward(self, *args, **kwargs):
        return run_per_member(self.fold, list(self.members), self.token_rows, args, kwargs, self.expands_broadcasts,
                              self.input_roles)


def is_own_method(value, module: nn.Module) -> bool:
    """Whether ``value`` is a method bound to ``module`` or to a module inside it (PEFT's tuner hands on its
    model's ``generate``), and not one of ``nn.Module``'s, which a fallback has itself: called on a fallback, it
    must run every member's."""
    return isinstance(value, types.MethodType) and any(value.__self__ is m for m in module.modules())


def per_member_method(fold: Fold, methods: Sequence, token_rows: bool):
    """A method of the members' modules called on the fallback: member m's on member m's rows, outputs
    concatenated, as the forward is. Member 0's alone would give every member member 0's result."""
    return functools.partial(_call_per_member, fold, list(methods), token_rows)


def _call_per_member(fold: Fold, methods: list, token_rows: bool, *args, **kwargs):
    return run_per_member(fold, methods, token_rows, args, kwargs)


def run_per_member(fold: Fold, members: Sequence, token_rows: bool, args: tuple, kwargs: dict, expand: bool = True,
                   roles: dict | None = None):
    """Call ``members[m]`` (a module, or any callable of member m's inputs) on member m's rows of the inputs,
    for every m, and concatenate the outputs member-major. With ``token_rows``, inputs split into N blocks of
    token rows instead of batch rows (a mixture of experts). ``expand``: see :func:`_concat_members`. ``roles``:
    the fallback's roles of its inputs (:mod:`~hf_wide.primitives.roles`), which say which inputs carry the rows
    and which, a table or a mask of as many rows by chance, do not; this call adds to them."""
    n = fold.num_members
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if token_rows or roles is None:
        rows = fold.rows
        if rows is None:  # called outside a wide forward: take the rows from the first batched input
            rows = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), n)
        batched = [isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows for t in leaves]
    else:
        rows, batched = rows_and_batched(roles, fold.rows, n, leaves, spec)
    batch = rows // n

    def member_slice(t, m, carries_rows):
        if carries_rows and not isinstance(t, torch.Tensor):
            return t // n  # a size of the N*B rows (roles.is_rows_size): this member's B
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if carries_rows:
            return t[m * batch : (m + 1) * batch]  # (B, ...)
        if token_rows and t.shape[0] % n == 0:
            block = t.shape[0] // n
            return t[m * block : (m + 1) * block]  # (B*T, ...): member m's tokens
        return t  # broadcast (1, ...) inputs, tables, scalars and non-tensors are the same for every member

    caches = {id(t): t for t in leaves if member_cache.is_cache(t)}
    views = {key: member_cache.split(cache, n, batch) for key, cache in caches.items()}  # each member's rows
    outputs = []
    outer = enter_member_code()  # a loss a member computes in it is its own (hf_wide.losses)
    try:
        for m, module in enumerate(members):
            # (ids read only where there are caches: compiled, an input's id() is a guard that its next call fails)
            member_leaves = [views[id(t)][m] if views and id(t) in views else member_slice(t, m, carries)
                             for t, carries in zip(leaves, batched)]
            m_args, m_kwargs = pytree.tree_unflatten(member_leaves, spec)
            outputs.append(module(*m_args, **m_kwargs))
    finally:
        leave_member_code(outer)
    for key, cache in caches.items():
        member_cache.merge(cache, views[key])
    if views:  # an output that hands a member's view back (a decoder's past_key_values) is the cache itself
        originals = {id(view): caches[key] for key, member_views in views.items() for view in member_views}
        outputs = [pytree.tree_map(lambda t: originals.get(id(t), t), out) for out in outputs]
    if token_rows:
        return pytree.tree_map(lambda *parts: torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0],
                               *outputs)
    return _concat_members(outputs, batch, expand)


def _concat_members(outputs: list, batch: int, expand: bool = True):
    """Concatenate N members' outputs along the rows, expanding broadcast (1, ...) outputs to B rows (for the
    model's code around the module; not where the module is the whole model, whose outputs go to the caller)."""
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = []
    for parts in zip(*(leaves for leaves, _ in flat)):
        first = parts[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            if first.shape[0] == 1 and batch != 1:  # a broadcast output, e.g. (1, T, D)
                parts = [p.expand(batch, *p.shape[1:]) for p in parts] if expand else parts
            elif any(p.shape != first.shape for p in parts) or (expand and first.shape[0] % batch):
                # (the whole model's outputs may have a batch of their own, as under vmap: CLIP's images beside its
                # texts, which unfolding gives their member dim; compiled, a whole model runs here and raised)
                raise RuntimeError(
                    f"A per-member module returned a tensor of shape {tuple(first.shape)} for {batch} rows: "
                    "its output has no batch dim, so the members' outputs cannot be folded."
                )
            # (N*B, ...); or a member's token rows (B*T, ...), a router's logits beside a block's (B, T, D) output,
            # which member-major are the folded rows' tokens (as a vectorised module merges its (N, B*T, ...))
            merged.append(torch.cat(parts, dim=0))
        elif isinstance(first, torch.Tensor) and any(p is not first for p in parts):  # each member's 0-dim: (N,)
            merged.append(torch.stack(parts))  # (a whole model's loss), as a vectorised module gives it
        elif isinstance(first, Cache) and any(p is not first for p in parts):  # each member made its own
            merged.append(member_cache.gather(list(parts)))
        else:
            merged.append(first)
    return pytree.tree_unflatten(merged, spec)
