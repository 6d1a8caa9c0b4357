"""Planning: decide, for every module of the template that owns tensors, what it becomes.

First, whatever its tensors: a module that must run as each member's own code (a forward hook, a plain
attribute that differs between members: :mod:`hf_wide.structure`) or that is parametrized (unless every member
holds its tensors alike: then rule 1 shares it) is a **fallback**.
Then rules, in order, for a module M with parameters or buffers of its own:

0. **block** if M's exact class has a fused block (attention, MLP) that accepts it, everything inside it is a
   module the block knows (:func:`~hf_wide.structure.block_structure_known`), M's subtree differs between
   members, and nothing outside the subtree reads its tensors: the whole subtree is fused;
1. **shared** if its tensors are identical in every member: one copy serves all;
2. **fallback** at the lowest common ancestor of M and the modules that read M's tensors, if some
   module other than M reads them, unless an ancestor declares the read (``register_stacked_read``: DeBERTa's
   encoder hands its relative embeddings to its attention blocks): then M is stacked where it differs or a
   fused block reads it, shared where neither, and the reader falls back if only some consumers are fused;
3. **primitive** if a wide builder is registered for M's class;
4. **fallback** at M otherwise (raw parameters read outside a known block, unknown layers).

A module whose own ops mix batch rows becomes a fallback too, unless it has a **rewrite** that computes them per
member (:mod:`hf_wide.rewrites`: CLIP's model scores each member's texts against its own images) and its own
tensors are shared; and so does a module that runs its tensors on an input without the batch dim (T5's relative
position bias), together with what uses the result until it leaves a module with the batch dim or as a broadcast
``(1, ...)``, unless an ancestor has a rewrite (MPNet's encoder computes every member's position bias from the
stacked table) and the children it reads are stacked or shared. The outermost fallback wins: its subtree runs per
member as a whole.
A fallback is **vectorised** (the members' stacked tensors, one vmapped call of the source's forward) unless
vmap cannot run it (data-dependent routing, or verification saw vmap refuse it): then it is a **loop** of member
0's code over each member's stacked tensors, or, where the members' code differs, of each member's own module;
the plan says why. ``demotions`` (from :mod:`hf_wide.verify`) move modules down this ladder.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from .fallback_roots import (common_ancestor, is_under, loop_reason, outermost_roots, rewriting_ancestor, rows_root,
                             unbatched_root)
from .plan import OWN_CODE_LOOP, STACKED_LOOP, Demotions, Kind, ModulePlan, WidePlan
from .primitives.base import same_value
from .structure import (Opaque, block_structure_known, opaque_modules, partly_frozen, tied_to_differing,
                        without_alike_parametrized)
from .registry import (
    declares_stacked_reads,
    find_block,
    find_rewrite,
    find_wide,
    stacked_read_consumers,
)
from .sample_trace import trace_members
from .samples import sample_inputs
from .tracer import Trace


def direct_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters and buffers (not its children's)."""
    tensors = {k: v for k, v in module._parameters.items() if v is not None}
    tensors.update({k: v for k, v in module._buffers.items() if v is not None})
    return tensors


def _same(tensors: Sequence[torch.Tensor]) -> bool:
    return all(same_value(t, tensors[0]) for t in tensors[1:])


def tensor_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor name -> all names of that tensor (tied weights have several)."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, t in model.named_parameters(remove_duplicate=False):
        groups[id(t)].append(name)
    for name, t in model.named_buffers(remove_duplicate=False):
        groups[id(t)].append(name)
    return {name: names for names in groups.values() for name in names}


def make_plan(
    members: Sequence[nn.Module],
    trace: Trace,
    flops: dict[str, int] | None = None,
    sample_shape: str = "",
    share_identical: bool = True,
    demotions: Demotions | None = None,
    opaque: dict[str, Opaque] | None = None,
) -> WidePlan:
    """The WidePlan for fusing ``members`` (same architecture, already checked). With
    ``share_identical=False`` no module is shared: the plan of the architecture, whatever the weights.
    ``demotions`` names the modules that disagreed with their members when verified: a block is planned by its
    parts instead, a primitive or kept module runs per member, vectorised first, then in a loop. ``opaque``:
    :func:`~hf_wide.structure.opaque_modules` of the members, taken before the trace ran member 0 (a module that
    keeps state from its last forward, as Funnel's attention structure does, would differ after it)."""
    template = members[0]
    flops = flops or {}
    demotions = demotions or Demotions()
    demoted = {**demotions.unfused, **demotions.per_member}
    member_modules = [dict(m.named_modules()) for m in members]
    aliases = tensor_aliases(template)
    modules = dict(template.named_modules())
    entries: dict[str, ModulePlan] = {}
    opaque = opaque_modules(members) if opaque is None else opaque
    tied = set()
    if share_identical:  # a parametrized module the members hold alike: shared (rule 1)
        opaque = without_alike_parametrized(opaque, member_modules)
        tied = tied_to_differing(member_modules, aliases, _same)  # ... unless tied to one that differs
    fallback_roots: dict[str, str] = {**{p: o.reason for p, o in opaque.items() if not o.block_may_take},
                                      **demotions.per_member}
    stacked_reads = []  # (module, its declared reader, consumer classes, differs between members, plan fields)
    notes = list(trace.warnings)

    blocks: list[str] = []
    for fqn, module in template.named_modules():
        if any(is_under(fqn, root) for root in blocks):
            continue
        block_cls, refused = find_block(module), ""
        if block_cls is not None and fqn in demoted:
            notes.append(f"{fqn or '(model)'}: {block_cls.__name__} {demoted[fqn]}; planned by its parts")
            block_cls = None
        if block_cls is not None:
            refusal = _block_refusal(fqn, block_cls, member_modules, fallback_roots)
            if refusal is not None:
                notes.append(f"{fqn or '(model)'}: not a {block_cls.__name__} block: {refusal}")
                refused = f" (which a {block_cls.__name__} would take, but {refusal})"
                block_cls = None
        if block_cls is not None and not _fusable(fqn, block_cls, member_modules, aliases, trace, share_identical):
            block_cls = None
        if block_cls is None and fqn in opaque and opaque[fqn].block_may_take:  # its members differ: own code
            fallback_roots.setdefault(fqn, opaque[fqn].reason + refused)
        if block_cls is not None:
            blocks.append(fqn)
            entries[fqn] = ModulePlan(
                fqn=fqn, module_class=type(module).__name__, kind=Kind.BLOCK, wide_class=block_cls.__name__,
                params=sum(p.numel() for p in module.parameters()), flops=flops.get(fqn, 0),
            )
            continue
        tensors = direct_tensors(module)
        if not tensors:
            continue
        kind_args = dict(fqn=fqn, module_class=type(module).__name__, flops=flops.get(fqn, 0))
        kind_args["params"] = sum(p.numel() for p in module.parameters(recurse=False))
        differing = [
            name for name in tensors
            if not share_identical or (f"{fqn}.{name}" if fqn else name) in tied
            or not _same([direct_tensors(mods[fqn])[name] for mods in member_modules])
        ]
        outside = _outside_readers(fqn, list(tensors), aliases, trace)
        declared = _declared_reader(fqn, outside, modules) if outside else None
        if declared is not None:  # planned below, once the blocks its reader feeds are known
            stacked_reads.append((fqn, *declared, bool(differing), [r for _, r in outside], kind_args))
            continue
        if not differing:
            entries[fqn] = ModulePlan(kind=Kind.SHARED, reason="identical in every member", **kind_args)
            continue
        outside = [(name, reader) for name, reader in outside if name in differing]
        wide_cls = find_wide(type(module))
        if fqn in demoted:
            pass  # a fallback root already
        elif outside:
            name, reader = outside[0]
            root = common_ancestor([fqn] + [r for _, r in outside])
            fallback_roots.setdefault(root, f"{fqn}.{name} is read in {reader or '(model)'}")
        elif wide_cls is None:
            raw = ", ".join(differing)
            root = rows_root(fqn, trace.escapes, trace.takes)
            fallback_roots.setdefault(root, f"no wide builder for {type(module).__name__} (tensors: {raw})"
                                      + ("" if root == fqn else f", and {root} gives it its rows"))
        else:
            entries[fqn] = ModulePlan(kind=Kind.PRIMITIVE, wide_class=wide_cls.__name__, **kind_args)

    for fqn, reader, consumers, differs, direct, kind_args in stacked_reads:
        fed = [p for p, m in modules.items() if is_under(p, reader) and type(m) in consumers]
        unfused = [p for p in fed if p not in blocks]
        wide_readers = [r for r in direct if r in entries and entries[r].kind != Kind.SHARED]
        if not differs and len(unfused) == len(fed) and not wide_readers:
            # one copy, read by the source's own modules, as they expect
            entries[fqn] = ModulePlan(kind=Kind.SHARED, reason="identical in every member", **kind_args)
            continue
        wide_cls = find_wide(type(modules[fqn]))  # stacked, even where identical: the fused blocks read it so
        if unfused or wide_cls is None:
            why = f"but {unfused[0]} is not a fused block" if unfused else "but it has no wide builder"
            fallback_roots.setdefault(reader, f"{fqn} is read stacked in {reader or '(model)'}, {why}")
        else:
            entries[fqn] = ModulePlan(kind=Kind.PRIMITIVE, wide_class=wide_cls.__name__, **kind_args)
    rewrites: dict[str, str] = {}
    for path, op in trace.mixing.items():
        rewrite = find_rewrite(modules[path]) if path in modules else None
        if rewrite and getattr(rewrite[0], "mixes_rows", False) and path not in fallback_roots and path not in demoted:
            rewrites[path] = f"{op} mixes batch rows in its own code"  # (CLIP's texts by its images)
        else:
            fallback_roots.setdefault(path, f"{op} mixes batch rows")
    for path, (op, uses) in trace.unbatched.items():
        shared = path in entries and entries[path].kind == Kind.SHARED  # one copy: every member sees the same
        handled = any(is_under(path, b) for b in blocks) or any(  # a block or a declared reader feeds it stacked
            declares_stacked_reads(modules[p]) for p in modules if p and is_under(path, p)) or any(
            all(is_under(p, root) for p in (path, *uses)) for root in opaque)  # all inside a module run per member
        rewritten = rewriting_ancestor(path, modules, demoted)
        if rewritten is not None:  # its method computes every member's result from the stacked tensors
            rewrites.setdefault(rewritten, f"{op} runs {path} on an input without the batch dim")
        elif not (shared or handled):
            root = unbatched_root(path, uses, trace.escapes)
            fallback_roots.setdefault(root, f"{op} runs {path or '(model)'} on an input without the batch dim")
    for fqn, why in rewrites.items():
        rewrite_cls, reads = find_rewrite(modules[fqn])
        unstacked = [r for r in reads if f"{fqn}.{r}" not in entries
                     or entries[f"{fqn}.{r}"].kind not in (Kind.PRIMITIVE, Kind.SHARED)
                     or any(is_under(f"{fqn}.{r}", root) for root in fallback_roots)]
        if unstacked:
            fallback_roots.setdefault(fqn, f"{why}, and {rewrite_cls.__name__} needs {fqn}.{unstacked[0]} stacked")
        else:
            entries[fqn] = ModulePlan(fqn=fqn, module_class=type(modules[fqn]).__name__, kind=Kind.REWRITTEN,
                                      wide_class=rewrite_cls.__name__, reason=f"{why}: computed for every member")
    loops = outermost_roots(fallback_roots, modules, trace.callers, aliases,
                            lambda root: loop_reason(root, modules, opaque, demotions, member_modules))
    outermost = list(loops)
    entries = {f: e for f, e in entries.items() if not any(is_under(f, root) for root in outermost)}
    for root in outermost:
        module = modules[root]
        loop, own_code = loops[root]
        entries[root] = ModulePlan(
            fqn=root,
            module_class=type(module).__name__,
            kind=Kind.VECTORISED if loop is None else Kind.FALLBACK,
            wide_class=OWN_CODE_LOOP if own_code else STACKED_LOOP,
            params=sum(p.numel() for p in module.parameters()),
            flops=flops.get(root, 0),
            reason=fallback_roots[root] + ("" if loop is None else f"; in a loop: {loop}"),
        )
    order = {name: i for i, name in enumerate(modules)}
    entries = dict(sorted(entries.items(), key=lambda item: order[item[0]]))

    if trace.method == "module tree":
        notes.append("export failed: this plan comes from the module tree alone; check it with validate=True")
        warnings.warn(f"hf-wide could not export {type(template).__name__}; planning from the module tree.")
    return WidePlan(
        num_members=len(members),
        model_class=type(template).__name__,
        entries=entries,
        trace_method=trace.method,
        sample_shape=sample_shape,
        total_flops=flops.get("", 0),
        warnings=notes,
        input_roles={fqn: trace.roles[fqn] for fqn, e in entries.items()
                     if e.kind in (Kind.VECTORISED, Kind.FALLBACK) and fqn in trace.roles},
    )


def _block_refusal(fqn: str, block_cls: type, member_modules, fallback_roots: dict[str, str]) -> str | None:
    """Why the block cannot take the members' modules at ``fqn``, or None: something inside must run per member,
    holds a module the block does not know, or the block declines the instance."""
    inside = next((path for path in fallback_roots if is_under(path, fqn)), None)
    if inside is not None:
        return f"{inside or '(model)'} {fallback_roots[inside]}"
    for modules in member_modules:
        reason = block_structure_known(modules[fqn], block_cls.inner_blocks, block_cls.own_modules)
        if reason is not None:
            return reason
    frozen = partly_frozen([modules[fqn] for modules in member_modules])
    if frozen is not None:
        return frozen
    return next((why for modules in member_modules if (why := block_cls.refusal(modules[fqn])) is not None), None)


def _fusable(fqn: str, block_cls, member_modules, aliases, trace: Trace, share_identical: bool) -> bool:
    """A block candidate fuses if its subtree differs between members (else it is shared), no module
    outside it reads its tensors (but those every member holds equal, in a block that keeps them as they are:
    ``keeps_shared_tensors``, a LoRA embedding's base table tied to the output layer), and none of its ops mixes
    batch rows."""
    subtrees = [dict(modules[fqn].named_modules(prefix=fqn)) for modules in member_modules]
    differs = not share_identical
    for path, module in subtrees[0].items():
        names = list(direct_tensors(module))

        def same(name: str) -> bool:  # compared only where asked: a pass over every member's values
            return _same([direct_tensors(subtree[path])[name] for subtree in subtrees])

        outside = _outside_readers(path, names, aliases, trace, within=fqn)
        if any(not (block_cls.keeps_shared_tensors and same(name)) for name, _ in outside):
            return False
        differs = differs or not all(map(same, names))
    return differs and not any(is_under(path, fqn) for path in trace.mixing)


def _declared_reader(fqn: str, outside: list[tuple[str, str]], modules: dict[str, nn.Module]):
    """(reader, consumer classes) when an ancestor of ``fqn`` declares every outside read of its tensors
    (:func:`~hf_wide.registry.register_stacked_read`) and all of them happen inside that ancestor; else None."""
    parts = fqn.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        reader, path = ".".join(parts[:depth]), ".".join(parts[depth:])
        declared = {stacked_read_consumers(modules[reader], f"{path}.{name}") for name, _ in outside}
        if len(declared) == 1 and None not in declared and all(is_under(r, reader) for _, r in outside):
            return reader, declared.pop()
    return None


def _outside_readers(
    fqn: str, names: list[str], aliases: dict[str, list[str]], trace: Trace, within: str | None = None
) -> list[tuple[str, str]]:
    """(tensor name, reader path) for each read of the module's tensors by a module that does not own them
    (or, with ``within``, by a module outside that subtree)."""
    found = []
    for name in names:
        full = f"{fqn}.{name}" if fqn else name
        names_of_tensor = aliases.get(full, [full])
        owners = [within] if within is not None else [n.rsplit(".", 1)[0] if "." in n else "" for n in names_of_tensor]
        readers = set().union(*(trace.users.get(n, set()) for n in names_of_tensor))
        for reader in sorted(readers):
            if not any(is_under(reader, owner) for owner in owners):
                found.append((name, reader))
    return found


def plan_members(
    members: Sequence[nn.Module], args: tuple = (), kwargs: dict | None = None, share_identical: bool = True
) -> WidePlan:
    """Trace member 0 on the sample inputs (built from its config when none are given), count its FLOPs,
    and plan the fusion of ``members``."""
    built = not args and not kwargs
    if built:
        kwargs = sample_inputs(members[0])
    opaque = opaque_modules(members)  # before the trace runs member 0
    traced, flops, shapes = trace_members(members[0], args, kwargs, built=built)
    return make_plan(members, traced, flops, shapes, share_identical, opaque=opaque)
