"""What the planner's rules ask of a module (:mod:`hf_wide.planner`): whether a fused block can take its subtree, and
which modules read its tensors outside it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .fallback_roots import is_under
from .primitives.base import same_value
from .registry import stacked_read_consumers
from .structure import block_structure_known, partly_frozen
from .tracer import Trace


def direct_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters and buffers (not its children's)."""
    tensors = {k: v for k, v in module._parameters.items() if v is not None}
    tensors.update({k: v for k, v in module._buffers.items() if v is not None})
    return tensors


def same_tensors(tensors: Sequence[torch.Tensor]) -> bool:
    return all(same_value(t, tensors[0]) for t in tensors[1:])


def block_refusal(fqn: str, block_cls: type, member_modules, fallback_roots: dict[str, str]) -> str | None:
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


def fusable(fqn: str, block_cls, member_modules, aliases, trace: Trace, share_identical: bool) -> bool:
    """A block candidate fuses if its subtree differs between members (else it is shared), no module
    outside it reads its tensors (but those every member holds equal, in a block that keeps them as they are:
    ``keeps_shared_tensors``, a LoRA embedding's base table tied to the output layer), and none of its ops mixes
    batch rows."""
    subtrees = [dict(modules[fqn].named_modules(prefix=fqn)) for modules in member_modules]
    differs = not share_identical
    for path, module in subtrees[0].items():
        names = list(direct_tensors(module))

        def same(name: str) -> bool:  # compared only where asked: a pass over every member's values
            return same_tensors([direct_tensors(subtree[path])[name] for subtree in subtrees])

        outside = outside_readers(path, names, aliases, trace, within=fqn)
        if any(not (block_cls.keeps_shared_tensors and same(name)) for name, _ in outside):
            return False
        differs = differs or not all(map(same, names))
    return differs and not any(is_under(path, fqn) for path in trace.mixing)


def declared_reader(fqn: str, outside: list[tuple[str, str]], modules: dict[str, nn.Module]):
    """(reader, consumer classes) when an ancestor of ``fqn`` declares every outside read of its tensors
    (:func:`~hf_wide.registry.register_stacked_read`) and all of them happen inside that ancestor; else None."""
    parts = fqn.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        reader, path = ".".join(parts[:depth]), ".".join(parts[depth:])
        declared = {stacked_read_consumers(modules[reader], f"{path}.{name}") for name, _ in outside}
        if len(declared) == 1 and None not in declared and all(is_under(r, reader) for _, r in outside):
            return reader, declared.pop()
    return None


def outside_readers(
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
