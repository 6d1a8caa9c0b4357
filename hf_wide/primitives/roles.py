"""Which inputs of a fallback's call carry the folded rows: the roles of its inputs.

A fallback (a vectorised module, or a loop over the members) splits each input that carries the wide forward's
N*B rows into the members' B rows, and hands every other input to each member whole: a broadcast ``(1, ...)``, a
table, a mask without the batch dim (Funnel's ``(T, T)`` mask of the first token, Swin's mask of W windows). By
length alone the two cannot be told apart where such an input happens to have N*B rows: a ``(T, T)`` mask at
T == N*B was cut into the members' rows, each member's B rows of it broadcast over its T queries, and at B = 1 no
shape disagreed: a wrong number, verified or not (the sample does not have that length).

So each fallback keeps, per structure of its call's inputs (pytree's spec, as text: :func:`call_key`), the role of
each input: True where it carries the rows, False where it does not, None where unknown. The trace says it first:
the export runs every module on symbolic shapes, and an input whose leading dim holds the batch symbol carries the
rows (:func:`recording`). A fallback's first calls teach it the rest (:func:`rows_and_batched`), and an input known
not to carry the rows is never split, whatever its length. A size can carry them too (ProphetNet's positions take
``inputs_embeds.shape[:2]``): where the trace finds an int input proportional to the batch symbol, each member is
given its share of it (:func:`is_rows_size`), never by its value alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

Roles = list  # per input leaf: True (the folded rows), False (not), None (unknown)


def call_key(spec) -> str:
    """A call's structure as text: the key of its roles (saved with a fused repo, so text, not the spec itself)."""
    return " ".join(str(spec).split())


@contextlib.contextmanager
def recording(model: nn.Module, found: dict[str, dict[str, Roles]]) -> Iterator[None]:
    """While ``model`` is exported with a dynamic batch dim, fill ``found[path][call_key]`` with the roles of the
    inputs of every module's calls: whether each tensor's leading dim holds the batch symbol (that of the model's
    own first input). Calls of one structure that disagree leave that input unknown. The dims are read when the
    export is done: its inputs' symbols, one per input, are found equal (one batch) only as it runs."""
    paths = {id(m): path for path, m in model.named_modules()}
    calls: list[tuple[str, str, list]] = []  # (path, key, each input's leading dim: a SymInt's expression, an int)
    shape_env = []

    def hook(module, args, kwargs):
        if id(module) not in paths:  # a copy of a module the forward made (hooks and all): not the model's
            return
        leaves, spec = pytree.tree_flatten((args, kwargs))
        firsts = []
        for t in leaves:
            size = isinstance(t, torch.SymInt)  # a size itself: torch.Size leaves are ints
            first = t if size else t.shape[0] if isinstance(t, torch.Tensor) and t.dim() > 0 else None
            if isinstance(first, torch.SymInt):
                shape_env[:] = [first.node.shape_env]
                first = first.node.expr
            firsts.append((size, first))
        calls.append((paths[id(module)], call_key(spec), firsts))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]
    try:
        yield
        top = next(((key, firsts) for path, key, firsts in calls if path == ""), None)
        if not shape_env or top is None:
            return
        env = shape_env[0]

        def symbols(first) -> set:
            return set(env.replace(first).free_symbols) if first is not None and not isinstance(first, int) else set()

        batch = symbols(next((f for size, f in top[1] if f is not None and not size), None))

        def role(size: bool, first) -> bool | None:
            if first is None or first == 1:
                return None
            if not size:
                return bool(symbols(first) & batch)
            if not symbols(first) & batch:
                return False
            # A size that holds the rows (the rows themselves, or rows x tokens): each member's is 1/N of it
            (symbol,) = batch if len(batch) == 1 else (None,)
            return symbol is not None and not symbols(env.replace(first) / symbol) & batch or None

        for path, key, firsts in calls if batch else ():
            roles = [role(size, f) for size, f in firsts]
            seen = found.setdefault(path, {}).setdefault(key, roles)
            if seen is not roles:
                found[path][key] = [a if a == b else None for a, b in zip(seen, roles)]
    finally:
        for handle in handles:
            handle.remove()


def rows_and_batched(known: dict[str, Roles], rows: int | None, num_members: int, leaves: list,
                     spec) -> tuple[int, list[bool]]:
    """This call's folded rows, and which inputs carry them (member-major: member m's rows are the m-th of N
    blocks). ``known``: a fallback's roles, by :func:`call_key`, which this call adds to; ``rows``: the wide
    forward's (None outside one: the first batched input has them).

    An input with the rows carries them, and a broadcast, a table or anything else does not, unless the roles say
    otherwise at that place of the inputs: there, the inputs that carry the rows set this call's (N*B*W, windows of
    each image, in Swin at other image sizes than the sample's), and an input known not to carry them does not,
    whatever its length (Swin's mask of W windows, where W happens to be N*B). What this call shows of an input
    of unknown role is kept: another length than the rows or 1, not the rows; the rows, the rows."""
    if rows is None:
        rows = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), num_members)
    key = call_key(spec)
    seen = known.get(key)
    if seen is None:  # a structure not met: the roles of the same call without its flags, if known
        seen = _roles_without_flags(known, leaves, spec)
    if seen is not None:
        # (compared, not hashed in a set: hashing a compiled graph's symbolic size fixes it to its value)
        lengths = [t.shape[0] for t, role in zip(leaves, seen) if role and isinstance(t, torch.Tensor) and
                   t.dim() > 0 and t.shape[0] > 1]
        if lengths and all(length == lengths[0] for length in lengths) and lengths[0] % rows == 0:
            rows = lengths[0]
    batched = [isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows and
               (seen is None or seen[i] is not False) or is_rows_size(t, seen and seen[i], num_members)
               for i, t in enumerate(leaves)]
    # A broadcast (1, ...) says nothing: a mask may be (1, 1, T, T) without padding and carry the rows with it.
    roles = [b if isinstance(t, torch.Tensor) and t.dim() > 0 and (b or t.shape[0] != 1) else None
             for t, b in zip(leaves, batched)]
    known[key] = roles if seen is None else [r if s is None else s for r, s in zip(roles, seen)]
    return rows, batched


def _roles_without_flags(known: dict[str, Roles], leaves: list, spec) -> Roles | None:
    """The roles known for this call without its keyword flags (``output_attentions=True``: a bool, which no rows
    ride on), at this call's places; None where not known. A flag asked for in a call the trace did not make (Swin's
    attention with ``output_attentions``) left every input of unknown role, and the windows' N*B*W rows were taken
    for a broadcast: each member ran every member's windows."""
    args, kwargs = pytree.tree_unflatten(list(range(len(leaves))), spec)  # each leaf its place: (args, kwargs)
    if not isinstance(kwargs, dict):
        return None
    flagless = {k: v for k, v in kwargs.items() if not (isinstance(v, int) and isinstance(leaves[v], bool))}
    if len(flagless) == len(kwargs):
        return None
    places, short = pytree.tree_flatten((args, flagless))
    seen = known.get(call_key(short))
    if seen is None:
        return None
    roles: Roles = [None] * len(leaves)
    for place, role in zip(places, seen):
        roles[place] = role
    return roles


def is_rows_size(leaf, role: bool | None, num_members: int) -> bool:
    """Whether an input is a size that holds the folded rows (ProphetNet's positions take ``inputs_embeds.shape[:2]``):
    only where the trace says so, never by its value; each member is then given ``leaf // N``."""
    return (role is True and isinstance(leaf, int) and not isinstance(leaf, bool) and leaf > 0
            and leaf % num_members == 0)
