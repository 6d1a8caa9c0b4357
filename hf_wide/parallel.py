"""Member parallelism: an ensemble larger than one device, split by member over ``torch.distributed`` ranks.

    # torchrun --nproc-per-node K script.py
    dist.init_process_group()                                     # gloo on CPU, nccl on GPU
    wide = WideModel.from_pretrained(ids, member_parallel=True)   # rank r loads and fuses only its members
    wide(**inputs).logits.shape                                   # (N, B, C) on every rank

Rank r holds a contiguous slice of the members (:func:`member_slices`: as even as possible), fused as an
ordinary wide model. A forward runs the local slice and all-gathers every per-member output, so every rank
returns all N members' outputs, in member order: no activation crosses ranks inside a forward, only the outputs
at its end. Every rank must pass the same inputs; a cheap fingerprint of them travels with the outputs'
shapes, and ranks that disagree raise (all of them, with the same message) rather than return a mix.
Caches (``past_key_values``) stay on their rank: each holds the keys and values of its own members. What every
call does across the ranks is :mod:`hf_wide.parallel_calls`.

Loading is collective too: each rank reports success or its error, and a rank that failed makes every rank
raise, naming it, instead of leaving the others waiting in a collective. (A rank that dies outright is
noticed by the process group's own ``timeout``, set with ``init_process_group(timeout=...)``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


class MemberParallelError(RuntimeError):
    """A rank of a member-parallel model failed, or the ranks disagree."""


@dataclasses.dataclass(frozen=True)
class MemberGroup:
    """The ranks sharing one member-parallel wide model: ``slices[r]`` are the (global) member indices that
    rank r holds. ``group`` is the process group (None: the default one)."""

    rank: int
    slices: tuple[range, ...]
    group: Any = None

    @property
    def world_size(self) -> int:
        return len(self.slices)

    @property
    def num_members(self) -> int:
        return self.slices[-1].stop

    @property
    def local(self) -> range:
        return self.slices[self.rank]

    def rank_of(self, member: int) -> int:
        return next(r for r, members in enumerate(self.slices) if member in members)


def member_slices(num_members: int, world_size: int) -> tuple[range, ...]:
    """Contiguous slices of ``range(num_members)`` over ``world_size`` ranks, sizes differing by at most one
    (the first ``num_members % world_size`` ranks hold one more)."""
    if world_size > num_members:
        raise ValueError(f"member_parallel over {world_size} ranks needs at least {world_size} members, got "
                         f"{num_members}: every rank must hold one. Launch at most {num_members} processes.")
    size, extra = divmod(num_members, world_size)
    bounds = [0]
    for r in range(world_size):
        bounds.append(bounds[-1] + size + (r < extra))
    return tuple(range(bounds[r], bounds[r + 1]) for r in range(world_size))


def init(backend: str | None = None, timeout: float | None = None) -> None:
    """Initialise ``torch.distributed`` for a member-parallel model launched by torchrun: nccl with each rank on
    the GPU of its local rank when CUDA is there, gloo otherwise; ``timeout`` (seconds) bounds every collective,
    so that a rank that died is noticed. Does nothing if already initialised."""
    import datetime
    import os

    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group(backend or ("nccl" if cuda else "gloo"), **options)


def member_group(num_members: int, group=None) -> MemberGroup:
    """The member split of the current process group (``torch.distributed`` must be initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("member_parallel=True needs torch.distributed: launch with torchrun and call "
                           "hf_wide.parallel.init() (or torch.distributed.init_process_group()) first.")
    return MemberGroup(dist.get_rank(group), member_slices(num_members, dist.get_world_size(group)), group)


def on_every_rank(members: MemberGroup, work: Callable[[], Any], what: str) -> Any:
    """``work()`` on every rank; if it raised on any rank, every rank raises, naming the ranks and their errors
    (the failing rank's own error chained)."""
    error: BaseException | None = None
    result = None
    try:
        result = work()
    except Exception as exc:  # reported to every rank, then raised
        error = exc
    failed = describe_failures(members, gather_reports(members, error))
    if failed is not None:
        raise MemberParallelError(f"{what} failed on {failed}") from error
    return result


def gather_reports(members: MemberGroup, error: Exception | None) -> list[str | None]:
    """Every rank's :func:`describe_error` of what its call raised (None: nothing), in rank order."""
    reports = [None] * members.world_size
    dist.all_gather_object(reports, describe_error(error), members.group)
    return reports


def describe_failures(members: MemberGroup, reports: list[str | None]) -> str | None:
    """The ranks whose ``reports`` hold an error, as errors name them (``1 of 2 ranks: rank 1 (member 2): ...``),
    or None where none does."""
    failed = [(r, report) for r, report in enumerate(reports) if report is not None]
    if not failed:
        return None
    detail = "; ".join(f"rank {r} ({describe_members(members.slices[r])}): {report}" for r, report in failed)
    return f"{len(failed)} of {members.world_size} ranks: {detail}"


def load_member_slice(num_members: int, load: Callable[[range], Any], allow_label_mismatch: bool = False):
    """``WideModel.from_pretrained(..., member_parallel=True)`` on this rank: ``load(members)`` of its slice (on
    every rank, failures reported to all), then what the whole ensemble needs on every rank (ids, commits,
    configs), and a check that every rank's members share one architecture."""
    members = member_group(num_members)
    wide = on_every_rank(members, lambda: load(members.local),
                         f"Loading {num_members} members over {members.world_size} ranks")
    return attach(wide, members, allow_label_mismatch)


def attach(wide, members: MemberGroup, allow_label_mismatch: bool = False):
    """Make ``wide`` (this rank's members, fused) the rank's part of a member-parallel model: it learns every
    member's id, commit and config, and checks (on every rank alike) that all ranks' members match."""
    from .compat import check_configs

    wide.member_ids = all_slices(members, wide.member_ids)
    wide.member_revisions = all_slices(members, wide.member_revisions)
    if wide.member_subfolders is not None:  # (given to every rank alike)
        wide.member_subfolders = all_slices(members, wide.member_subfolders)
    configs = all_slices(members, wide.member_configs or [wide.config] * len(members.local))
    first = [members.slices[r].start for r in range(members.world_size)]
    for i in first[1:]:  # each rank fused its own members; across ranks, they must agree as well
        check_configs(configs[0], configs[i], f"member 0 ({wide.member_ids[0]})", f"member {i} ({wide.member_ids[i]})",
                      allow_label_mismatch)
    if wide.member_configs is not None:
        wide.member_configs = configs
    if wide.member_generation_configs is not None:
        wide.member_generation_configs = all_slices(members, wide.member_generation_configs)
    if wide.member_peft_configs is not None:
        wide.member_peft_configs = all_slices(members, wide.member_peft_configs)
    full = all_slices(members, [j in wide.full_members for j in range(len(members.local))])
    wide.full_members = frozenset(i for i, is_full in enumerate(full) if is_full)
    wide.members_group = members
    return wide


def agree_to_save(members: MemberGroup, plan, first: dict[str, torch.Tensor], local_shared: list[str]) -> list[str]:
    """Before a member-parallel model writes one fused repo: the names whose tensor is the same in all N members
    (``first``: this rank's first member's tensors; ``local_shared``: the same in all of this rank's), and a check
    that every rank fused its members the same way (one plan to write)."""
    import hashlib

    from .saving import plan_to_dict

    digests = {k: hashlib.sha256(first[k].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
               for k in local_shared}
    layout = plan_to_dict(dataclasses.replace(plan, num_members=0))
    reports = [None] * members.world_size
    dist.all_gather_object(reports, (digests, layout), members.group)
    differ = [r for r, (_, other) in enumerate(reports) if other != reports[0][1]]
    if differ:
        raise MemberParallelError(
            f"Rank {differ[0]} fused its members differently from rank 0, so no one plan describes them all: load "
            "with share_identical=False (the member-parallel default) to save a fused repo from the ranks.")
    on_zero = reports[0][0]
    return [k for k in first if k in on_zero and all(d.get(k) == on_zero[k] for d, _ in reports)]


def from_rank_zero(members: MemberGroup, work: Callable[[], Any], what: str) -> Any:
    """``work()`` on rank 0 only (talking to the Hub, say); its result on every rank, its failure raised on all."""
    result = on_every_rank(members, lambda: work() if members.rank == 0 else None, what)
    box = [result]
    dist.broadcast_object_list(box, src=dist.get_global_rank(members.group, 0) if members.group else 0,
                               group=members.group)
    return box[0]


def shared_seed(members: MemberGroup) -> int:
    """A fresh random seed, rank 0's, on every rank: sampling that must choose the same tokens everywhere."""
    box = [torch.seed() if members.rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(members.group, 0) if members.group else 0,
                               group=members.group)
    return box[0]


def all_slices(members: MemberGroup, local: Sequence) -> list:
    """Every rank's ``local`` list (one entry per local member), concatenated in member order."""
    gathered = [None] * members.world_size
    dist.all_gather_object(gathered, list(local), members.group)
    return [item for part in gathered for item in part]


def describe_error(error: Exception | None) -> str | None:
    """What a rank reports of its error to the others (None: it had none)."""
    return None if error is None else f"{type(error).__name__}: {error}"


def describe_members(members: range) -> str:
    """A rank's members, as an error names them."""
    return f"member {members.start}" if len(members) == 1 else f"members {members.start}-{members.stop - 1}"
