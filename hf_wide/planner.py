"""Planning: decide, for every module of the template that owns tensors, what it becomes.

First, whatever its tensors: a module that must run as each member's own code (a forward hook, a plain
attribute that differs between members: :mod:`hf_wide.structure`) or that is parametrized (unless every member
holds its tensors alike: then rule 1 shares it) is a **fallback**.
Then rules, in order, for a module M with parameters or buffers of its own:

0. **block** if M's exact class has a fused block (attention, MLP) that accepts it, everything inside it is a
   module the block knows (:func:`~hf_wide.structure.block_structure_known`), M's subtree differs between
   members, and nothing outside the subtree reads its tensors: the whole subtree is fused;
1. **shared** if its tensors are identical in every member: one copy serves all (not a BatchNorm, whose training
   forward reads statistics of its whole batch: :func:`batch_statistics`);
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

from torch import nn

from .fallback_roots import (common_ancestor, is_under, loop_reason, outermost_roots, rewriting_ancestor, rows_root,
                             unbatched_root)
from .plan import OWN_CODE_LOOP, STACKED_LOOP, Demotions, Kind, ModulePlan, WidePlan
from .planner_rules import block_refusal, declared_reader, direct_tensors, fusable, outside_readers, same_tensors
from .registry import declares_stacked_reads, find_block, find_rewrite, find_wide
from .structure import Opaque, opaque_modules, tied_to_differing, without_alike_parametrized
from .sample_trace import trace_members
from .samples import sample_inputs
from .tracer import Trace


def tensor_aliases(*models: nn.Module) -> dict[str, list[str]]:
    """Every tensor name -> all names of that tensor (tied weights have several). Of several models (the members),
    the ties that every one of them holds (:func:`common_aliases`)."""
    per_model = []
    for model in models:
        groups: dict[int, list[str]] = defaultdict(list)
        for name, t in model.named_parameters(remove_duplicate=False):
            groups[id(t)].append(name)
        for name, t in model.named_buffers(remove_duplicate=False):
            groups[id(t)].append(name)
        per_model.append({name: names for names in groups.values() for name in names})
    return common_aliases(per_model)


def common_aliases(per_model: Sequence[dict[str, list[str]]]) -> dict[str, list[str]]:
    """The ties that all of ``per_model`` (:func:`tensor_aliases` of each member) hold. A tie that one member lacks is
    none of the wide model's: a PEFT adapter that saves ``lm_head`` apart from its embeddings, beside one that ties
    the two (``ensure_weight_tying``), would else have its ``lm_head`` copied from its embeddings in its member copy."""
    first, others = per_model[0], per_model[1:]
    return {name: [a for a in names if a == name or all(a in other.get(name, ()) for other in others)]
            for name, names in first.items()}


def batch_statistics(module: nn.Module) -> bool:
    """Whether ``module``'s training forward reads statistics of its whole batch (a BatchNorm's normalisation and
    running statistics, an InstanceNorm's running ones): held once, it would read every member's rows in training
    (the members alike BatchNorms of a ResNet fine-tuned with them frozen: 0.33 off each member in training)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) or (
        isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats)


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
    planner = _Planner(members, trace, flops or {}, share_identical, demotions or Demotions(), opaque)
    for fqn, module in planner.modules.items():  # rules 0-4, module by module
        planner.plan_module(fqn, module)
    planner.plan_stacked_reads()
    planner.plan_rewrites()
    entries = planner.entries_with_fallbacks()
    template, notes = members[0], planner.notes
    if trace.method == "module tree":
        notes.append("export failed: this plan comes from the module tree alone; check it with validate=True")
        warnings.warn(f"hf-wide could not export {type(template).__name__}; planning from the module tree.")
    return WidePlan(
        num_members=len(members),
        model_class=type(template).__name__,
        entries=entries,
        trace_method=trace.method,
        sample_shape=sample_shape,
        total_flops=planner.flops.get("", 0),
        warnings=notes,
        input_roles={fqn: trace.roles[fqn] for fqn, e in entries.items()
                     if e.kind in (Kind.VECTORISED, Kind.FALLBACK) and fqn in trace.roles},
    )


class _Planner:
    """One plan in the making: the entries decided so far, and the roots of what must run per member
    (``fallback_roots``: path -> why), of which the outermost become fallbacks at the end."""

    def __init__(self, members: Sequence[nn.Module], trace: Trace, flops: dict[str, int], share_identical: bool,
                 demotions: Demotions, opaque: dict[str, Opaque] | None):
        template = members[0]
        self.trace, self.flops, self.share_identical, self.demotions = trace, flops, share_identical, demotions
        self.demoted = {**demotions.unfused, **demotions.per_member}
        self.member_modules = [dict(m.named_modules()) for m in members]
        self.aliases = tensor_aliases(template)
        self.modules = dict(template.named_modules())
        self.entries: dict[str, ModulePlan] = {}
        opaque = opaque_modules(members) if opaque is None else opaque
        self.tied = set()
        if share_identical:  # a parametrized module the members hold alike: shared (rule 1)
            opaque = without_alike_parametrized(opaque, self.member_modules)
            # ... unless tied to one that differs
            self.tied = tied_to_differing(self.member_modules, self.aliases, same_tensors)
        self.opaque = opaque
        self.fallback_roots: dict[str, str] = {**{p: o.reason for p, o in opaque.items() if not o.block_may_take},
                                               **demotions.per_member}
        self.stacked_reads = []  # (module, its declared reader, consumer classes, differs between members, plan fields)
        self.blocks: list[str] = []
        self.notes = list(trace.warnings)

    def plan_module(self, fqn: str, module: nn.Module) -> None:
        """Rules 0-4 for one module (rule 2's declared reads wait for :meth:`plan_stacked_reads`)."""
        if any(is_under(fqn, root) for root in self.blocks):
            return
        if self._plan_block(fqn, module):
            return
        tensors = direct_tensors(module)
        if not tensors:
            return
        kind_args = dict(fqn=fqn, module_class=type(module).__name__, flops=self.flops.get(fqn, 0))
        kind_args["params"] = sum(p.numel() for p in module.parameters(recurse=False))
        differing = [
            name for name in tensors
            if not self.share_identical or (f"{fqn}.{name}" if fqn else name) in self.tied
            or batch_statistics(module)
            or not same_tensors([direct_tensors(mods[fqn])[name] for mods in self.member_modules])
        ]
        outside = outside_readers(fqn, list(tensors), self.aliases, self.trace)
        declared = declared_reader(fqn, outside, self.modules) if outside else None
        if declared is not None:  # planned once the blocks its reader feeds are known
            self.stacked_reads.append((fqn, *declared, bool(differing), [r for _, r in outside], kind_args))
            return
        if not differing:
            self.entries[fqn] = ModulePlan(kind=Kind.SHARED, reason="identical in every member", **kind_args)
            return
        outside = [(name, reader) for name, reader in outside if name in differing]
        wide_cls = find_wide(type(module))
        if fqn in self.demoted:
            pass  # a fallback root already
        elif outside:
            name, reader = outside[0]
            root = common_ancestor([fqn] + [r for _, r in outside])
            self.fallback_roots.setdefault(root, f"{fqn}.{name} is read in {reader or '(model)'}")
        elif wide_cls is None:
            raw = ", ".join(differing)
            root = rows_root(fqn, self.trace.escapes, self.trace.takes)
            self.fallback_roots.setdefault(root, f"no wide builder for {type(module).__name__} (tensors: {raw})"
                                           + ("" if root == fqn else f", and {root} gives it its rows"))
        else:
            self.entries[fqn] = ModulePlan(kind=Kind.PRIMITIVE, wide_class=wide_cls.__name__, **kind_args)

    def _plan_block(self, fqn: str, module: nn.Module) -> bool:
        """Rule 0: whether ``module``'s subtree is fused as one block (planned here if so)."""
        block_cls, refused = find_block(module), ""
        if block_cls is not None and fqn in self.demoted:
            self.notes.append(f"{fqn or '(model)'}: {block_cls.__name__} {self.demoted[fqn]}; planned by its parts")
            block_cls = None
        if block_cls is not None:
            refusal = block_refusal(fqn, block_cls, self.member_modules, self.fallback_roots)
            if refusal is not None:
                self.notes.append(f"{fqn or '(model)'}: not a {block_cls.__name__} block: {refusal}")
                refused = f" (which a {block_cls.__name__} would take, but {refusal})"
                block_cls = None
        if block_cls is not None and not fusable(fqn, block_cls, self.member_modules, self.aliases, self.trace,
                                                 self.share_identical):
            block_cls = None
        if block_cls is None and fqn in self.opaque and self.opaque[fqn].block_may_take:  # members differ: own code
            self.fallback_roots.setdefault(fqn, self.opaque[fqn].reason + refused)
        if block_cls is None:
            return False
        self.blocks.append(fqn)
        self.entries[fqn] = ModulePlan(
            fqn=fqn, module_class=type(module).__name__, kind=Kind.BLOCK, wide_class=block_cls.__name__,
            params=sum(p.numel() for p in module.parameters()), flops=self.flops.get(fqn, 0),
        )
        return True

    def plan_stacked_reads(self) -> None:
        """Rule 2's declared reads: shared where no member differs and only the source's own modules read the
        tensors; stacked where the fused blocks the reader feeds read them; else the reader falls back."""
        for fqn, reader, consumers, differs, direct, kind_args in self.stacked_reads:
            fed = [p for p, m in self.modules.items() if is_under(p, reader) and type(m) in consumers]
            unfused = [p for p in fed if p not in self.blocks]
            wide_readers = [r for r in direct if r in self.entries and self.entries[r].kind != Kind.SHARED]
            if not differs and len(unfused) == len(fed) and not wide_readers:
                # one copy, read by the source's own modules, as they expect
                self.entries[fqn] = ModulePlan(kind=Kind.SHARED, reason="identical in every member", **kind_args)
                continue
            wide_cls = find_wide(type(self.modules[fqn]))  # stacked, even where identical: the fused blocks read it so
            if unfused or wide_cls is None:
                why = f"but {unfused[0]} is not a fused block" if unfused else "but it has no wide builder"
                self.fallback_roots.setdefault(reader, f"{fqn} is read stacked in {reader or '(model)'}, {why}")
            else:
                self.entries[fqn] = ModulePlan(kind=Kind.PRIMITIVE, wide_class=wide_cls.__name__, **kind_args)

    def plan_rewrites(self) -> None:
        """Ops that mix batch rows, or run a module's tensors on an input without the batch dim: a rewrite computes
        them per member where a module has one and the tensors it reads are stacked or shared; else they fall back."""
        modules, entries, roots, trace = self.modules, self.entries, self.fallback_roots, self.trace
        rewrites: dict[str, str] = {}
        for path, op in trace.mixing.items():
            rewrite = find_rewrite(modules[path]) if path in modules else None
            if rewrite and getattr(rewrite[0], "mixes_rows", False) and path not in roots and path not in self.demoted:
                rewrites[path] = f"{op} mixes batch rows in its own code"  # (CLIP's texts by its images)
            else:
                roots.setdefault(path, f"{op} mixes batch rows")
        for path, (op, uses) in trace.unbatched.items():
            shared = path in entries and entries[path].kind == Kind.SHARED  # one copy: every member sees the same
            handled = any(is_under(path, b) for b in self.blocks) or any(  # a block or a declared reader: stacked
                declares_stacked_reads(modules[p]) for p in modules if p and is_under(path, p)) or any(
                all(is_under(p, root) for p in (path, *uses)) for root in self.opaque)  # all inside one run per member
            rewritten = rewriting_ancestor(path, modules, self.demoted)
            if rewritten is not None:  # its method computes every member's result from the stacked tensors
                rewrites.setdefault(rewritten, f"{op} runs {path} on an input without the batch dim")
            elif not (shared or handled):
                root = unbatched_root(path, uses, trace.escapes)
                roots.setdefault(root, f"{op} runs {path or '(model)'} on an input without the batch dim")
        for fqn, why in rewrites.items():
            rewrite_cls, reads = find_rewrite(modules[fqn])
            unstacked = [r for r in reads if f"{fqn}.{r}" not in entries
                         or entries[f"{fqn}.{r}"].kind not in (Kind.PRIMITIVE, Kind.SHARED)
                         or any(is_under(f"{fqn}.{r}", root) for root in roots)]
            if unstacked:
                roots.setdefault(fqn, f"{why}, and {rewrite_cls.__name__} needs {fqn}.{unstacked[0]} stacked")
            else:
                entries[fqn] = ModulePlan(fqn=fqn, module_class=type(modules[fqn]).__name__, kind=Kind.REWRITTEN,
                                          wide_class=rewrite_cls.__name__, reason=f"{why}: computed for every member")

    def entries_with_fallbacks(self) -> dict[str, ModulePlan]:
        """The entries, in the model's module order, with the outermost fallback roots as fallbacks in place of
        everything under them (vectorised, or a loop where vmap cannot run them)."""
        modules = self.modules
        loops = outermost_roots(self.fallback_roots, modules, self.trace.callers, self.aliases,
                                lambda root: loop_reason(root, modules, self.opaque, self.demotions,
                                                         self.member_modules))
        outermost = list(loops)
        entries = {f: e for f, e in self.entries.items() if not any(is_under(f, root) for root in outermost)}
        for root in outermost:
            module = modules[root]
            loop, own_code = loops[root]
            entries[root] = ModulePlan(
                fqn=root,
                module_class=type(module).__name__,
                kind=Kind.VECTORISED if loop is None else Kind.FALLBACK,
                wide_class=OWN_CODE_LOOP if own_code else STACKED_LOOP,
                params=sum(p.numel() for p in module.parameters()),
                flops=self.flops.get(root, 0),
                reason=self.fallback_roots[root] + ("" if loop is None else f"; in a loop: {loop}"),
            )
        order = {name: i for i, name in enumerate(modules)}
        return dict(sorted(entries.items(), key=lambda item: order[item[0]]))


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
