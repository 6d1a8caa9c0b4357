"""What each call of a member-parallel model (:mod:`hf_wide.parallel`) does across its ranks: it agrees on the inputs,
gathers every rank's members' outputs, and raises on every rank where it raised on any. A rank whose call raised alone
would leave the others waiting for it in a collective, which its next call's would then answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .inputs import PerMember
from .parallel import MemberGroup, MemberParallelError, describe_error, describe_failures, gather_reports


def gather_outputs(members: MemberGroup, outputs: Any, unfolded: list[torch.Tensor], inputs: tuple[tuple, dict],
                   error: Exception | None = None) -> Any:
    """The local forward's ``outputs`` with every per-member tensor, ``unfolded`` to ``(n_local, ...)`` (of B rows,
    B*C of a multiple-choice head's layers, XLNet's time-major memories, ...), replaced by all N members'
    ``(N, ...)``; other values (caches, scalars) stay as they are. Raises on every rank if the ranks' inputs or output
    structures differ, or if the local forward raised ``error`` on any rank (:func:`raise_if_failed`)."""
    made = {id(t) for t in unfolded}
    leaves: list[torch.Tensor] = []
    _walk(outputs, lambda t: leaves.append(t) if id(t) in made else None)
    meta = (_fingerprint(inputs), [(tuple(t.shape[1:]), str(t.dtype)) for t in leaves], describe_error(error))
    metas = [None] * members.world_size
    dist.all_gather_object(metas, meta, members.group)
    raise_if_failed(members, [m[2] for m in metas], error)
    if any(m[0] != metas[0][0] for m in metas):
        ranks = [r for r, m in enumerate(metas) if m[0] != metas[0][0]]
        raise MemberParallelError(f"The ranks of a member-parallel model were given different inputs (rank "
                                  f"{ranks[0]} differs from rank 0): every rank must run the same inputs.")
    if any(m[1] != metas[0][1] for m in metas):
        raise MemberParallelError("The ranks' outputs differ in structure or shape: every rank must run the same "
                                  f"inputs with the same options ({metas[0][1]} on rank 0).")
    gathered = iter([gather_members(members, t) for t in leaves])
    return _walk(outputs, lambda t: next(gathered) if id(t) in made else t, rebuild=True)


def raise_if_failed(members: MemberGroup, reports: list[str | None], error: Exception | None) -> None:
    """Raise on every rank where a call raised on any (``reports``: each rank's error, or None): the ranks that
    raised raise their own ``error`` again, the others a :class:`MemberParallelError` naming them. (A rank whose call
    raised alone left the others waiting for it to gather, and they gathered its next call's outputs instead.)"""
    failed = describe_failures(members, reports)
    if failed is None:
        return
    if error is not None:
        error.add_note(f"The call failed on {failed}; the member-parallel model raised on every rank.")
        raise error
    raise MemberParallelError(f"The call failed on {failed}")


def on_every_rank_alike(members: MemberGroup, error: Exception | None) -> None:
    """Raise on every rank where ``error`` (what this rank's call raised, or None) was raised on any: the ranks
    that raised their own, the others a :class:`MemberParallelError` (:func:`raise_if_failed`)."""
    raise_if_failed(members, gather_reports(members, error), error)


def agree_on_inputs(members: MemberGroup, inputs: tuple[tuple, dict]) -> None:
    """Raise on every rank unless every rank was given the same inputs and options (:func:`_fingerprint`): before a
    ``generate``, which gathers only the tokens (each rank's members continued its own prompt, and the ranks
    returned them mixed)."""
    fingerprints = [None] * members.world_size
    dist.all_gather_object(fingerprints, _fingerprint(inputs), members.group)
    differ = [rank for rank, found in enumerate(fingerprints) if found != fingerprints[0]]
    if differ:
        raise MemberParallelError(f"The ranks of a member-parallel model were given different inputs (rank "
                                  f"{differ[0]} differs from rank 0): every rank must run the same inputs.")


def gather_members(members: MemberGroup, local: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
    """``(n_local, ...)`` on each rank -> ``(N, ...)`` on every rank. Dims after the first may differ across
    ranks (generated lengths): each rank's part is padded to the largest with ``pad_value``."""
    sizes = torch.tensor([*local.shape], dtype=torch.int64, device=local.device)
    shapes = [torch.empty_like(sizes) for _ in range(members.world_size)]
    dist.all_gather(shapes, sizes, members.group)
    biggest = torch.stack(shapes).amax(0).tolist()
    padded = local.new_full(biggest, pad_value)
    padded[tuple(slice(0, s) for s in local.shape)] = local
    parts = [torch.empty_like(padded) for _ in range(members.world_size)]
    dist.all_gather(parts, padded.contiguous(), members.group)
    return torch.cat([part[: len(members.slices[r])] for r, part in enumerate(parts)])


def _walk(value: Any, visit: Callable, rebuild: bool = False) -> Any:
    """Visit the tensors of outputs (tuples, lists, dicts, ``ModelOutput``s) in a fixed order; with ``rebuild``,
    put back what ``visit`` returns (``ModelOutput``s updated in place, as :func:`hf_wide.unfold.unfold_outputs`)."""
    if isinstance(value, torch.Tensor):
        result = visit(value)
        return result if rebuild else value
    if isinstance(value, dict):
        for key, item in value.items():
            new = _walk(item, visit, rebuild)
            if rebuild:
                value[key] = new
        return value
    if isinstance(value, (tuple, list)):
        items = [_walk(item, visit, rebuild) for item in value]
        return type(value)(items) if rebuild else value
    return value


def _fingerprint(inputs: tuple[tuple, dict]) -> tuple:
    """A cheap summary of a call's tensor inputs (shapes, and two sums that a reordering changes)."""
    args, kwargs = inputs
    summary = []
    for key, value in [*enumerate(args), *sorted(kwargs.items())]:
        tensor = getattr(value, "tensor", value)  # PerMember wraps its tensor
        if isinstance(tensor, torch.Tensor):
            flat = tensor.detach().reshape(-1).double()
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) % 97
            summary.append((key, tuple(tensor.shape), round(float(flat.sum()), 6), round(float(flat @ weights), 6)))
        elif isinstance(value, (bool, int, float, str)) or value is None:
            summary.append((key, value))
    return tuple(summary)


def local_inputs(group, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A member-parallel rank's inputs: ``PerMember`` tensors cut to its own members' rows."""
    def cut(value):
        return PerMember(value.tensor[group.local.start:group.local.stop]) if isinstance(value, PerMember) else value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
