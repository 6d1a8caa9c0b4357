"""The swap walk: apply a WidePlan to N members and get one folded model.

The wide model is a copy of the template in which every planned module is replaced: primitives and blocks by
their wide class, fallbacks by a :class:`VectorisedFallback` (stacked tensors, vmapped or in a loop) or, where
each member must run its own code, a :class:`PerMemberFallback`; shared modules are kept as they are. The copy
is a ``deepcopy`` whose memo already holds the replacements, so the members' swapped tensors are never
copied twice.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from .adapter_layers import unpad
from .capture import reset_capture_hooks
from .configs import configs_in_place, configs_replaced, copies_of, follow_kernels, module_configs, same_places
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
    memo.update(detached_handles(template))
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
    retie(wide, tensor_aliases(*members))  # the ties every member holds: no member's tensor taken for another's
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
                # in the wide module's mode: what it was built from was put in eval mode (a member's BatchNorm in
                # a wide model in training used its running statistics: 1.40 off). (Not train()'s return: LeViT's
                # attentions return None.)
                memo[id(module)] = module.to_module(i, share=share)
                memo[id(module)].train(module.training)
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


def detached_handles(model: nn.Module) -> dict[int, RemovableHandle]:
    """id -> a copy with no hook dicts, for every hook handle ``model``'s modules keep (transformers'
    ``enable_input_require_grads`` keeps a list of its input embeddings' hooks'). A copy of the model without the
    modules the hooks were put on (swapped for wide ones) would refer weakly to copies of their hook dicts that die
    as the copy ends, and torch cannot copy a handle with a dead extra dict (``RemovableHandle.__setstate__``:
    TypeError): ``wide.member(i)`` and ``copy.deepcopy(wide)`` raised. There is no hook in them to remove."""
    handles = {}
    for module in model.modules():
        for value in vars(module).values():
            for handle in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(handle, RemovableHandle):
                    handles[id(handle)] = detached = RemovableHandle(OrderedDict())  # (a dead reference)
                    detached.id = handle.id
    return handles


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
        memo[id(wide.model.config)] = own = copy.deepcopy(wide.member_configs[i])
        follow_kernels(own, wide.model.config)
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

    Wide modules are built one by one, so ``lm_head`` and ``embed_tokens`` first get two stacked copies of the same
    weight, and fallbacks copies of their own (a vectorised one in its ``stacked`` module, one that runs each member's
    own module in each member's): the first name's tensor replaces the others', member by member where the members'
    own modules hold them (BertForMaskedLM's embeddings, vectorised, and its decoder, a wide linear, had trained
    apart). Names whose shapes differ after swapping (inside a fused block) are left as they are; the planner runs
    a module tied to one that runs each member's own module the same way
    (:func:`~hf_wide.fallback_roots.tied_to_own_code`).
    """
    done = set()
    for names in aliases.values():
        if len(names) < 2 or names[0] in done:
            continue
        done.add(names[0])
        places = [p for p in (_places(model, name) for name in names) if p]
        for count in {len(p) for p in places}:  # one place (stacked, or the model's own), or one per member
            alike = [p for p in places if len(p) == count]
            for k in range(count):
                first = getattr(*alike[0][k])
                for owner, attr in (p[k] for p in alike[1:]):
                    current = getattr(owner, attr)
                    if first is not None and current is not None and current is not first and (
                            current.shape == first.shape):
                        setattr(owner, attr, first)


def _places(model: nn.Module, name: str) -> list[tuple[nn.Module, str]]:
    """Where ``model`` holds the template's tensor ``name``, as (module, attribute): one place, or one per member
    inside a fallback that runs each member's own module; none where the path is gone (inside a fused block)."""
    path, _, attr = name.rpartition(".")
    owners = [model]
    for part in path.split(".") if path else []:
        owners = [o._modules.get(part) for m in owners for o in _held(m)]
        if any(o is None for o in owners):
            return []
    owners = [o for m in owners for o in _held(m)]
    return [(o, attr) for o in owners if attr in o._parameters or attr in o._buffers]


def _held(module: nn.Module) -> list[nn.Module]:
    """The modules holding the source's tensors in ``module``: a vectorised fallback's stacked copy of the source,
    the members' own modules of a fallback that runs them, or the module itself."""
    if isinstance(module, VectorisedFallback):
        return [module.stacked]
    if isinstance(module, PerMemberFallback):
        return list(module.members)
    return [module]
