"""The swap walk: apply a WidePlan to N members and get one folded model.

The wide model is a copy of the template in which every planned module is replaced: primitives and blocks by
their wide class, fallbacks by a :class:`VectorisedFallback` (stacked tensors, vmapped or in a loop) or, where
each member must run its own code, a :class:`PerMemberFallback`; shared modules are kept as they are. The copy
is a ``deepcopy`` whose memo already holds the replacements, so the members' swapped tensors are never
copied twice.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from .adapter_layers import unpad
from .capture import reset_capture_hooks
from .configs import configs_in_place, configs_replaced, copies_of, module_configs, same_places
from .choices import is_fold_hook
from .fold import Fold
from .losses import uninstall_member_losses
from .packing import remove_packing_hooks
from .plan import STACKED_LOOP, Kind, WidePlan
from .planner import tensor_aliases
from .blocks import WideBlock
from .primitives import PerMemberFallback, VectorisedFallback, WideModule
from .primitives.base import copy_module, keeps_storage
from .registry import find_block, find_rewrite, get_wide, rewrite_classes


WIDE_MODULES = (WideModule, WideBlock, VectorisedFallback, PerMemberFallback)  # what a plan swaps in


def build_wide(members: Sequence[nn.Module], plan: WidePlan, fold: Fold) -> nn.Module:
    """The folded model: the template with the plan's primitives and fallbacks swapped in."""
    template = members[0]
    per_member = [dict(m.named_modules()) for m in members]
    # The wide model's own copies of the template's configs, read by every module of it, each member's modules
    # run per member too (the members share their architecture: hf_wide.compat; see hf_wide.configs)
    memo = copies_of(module_configs(template))
    configs = [memo, *(configs_in_place(m, template, memo) for m in members[1:])]
    with configs_replaced(memo):
        for fqn, entry in plan.entries.items():
            mods = [modules[fqn] for modules in per_member]
            if entry.kind == Kind.BLOCK:
                memo[id(mods[0])] = find_block(mods[0]).from_modules(mods, fold)
            elif entry.kind == Kind.PRIMITIVE:
                memo[id(mods[0])] = get_wide(type(mods[0])).from_modules(mods, fold)
            elif entry.kind == Kind.VECTORISED or entry.wide_class == STACKED_LOOP:
                memo[id(mods[0])] = VectorisedFallback.from_modules(mods, fold, loop=entry.kind == Kind.FALLBACK)
            elif entry.kind == Kind.FALLBACK:
                copies = []
                for m, own in zip(mods, configs):
                    with configs_replaced(own):
                        copies.append(copy_module(m))
                memo[id(mods[0])] = PerMemberFallback.from_modules(copies, fold)
    if keeps_storage():  # what is kept whole holds the members' own tensors (hf_wide.primitives.base)
        memo.update({id(t): t for t in (*template.parameters(), *template.buffers())})
    # If the whole model is one fallback, it is its own replacement.
    wide = memo[id(template)] if id(template) in memo else copy.deepcopy(template, memo)
    for fqn, entry in plan.entries.items():
        if entry.kind == Kind.REWRITTEN:  # the copy is the template's own module: its class takes the rewrite
            module = wide.get_submodule(fqn)
            module.__class__ = find_rewrite(module)[0]
            module.fold = fold  # (the number of members, for a method that computes each member's)
    for fqn, roles in plan.input_roles.items():  # which inputs of each fallback's calls carry the rows
        module = wide.get_submodule(fqn)
        if isinstance(module, (VectorisedFallback, PerMemberFallback)):
            module.input_roles.update(copy.deepcopy(roles))
    retie(wide, tensor_aliases(template))
    return reset_capture_hooks(wide)  # hooks copied from members may sit inside wide modules


def member_copy(
    wide: nn.Module, i: int, aliases: dict[str, list[str]], memo: dict | None = None, share: bool = False
) -> nn.Module:
    """Member i of a folded model as an ordinary module: every swapped module replaced by its i-th member.
    With ``share=True`` every tensor is a view into the wide model's (no copy)."""
    memo = dict(memo or {})
    if share:  # shared modules' tensors: the same objects
        memo.update({id(t): t for t in (*wide.parameters(), *wide.buffers())})
    # The member's configs, read by every module of it: those the caller gave (its own config for the wide
    # model's), the same sub-configs of them, and a copy of any other (hf_wide.configs)
    configs, given = module_configs(wide), {}
    for old in (c for c in configs if id(c) in memo):
        given.update(same_places(old, memo[id(old)]))
    memo.update(copies_of([c for c in configs if id(c) not in given], given))
    with configs_replaced(memo):
        for module in wide.modules():
            if isinstance(module, WIDE_MODULES) and id(module) not in memo:
                memo[id(module)] = module.to_module(i, share=share)
                memo.update({id(sub): sub for sub in module.modules() if sub is not module})  # inside it: skip
    member = memo[id(wide)] if id(wide) in memo else copy.deepcopy(wide, memo)
    for module in member.modules():
        if isinstance(module, rewrite_classes()):  # one member's module runs the source's method
            module.__class__ = module.source_class
            module.__dict__.pop("fold", None)
    remove_fold_hooks(member)
    remove_packing_hooks(member)  # a pipeline's padding-free encoder (hf_wide.packing): one member packs nothing
    retie(member, aliases)
    return reset_capture_hooks(member)  # hooks copied from the wide model sit on wide modules


def remove_fold_hooks(model: nn.Module) -> None:
    """Take out what a :class:`~hf_wide.WideModel` puts on the model it wraps: the fold's row recorder (a pre-hook)
    and each member's loss function, for one member taken out of it, or for another wide model to wrap it."""
    for module in model.modules():
        uninstall_member_losses(module)  # its own loss function, not the wide model's split by member
        for key, hook in list(module._forward_pre_hooks.items()):
            if is_fold_hook(hook):  # the wide model's row recorder, or a multiple-choice encoder's rows
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
        for key, hook in list(module._forward_hooks.items()):
            if is_fold_hook(hook):
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)


def member_model(wide, i: int, share: bool = False) -> nn.Module:
    """:meth:`hf_wide.WideModel.member`: member i of ``wide`` (a WideModel) as an ordinary model."""
    if not -wide.num_members <= i < wide.num_members:
        raise IndexError(f"member {i} out of range for {wide.num_members} members")
    i %= wide.num_members
    local = i  # its index among the members this process holds
    if wide.members_group is not None:
        group = wide.members_group
        if i not in group.local:
            raise IndexError(f"member {i} is held by rank {group.rank_of(i)}, not by this rank "
                             f"({group.rank}: members {group.local.start}-{group.local.stop - 1}).")
        local = i - group.local.start
    memo = {}
    if wide.member_configs is not None and hasattr(wide.model, "config"):
        memo[id(wide.model.config)] = copy.deepcopy(wide.member_configs[i])
    gen = getattr(wide.model, "generation_config", None)
    if gen is not None and wide.member_generation_configs and wide.member_generation_configs[i] is not None:
        memo[id(gen)] = copy.deepcopy(wide.member_generation_configs[i])
    if wide.member_peft_configs is not None:  # its own rank, alpha, targets: what save_pretrained writes
        memo[id(wide.model.peft_config)] = copy.deepcopy(wide.member_peft_configs[i])
    model = member_copy(wide.model, local, wide._aliases, memo, share=share)
    if i in wide.full_members:  # a full checkpoint among adapters: PEFT's zero-update layers taken out
        model = model.unload()  # (nothing is merged: its own weights, exactly)
    elif wide.padded_targets:  # an adapter: the no-ops given for targets and saved modules it lacks taken out
        unpad(model, wide.padded_targets[local])
    return model


def retie(model: nn.Module, aliases: dict[str, list[str]]) -> None:
    """Make tied tensors (several names, one tensor in the template) one tensor again in ``model``.

    Wide primitives are built per module, so ``lm_head`` and ``embed_tokens`` first get two stacked copies
    of the same weight; here the first name's tensor replaces the others. Names inside a fallback, or whose
    shapes differ after swapping, cannot be tied and are left as they are.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    done = set()
    for name, names in aliases.items():
        if len(names) < 2 or names[0] in done:
            continue
        done.add(names[0])
        first = params.get(names[0])
        for other in names[1:]:
            current = params.get(other)
            if first is None or current is None or current is first or current.shape != first.shape:
                continue
            owner_name, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner_name), attr, first)
