"""Many adapters of one base fused a group at a time (``WideModel.from_pretrained([adapter, ...])``).

Fusing reads every member's module tree at once: the plan, the build and the check each take member i's module at
every path. Over full checkpoints the trees are little beside N sets of weights; over N adapters of one base, which
hold hardly more than the base, they are what the load adds: PEFT's wrappers of an adapter of a BERT-base are 2.4 MiB
of Python objects (16 adapters: 38 MiB, against the 50 MiB that 10% of the base and the adapters allow), and the
check's wide forward holds activations for every member's rows beside them.

So eight adapters or more whose configs build the same modules (:func:`~hf_wide.adapter_trace.alike_structure`) are
loaded and fused in groups of :data:`GROUP_SIZE` to twice that less one (:func:`group_slices`) over the one base,
each group checked against its own members as any fusion is and its members' trees let go before the next group
loads (16 adapters of a BERT-base: 1.15x -> 1.09x of the base and adapters held). The groups' wide models are then
joined (:func:`concatenate`): each wide module's stacked tensors concatenated where its class can
(:meth:`~hf_wide.blocks.lora.WideLoraLinear.join`), else built anew from the groups' members' modules, the groups'
own freed path by path; and the joined model's output on the sample is checked against every member's own output,
recorded as its group was checked (:func:`check_by_rows`). Where the groups' plans differ (a module that one group's
members hold alike and another's do not, say), or the joined model fails that check, or (known from the first group's
plan, before the others load: :func:`unjoinable`) the plan holds modules the join does not build or would copy the
base's tensors to build, the adapters are loaded again and fused all at once.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import plan_cache
from .adapter_trace import alike_structure, module_structure, trace_ahead
from .adapters import AdapterBase, load_adapter_base, load_adapter_members
from .configs import configs_in_place, configs_replaced, module_configs
from .cpu import collected, release_freed_memory
from .fold import Fold
from .plan import Kind, WidePlan
from .planner import common_aliases
from .primitives.base import WideModule, keeping_storage, same_value
from .registry import find_block, get_wide
from .swap import remove_fold_hooks

logger = logging.getLogger(__name__)

GROUP_SIZE = 4  # the fewest adapters a group holds: 4 adapters of a BERT-base load within 1.07x of their bytes
JOINED = (Kind.BLOCK, Kind.PRIMITIVE)  # the wide modules concatenate() builds anew; SHARED ones it keeps


def fuse_adapters(cls, ids: Sequence[str], folders: Sequence, configs: Sequence[dict | None], *, load: dict,
                  fuse: dict, saved_plan: WidePlan | None = None):
    """The wide model of a list that holds adapters (``load``: :func:`~hf_wide.adapters.load_adapter_members`'
    options; ``fuse``: :func:`~hf_wide.fuse.fuse_models`'), their sources and each member's no-ops, as
    :func:`~hf_wide.adapters.load_adapter_members` gives them. In groups where :func:`grouped`; else, or where the
    groups do not join, all at once. ``saved_plan``: the plan of a saved ensemble of these adapters, for
    :func:`~hf_wide.fuse.fuse_models` to verify rather than trace member 0 (each group by it, in groups); without
    one, the plan a list of the same structure was fused by before (:mod:`hf_wide.plan_cache`), used alike, and the
    plan kept there where the members were traced."""
    from .fuse import fuse_models, uses_saved_plan

    ids, folders, configs = list(ids), list(folders), list(configs)
    base = load_adapter_base(ids, folders, configs, **load)
    checked = uses_saved_plan(fuse.get("verify", True), fuse.get("share_identical", True))
    key = None
    if saved_plan is None and checked and plan_cache.enabled():  # a list loaded before: by the plan it was fused by
        key = plan_cache.plan_key(base.model, configs, {**fuse, "merge": load.get("merge", False)})
        saved_plan = plan_cache.load_plan(key)
    known = saved_plan if checked else None  # (a plan is never used unchecked)
    if grouped(configs, load.get("merge", False)):
        joined = _fuse_in_groups(cls, ids, folders, configs, base, load, fuse, known)
        if joined is not None:
            if key is not None and known is None:  # (traced: the groups' one plan)
                plan_cache.store_plan(key, joined[0].plan)
            return joined
        gc.collect()  # the groups' wide models, before all the members load
        release_freed_memory()
    known = None if known is None else dataclasses.replace(known, num_members=len(ids))  # (another grouping's)
    models, sources, padded, traced = load_adapter_members(ids, folders, configs, base=base,
                                                           trace_first=known is None, **load)
    wide = fuse_models(cls, models, member_ids=ids, traced=traced, copy_shared=False, saved_plan=known, **fuse)
    if key is not None and wide.plan is not known:  # traced (none was cached, or it was not these members')
        plan_cache.store_plan(key, wide.plan)
    return wide, sources, padded


def grouped(configs: Sequence[dict | None], merge: bool = False) -> bool:
    """Whether the adapters are fused in groups (:func:`group_slices`): at least twice :data:`GROUP_SIZE` adapters
    (no full checkpoints), not merged, whose configs build the same modules."""
    return not merge and len(configs) >= 2 * GROUP_SIZE and alike_structure(configs)


def group_slices(n: int, size: int) -> list[slice]:
    """``n`` members in groups of ``size`` to ``2 * size - 1``, as even as can be: a group of one member would
    keep every module whole (nothing differs within it), a plan no other group's matches."""
    count = max(1, n // size)
    bounds = [n * k // count for k in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _fuse_in_groups(cls, ids, folders, configs, base: AdapterBase, load: dict, fuse: dict,
                    known: WidePlan | None = None):
    """(wide model, sources, no-ops) of the adapters fused in groups and joined; None where they cannot be (the
    caller then fuses them all at once). ``known``: the plan these adapters were fused by before (saved with them, or
    cached: :mod:`hf_wide.plan_cache`), by which every group is fused, verified, rather than by member 0's trace."""
    from .fuse import as_args_kwargs, fuse_models
    from .samples import sample_inputs

    n, wides, outputs, padded = len(ids), [], [], []
    traced = structure = sources = None
    for part in group_slices(n, GROUP_SIZE):
        start = part.start
        with collected():  # the group's module trees (PEFT's wrappers hold reference cycles), for the next group's
            models, group_sources, group_padded, ahead = load_adapter_members(
                ids[part], folders[part], configs[part], base=base, first=start,
                trace_first=start == 0 and known is None, desc=f"Loading members {part.start + 1}-{part.stop} of {n}",
                **load)
            if start == 0 and known is not None:  # (no trace: the sample the groups are checked on)
                traced, structure, sources = (sample_inputs(models[0]), None), module_structure(models[0]), group_sources
            elif start == 0:
                if ahead is None:  # not taken as member 0 loaded, or member 0 has changed since (padded): now
                    ahead = trace_ahead(models[0])
                    ahead = None if ahead is None else ahead[:2]
                traced, structure, sources = ahead, module_structure(models[0]), group_sources
            if traced is None or module_structure(models[0]) != structure:
                logger.info("hf-wide: fusing the adapters all at once (member %d is not traced as member 0 is)", start)
                return None  # (member 0 not traced ahead: the fusion says why, all at once)
            if known is None:
                wides.append(fuse_models(cls, models, member_ids=ids[part], traced=traced, copy_shared=False,
                                         outputs=outputs, **fuse))
            else:
                plan = dataclasses.replace(known, num_members=len(models))
                wides.append(fuse_models(cls, models, traced[0], member_ids=ids[part], copy_shared=False,
                                         outputs=outputs, saved_plan=plan, **fuse))
                if wides[-1].plan is not plan:  # (traced: not these members' plan after all)
                    logger.info("hf-wide: fusing the adapters all at once (the known plan is not group %d's)",
                                len(wides) - 1)
                    return None
            padded += group_padded
            del models
            why = unjoinable(wides[0]) if start == 0 else None
            if why is not None:  # known from the first group's plan: before the others load
                logger.info("hf-wide: fusing the adapters all at once: %s", why)
                return None
    why = joins(wides)
    if why is not None:
        logger.info("hf-wide: fusing the adapters all at once: %s", why)
        return None
    wide = concatenate(cls, wides, ids)
    del wides
    release_freed_memory()
    if fuse.get("verify", True):
        whole = check_by_rows(wide, outputs, *as_args_kwargs(traced[0]))
        if whole is not None:
            logger.warning("hf-wide: the groups of adapters, joined, %s; fusing them all at once", whole)
            return None
    sources = dataclasses.replace(sources, configs=list(configs), padded=padded) if sources is not None else None
    return wide, sources, padded


def check_by_rows(wide, outputs: list[dict], args: tuple, kwargs: dict) -> str | None:
    """:func:`~hf_wide.verify.check_whole` of the joined model against the members' recorded ``outputs``, one row
    of the sample at a time where every input and output tensor holds the sample's rows first and no row is scored
    against the others (CLIP's texts against its images), else on the whole sample. Its forward, over every
    member's rows, is the peak of the load: 16 adapters of a BERT-base peaked at 544 MiB so, 549-552 MiB on the
    whole sample. The groups' own checks took the whole sample, rows together."""
    from .verify import check_whole, tf32_possible

    tf32 = tf32_possible(wide.model)
    leaves = pytree.tree_leaves((args, kwargs, [calls[None] for calls in outputs]))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    batch = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
    if batch < 2 or wide.own_batches or any(t.dim() == 0 or t.shape[0] != batch for t in tensors):
        return check_whole(wide, outputs, args, kwargs, tf32=tf32)
    for row in range(batch):
        def cut(t):
            return t[row:row + 1] if isinstance(t, torch.Tensor) else t

        part = [{None: pytree.tree_map(cut, calls[None])} for calls in outputs]
        failure = check_whole(wide, part, *pytree.tree_map(cut, (args, kwargs)), tf32=tf32)
        if failure is not None:
            return f"on row {row} of the sample, {failure}"
    return None


def joins(wides: Sequence) -> str | None:
    """None where :func:`concatenate` joins these groups' wide models; else why not: their plans differ, a plan
    holds modules it does not build, or a module one group keeps whole (shared by its members) holds other
    tensors in another group."""
    first = wides[0]
    why = unjoinable(first)
    if why is not None:
        return why

    def layout(plan: WidePlan) -> list[tuple]:
        return [(fqn, e.module_class, e.kind, e.wide_class) for fqn, e in plan.entries.items()]

    for group, wide in enumerate(wides[1:], 1):
        if layout(wide.plan) != layout(first.plan):
            return f"group {group}'s plan differs from group 0's"
    built = _joined_paths(first.plan)
    for fqn, entry in first.plan.entries.items():
        if _inside(fqn, built):
            continue
        ours = _tensors(first.model.get_submodule(fqn))  # a shared module (unjoinable: nothing else is left)
        for wide in wides[1:]:
            theirs = _tensors(wide.model.get_submodule(fqn))
            if ours.keys() != theirs.keys() or not all(same_value(t, theirs[k]) for k, t in ours.items()):
                return f"{entry.name}, shared within each group, differs between groups"
    return None


def unjoinable(wide) -> str | None:
    """Why the groups' wide models cannot be joined, read from the first group's (``wide``; None where they can): a
    module the join does not build (a loop, a vectorised module, the whole model as one), or a block that it would build anew from its
    members' modules, copying the base's tensors it holds (the q, k and v of attention with LoRA projections, a LoRA
    embedding's table): only LoRA linears (:meth:`~hf_wide.blocks.lora.WideLoraLinear.join`) and primitives, whose
    tensors are all their members' own, are joined."""
    built = _joined_paths(wide.plan)
    for fqn, entry in wide.plan.entries.items():  # (a rewritten module is kept, as a shared one: given the new fold)
        if entry.kind not in (Kind.SHARED, Kind.REWRITTEN) and not _inside(fqn, built):
            return f"{entry.name} is {entry.kind.value}, which the groups' join does not build"
    for fqn in built:
        module = wide.model.get_submodule(fqn) if fqn else wide.model
        if not fqn or not (hasattr(type(module), "join") or isinstance(module, WideModule)):
            return (f"{wide.plan.entries[fqn].name} is a {type(module).__name__}, which the groups' join would build "
                    "anew from its members' modules")
    return None


def concatenate(cls, wides: Sequence, ids: Sequence[str]):
    """One wide model of the members of ``wides`` (wide models of one plan, over one base: :func:`joins`), in
    order. Built in place of the first group's: each of its wide modules replaced by one built from every group's
    members' modules (views of the groups' tensors, freed as each path is built), its shared modules kept."""
    first, n = wides[0], sum(w.num_members for w in wides)
    members = [(wide, j) for wide in wides for j in range(wide.num_members)]
    fold = Fold(n)
    model = first.model
    # Wide modules built here read the first group's config objects, as build_wide's read the template's
    ours = {id(c): c for c in module_configs(model)}
    replaced = dict(ours)
    for wide in wides[1:]:
        replaced.update(configs_in_place(wide.model, model, ours))
    with configs_replaced(replaced), keeping_storage(), torch.no_grad():
        for fqn in _joined_paths(first.plan):
            built = _joined(first.plan.entries[fqn], [wide.model.get_submodule(fqn) for wide in wides], members, fold)
            for wide in wides:  # the groups' own: freed now, not when every path is built
                _replace(wide.model, fqn, built if wide is first else nn.Module())
            release_freed_memory()  # their pages, which the larger tensors of the next path do not reuse
    for fqn, entry in first.plan.entries.items():
        if entry.kind == Kind.REWRITTEN:  # (its method reads the number of members: CLIP's)
            model.get_submodule(fqn).fold = fold
    remove_fold_hooks(model)
    ties = common_aliases([w._aliases for w in wides])  # those every group's members hold
    joined = cls(model, dataclasses.replace(first.plan, num_members=n), fold, ties, list(ids),
                 _joined_list(wides, "member_configs"), _joined_list(wides, "member_generation_configs"))
    joined.member_peft_configs = _joined_list(wides, "member_peft_configs")
    joined.differently_trained = tuple(dict.fromkeys(name for w in wides for name in w.differently_trained))
    return joined.train(first.training)


def _joined(entry, modules: Sequence[nn.Module], members: Sequence[tuple], fold: Fold) -> nn.Module:
    """The wide module of every member at one path, from the groups' ``modules`` there: their tensors concatenated
    where their class can (a ``join`` class method: :meth:`~hf_wide.blocks.lora.WideLoraLinear.join`), else built
    from each member's module taken out of its group's (``to_module``, views of its tensors)."""
    join = getattr(type(modules[0]), "join", None)
    if join is not None and all(type(m) is type(modules[0]) for m in modules):
        built = join(modules, fold)
        if built is not None:
            return built
    mods = [wide.model.get_submodule(entry.fqn).to_module(j, share=True) for wide, j in members]
    builder = find_block(mods[0]) if entry.kind == Kind.BLOCK else get_wide(type(mods[0]))
    return builder.from_modules(mods, fold)


def _joined_paths(plan: WidePlan) -> list[str]:
    """The paths of the modules :func:`concatenate` builds: blocks and primitives not inside another."""
    paths: list[str] = []
    for fqn, entry in plan.entries.items():
        if entry.kind in JOINED and not _inside(fqn, paths):
            paths.append(fqn)
    return paths


def _inside(fqn: str, paths: Sequence[str]) -> bool:
    return any(fqn == p or p == "" or fqn.startswith(f"{p}.") for p in paths)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own tensors (a plan's entry is a module that owns some: its children have entries of their own)."""
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def _replace(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _joined_list(wides: Sequence, name: str) -> list | None:
    lists = [getattr(w, name) for w in wides]
    return None if any(items is None for items in lists) else [item for items in lists for item in items]
