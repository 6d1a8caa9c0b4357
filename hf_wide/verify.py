"""Verification at fuse time: every fused module against its members, on the inputs the sample forward gives it.

The structural rules (:mod:`hf_wide.structure`) decide what a builder may take; this checks what it built. The
wide model runs the sample once, with hooks on every block and primitive of the plan. A built one (a block, a
primitive) is checked there and then, on its own inputs: each member's module is called on that member's rows of
them and must return what the wide module returned for those rows (:mod:`hf_wide.verify_here`). The others (the
vectorised modules, loops over stacked tensors, and a block that takes a table per member) are checked against
their members' outputs, recorded beforehand in a forward of each member on the sample with hooks that keep, for
every such module, the first call's output (:mod:`hf_wide.verify_record`); a wide module whose output in the wide forward holds every member's
output agrees with its members. The wide forward's inputs also show which of a module's arguments carry the
folded rows: ``(N*B, ...)`` where the member's has ``(B, ...)``, ``(N, ...)`` where it has one tensor per member
(DeBERTa's stacked table), or the member's very shape (a broadcast). Any module that did not agree is then called on
the members' recorded inputs, folded so, and its output is compared, member by member, with what each member's
module returned: errors upstream cannot leak into a module's verdict, since it is fed the members' inputs, not the
wide forward's. A module that disagrees is reported with its error, and the caller moves it one rung down the ladder
(a block to its parts, a primitive to a fallback) and verifies again.

The cost, where everything agrees: one forward of the sample per member for its whole output (taken before the
build), the members' modules called once each in the wide forward, and, where modules are recorded, a forward per
member keeping their outputs and a wide forward per group of members whose outputs are held at once (one group,
unless N members' outputs would outweigh :data:`RECORD_SHARE` of the wide model, as over adapters of one base;
:data:`MAX_GROUPS` at most), whose output is also the whole model's check (:func:`diagnose`); the members run
again, to record their inputs, only for modules that disagreed there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .compare import UNCHECKED, compare_outputs, device_lost, equal, first_line, tf32_possible
from .cpu import release_freed_memory
from .fold import Fold
from .plan import STACKED_LOOP, Kind, WidePlan
from .samples import sample_kwargs
from .verify_here import agrees_here, checked_here
from .verify_record import AGREED, NO_INPUTS, Recorder, record_members

CHECKED = (Kind.BLOCK, Kind.PRIMITIVE, Kind.VECTORISED)  # and loops over stacked tensors: member 0's code


def _fold_leaf(wide, parts: list):
    """The wide module's input from the members' ``parts``, laid out as the wide forward gave it ``wide``."""
    first, n = parts[0], len(parts)
    if not isinstance(first, torch.Tensor):
        return first if all(equal(p, first) for p in parts) else _NOT_FOLDABLE
    if not isinstance(wide, torch.Tensor) or any(p.shape != first.shape for p in parts):
        return _NOT_FOLDABLE
    if first.dim() and wide.shape == (n * first.shape[0], *first.shape[1:]):
        return torch.cat(parts)  # (N*B, ...), member-major
    if wide.shape == (n, *first.shape):
        return torch.stack(parts)  # (N, ...): one per member
    if wide.shape == first.shape and all(torch.equal(p, first) for p in parts):
        return first  # a broadcast, or an input without the batch dim: the same for every member
    return _NOT_FOLDABLE


_NOT_FOLDABLE = object()


def check_module(module: nn.Module, fold: Fold, wide_call: tuple, member_calls: list[tuple], rows: int,
                 tf32: bool = False) -> str | None:
    """Call one wide module on its members' recorded inputs; None if every member's output matches (``tf32``: see
    :func:`hf_wide.compare.tolerance`)."""
    wide_leaves, _ = pytree.tree_flatten((wide_call[0], wide_call[1]))
    member_flat = [pytree.tree_flatten((args, kwargs)) for args, kwargs, _ in member_calls]
    spec = member_flat[0][1]
    if any(s != spec for _, s in member_flat) or len(wide_leaves) != len(member_flat[0][0]):
        return "was called with inputs of another structure than its members'"
    leaves = [_fold_leaf(w, list(parts)) for w, *parts in zip(wide_leaves, *(leaves for leaves, _ in member_flat))]
    if any(leaf is _NOT_FOLDABLE for leaf in leaves):
        return "got an input that differs between members and cannot be folded"
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    module.__dict__.pop("vmap_refused", None)  # from the wide forward before
    fold.anchor = leaves_anchor(leaves, rows)
    try:
        with torch.no_grad():
            output = module(*args, **kwargs)
    except Exception as exc:  # a module that cannot run its members' inputs disagrees with them
        if device_lost(exc):
            raise
        return f"raised on its members' inputs: {first_line(exc)}"
    finally:
        fold.reset()
    refused = module.__dict__.pop("vmap_refused", None)  # a vectorised module that had to loop on the sample
    if refused is not None:
        return refused
    return compare_outputs(output, [out for _, _, out in member_calls], rows, tf32)


def leaves_anchor(leaves: list, rows: int) -> torch.Tensor:
    tensor = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
    return torch.empty(rows, 0) if tensor is None else tensor.new_empty(rows, 0)


RECORD_SHARE = 0.02  # the members' recorded module outputs held at once: at most this share of the wide model's bytes
MAX_GROUPS = 4  # ... unless that takes more wide forwards than this: each costs about what all N members' forwards do


def verify_modules(wide, paths: Sequence[str], references: Sequence[nn.Module], args: tuple, kwargs: dict,
                   recorded: list[dict] | None = None) -> tuple[dict[str, str], list[dict], object]:
    """Check the modules at ``paths`` of ``wide`` (a :class:`~hf_wide.WideModel`) against ``references``
    (member i's model, or a view of it) on the sample inputs. Returns ({fqn: what went wrong}, the members'
    recorded calls, to pass back in when verifying a re-planned model, and the wide model's output).

    Built modules (blocks, primitives) are checked in the first wide forward on its own inputs
    (:func:`~hf_wide.verify_here.agrees_here`): nothing of theirs is recorded. The other modules' outputs are
    recorded a group of members at a time, as many as fit in :data:`RECORD_SHARE` of the wide model's bytes (at
    least one, and at least N / :data:`MAX_GROUPS` of them), and each group is checked in a wide forward of its own:
    over adapters of one base, whose wide model is hardly larger than one member, N members' outputs at once would
    outweigh the check's other costs. A group's outputs of a module are let go as soon as the wide forward has
    compared them, for the rest of that forward to reuse. Kept for the caller: each member's whole output and the
    calls of modules that disagreed; a module's verdict is its verdict in every group."""
    recorded = recorded if recorded is not None else [{} for _ in references]
    modules = dict(wide.model.named_modules())
    rows = wide.num_members * _sample_batch(args, kwargs)
    budget = RECORD_SHARE * held_bytes(wide.model)
    tf32 = tf32_possible(references[0])
    here = checked_here(wide, paths, references)  # blocks and primitives: checked in the first wide forward
    kept = [p for p in paths if p not in here]
    suspects: dict[str, tuple] = {}  # path -> the wide module's call, from the first group it disagreed with
    output, start, n = None, 0, len(references)
    while start < n:
        group = {start: _recorded(references[start], recorded[start], kept, args, kwargs)}
        # what the group's recordings hold (not the whole output, which is kept for every member anyway)
        held = _bytes([call for path, call in group[start].items() if path is not None])
        size = n if not held else max(1, int(budget // held), -(-n // MAX_GROUPS))
        for i in range(start + 1, min(n, start + size)):
            group[i] = _recorded(references[i], recorded[i], kept, args, kwargs)
        for i, calls in group.items():
            recorded[i].setdefault(None, calls[None])
        release_freed_memory()  # the members' activations, before the wide forward's
        for path in paths:  # a vectorised module notes where vmap refused it: in this forward, not an earlier one
            if path in modules:
                modules[path].__dict__.pop("vmap_refused", None)

        checked = {p for p in kept if p in group[start]} | (here.keys() if start == 0 else set())

        def agrees(path: str, args, kwargs, output) -> bool:  # in the wide forward itself, on its own inputs
            if path not in checked:
                return True
            if path in here:
                return agrees_here(here[path], args, kwargs, output, rows, tf32)
            # The group's outputs of this module are dropped once compared: the rest of the forward reuses their memory
            references = [group[i].pop(path)[2] if i in group else UNCHECKED for i in range(n)]
            return modules[path].__dict__.get("vmap_refused") is None and compare_outputs(
                output, references, rows, tf32) is None

        with Recorder(wide.model, paths, agrees=agrees) as recorder, torch.no_grad():
            try:
                output = wide(*args, **sample_kwargs(wide.model, kwargs))
            except Exception as exc:  # the innermost checked module it was raised in disagrees with its members
                if not recorder.running or device_lost(exc):
                    raise
                failure = {recorder.running[-1]: f"raised {first_line(exc)}"}
                return failure, recorded, None
        for path, call in recorder.calls.items():
            if call is not AGREED and path in checked:
                suspects.setdefault(path, call)
        start += len(group)
        del group  # before the next group's are recorded
        release_freed_memory()  # its freed pages, which the next group's recordings, of other sizes, may not reuse
    unrecorded = [p for p in suspects if recorded[0].get(p, (NO_INPUTS,))[0] is NO_INPUTS]
    if unrecorded:  # the members' inputs of the modules to check on them
        for calls, new in zip(recorded, record_members(references, unrecorded, args, kwargs)):
            calls.update({p: new[p] for p in unrecorded if p in new})
    failures = {}
    for path, call in suspects.items():  # on its members' inputs: an error upstream is not this module's
        idle = next((i for i, calls in enumerate(recorded) if path not in calls), None)
        if idle is not None:  # (an expert no token of member i's was routed to): nothing to check it on
            failures[path] = f"was not run by member {idle} on the sample, so it cannot be checked on its inputs"
            continue
        reason = modules[path].__dict__.get("vmap_refused") or check_module(
            modules[path], wide.fold, call, [r[path] for r in recorded], rows, tf32)
        if reason is not None:
            failures[path] = reason
    return failures, recorded, output


def _recorded(reference: nn.Module, calls: dict, paths: Sequence[str], args: tuple, kwargs: dict) -> dict:
    """``calls`` (a member's recorded calls) with the outputs of the modules at ``paths`` it lacks, and its whole
    output, recorded on the sample: a new dict."""
    missing = [p for p in paths if p not in calls]
    if not missing and None in calls:
        return dict(calls)  # the caller's to drop from
    (new,) = record_members([reference], missing, args, kwargs, inputs=False)
    return {**new, **calls}


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def held_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers, a storage that several of them share counted once."""
    storages = {}
    for t in (*model.parameters(), *model.buffers()):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass (a quantized tensor, say) has none
            storages[id(t)] = t.numel() * t.element_size()
            continue
        if t.device.type != "meta":
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def wide_paths(plan: WidePlan) -> list[str]:
    """The modules a plan makes wide: what :func:`verify_modules` checks on every fusion."""
    return [e.fqn for e in plan.entries.values() if e.kind in CHECKED or e.wide_class == STACKED_LOOP]


def kept_paths(wide) -> list[str]:
    """The template's own modules in a folded model (not wide, not per member, not inside either), innermost
    first: where to look when every wide module agrees with its members but the whole output does not."""
    from .swap import WIDE_MODULES

    found, inside = [], []
    for path, module in wide.model.named_modules():
        if any(path.startswith(f"{p}.") for p in inside):
            continue
        if isinstance(module, WIDE_MODULES):
            inside.append(path)
        else:
            found.append(path)
    return sorted(found, key=lambda p: -p.count(".") - bool(p))


def innermost(failures: dict[str, str]) -> dict[str, str]:
    """The failures none of whose submodules failed: the others may only carry their error."""
    return {p: r for p, r in failures.items() if not any(q != p and (p == "" or q.startswith(f"{p}.")) for q in failures)}


def check_whole(wide, recorded: list[dict], args: tuple, kwargs: dict, output=None, tf32: bool = False) -> str | None:
    """None if the wide model's output (``output``, or a forward of the sample) holds every member's recorded
    output on the sample (``tf32``: see :func:`hf_wide.compare.tolerance`)."""
    if output is None:
        with torch.no_grad():
            output = wide(*args, **sample_kwargs(wide.model, kwargs))  # (N, B, ...) leaves
    n = wide.num_members
    unlike = _unlike_members(output, [r[None][2] for r in recorded], n)
    if unlike is not None:
        return unlike
    batch = _sample_batch(args, kwargs)
    folded = pytree.tree_map(lambda t: t.reshape(n * batch, *t.shape[2:])
                             if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[:2] == (n, batch) else t, output)
    return compare_outputs(folded, [r[None][2] for r in recorded], n * batch, tf32)


def _unlike_members(output, members: list, n: int) -> str | None:
    """What keeps ``output`` (the wide model's, as its caller gets it) from holding every member's output in the
    members' own shapes, ``(N, *member's)``, or None. The layouts a module's output may take inside the model (a
    broadcast expanded to the rows, one tensor for every member) are no caller's: an LSTM's ``h_n``, ``(1, B, H)``,
    came back ``(N, B, B, H)``, and an output averaged over the batch, ``(C,)``, came back ``(N*C,)``."""
    leaves, spec = pytree.tree_flatten(output)
    for member in members:
        own, own_spec = pytree.tree_flatten(member)
        if own_spec != spec:
            return None  # (compare_outputs says so)
        for k, (out, ref) in enumerate(zip(leaves, own)):
            if isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor) and out.shape != (n, *ref.shape):
                return (f"returned output {k} of shape {tuple(out.shape)}, where each member's is {tuple(ref.shape)}: "
                        f"not one per member")
    return None


def _sample_batch(args: tuple, kwargs: dict) -> int:
    first = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0)
    return first.shape[0]


def diagnose(wide, references: Sequence[nn.Module], args: tuple, kwargs: dict,
             recorded: list[dict] | None = None) -> tuple[dict[str, str], list[dict]]:
    """Everything that keeps ``wide`` from equalling its members on the sample: ({fqn: reason}, recorded calls).
    First the wide modules; if they agree but the whole output does not, or the template's own code raised, the
    kept modules, innermost first (the rows a module mixes, say, where no trace saw it)."""
    try:
        failures, recorded, output = verify_modules(wide, wide_paths(wide.plan), references, args, kwargs, recorded)
    except Exception as exc:  # raised in the template's own code: the innermost module it ran in is to blame
        if device_lost(exc):
            raise
        return verify_modules(wide, kept_paths(wide), references, args, kwargs, recorded)[:2]
    if failures:
        return failures, recorded
    whole = check_whole(wide, recorded, args, kwargs, output, tf32_possible(references[0]))
    if whole is None:
        return {}, recorded
    failures, recorded, _ = verify_modules(wide, kept_paths(wide), references, args, kwargs, recorded)
    return innermost(failures) or {"": f"(the whole output) {whole}"}, recorded
