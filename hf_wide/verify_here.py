"""Wide modules checked where they run, on the wide forward's own inputs (:func:`hf_wide.verify.verify_modules`).

A built wide module (a block or a primitive: a wide ``Linear``, a LoRA linear, a norm, an attention block) takes
its members' rows folded ``(N*B, ...)``, member-major. Inside the wide forward, each member's own module is called
on that member's rows of the very inputs the wide module got, and the wide module's output is compared with what
each returns, one member at a time: nothing of the members' is recorded beforehand, and the members need no forward
of their own but for their whole outputs. Over adapters of one base, whose wide model is hardly larger than one
member, the members' recorded module outputs were most of what the check held (5 MiB per adapter of a BERT-base
on the 2 x 8-token sample), and needed a wide forward per group of members.

Only agreement is decided here: a module that agrees computes each member's module on that member's rows, what it
was built to do. One that does not, or whose call does not split so (an input that is neither the folded rows nor
the same for every member, or an object a member's module might change), is checked as before on its members' own
recorded inputs (:func:`hf_wide.verify.check_module`), which alone may find it wrong. A wide module whose call
takes one tensor per member stacked ``(N, ...)`` (DeBERTa's relative-position table) says so
(``takes_stacked_inputs``) and is checked as before from the start.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .compare import UNCHECKED, compare_outputs, device_lost
from .plan import Kind

BUILT = (Kind.BLOCK, Kind.PRIMITIVE)
# Inputs given to every member as they are: values no module call changes
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(...), slice)


def checked_here(wide, paths: Sequence[str], references: Sequence[nn.Module]) -> dict[str, list[nn.Module]]:
    """The built wide modules among ``paths`` to check in the wide forward, each with its members' modules (from
    ``references``, in member order). Not one whose members' modules hold a wide module that is checked (a shared
    one): its hooks, there to record the wide forward, would take a member's call for the wide model's."""
    wide_modules = dict(wide.model.named_modules())
    built = [p for p in paths if (e := wide.plan.entries.get(p)) is not None and e.kind in BUILT
             and not getattr(wide_modules.get(p), "takes_stacked_inputs", True)]
    if not built:
        return {}
    hooked = {id(wide_modules[p]) for p in paths if p in wide_modules}
    members = [dict(reference.named_modules()) for reference in references]
    found = {}
    for path in built:
        modules = [named.get(path) for named in members]
        if all(m is not None and not any(id(sub) in hooked for sub in m.modules()) for m in modules):
            found[path] = modules
    return found


def agrees_here(members: Sequence[nn.Module], args: tuple, kwargs: dict, output, rows: int, tf32: bool) -> bool:
    """Whether a wide module's ``output`` holds, for every member, what the member's module returns on its share of
    the wide module's inputs (``args``, ``kwargs``): each tensor that holds the ``rows`` (N*B) folded rows split
    member-major, any other tensor or plain value given whole (a broadcast: the same for every member). False where
    an input is another object (a cache, say, which a member's call would change under the wide forward), or a
    member's module raises. ``tf32``: see :func:`hf_wide.compare.tolerance`."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if not all(isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in leaves):
        return False
    n = len(members)
    for i, module in enumerate(members):
        # copies: the wide forward goes on with these inputs, whatever a member's module might write into its own
        own = [leaf.chunk(n)[i].clone() if _folded(leaf, rows) else leaf.clone() if isinstance(leaf, torch.Tensor)
               else leaf for leaf in leaves]
        member_args, member_kwargs = pytree.tree_unflatten(own, spec)
        try:
            with torch.no_grad():
                member_output = module(*member_args, **member_kwargs)
        except Exception as exc:
            if device_lost(exc):
                raise
            return False
        references = [UNCHECKED] * n
        references[i] = member_output
        if compare_outputs(output, references, rows, tf32) is not None:
            return False
    return True


def _folded(t: torch.Tensor, rows: int) -> bool:
    """Whether ``t`` holds the members' rows, member-major: ``(N*B, ...)``, or ``(N*B*S, ...)`` where the model
    flattened its tokens (a mixture of experts' router, say)."""
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] > 0 and t.shape[0] % rows == 0
