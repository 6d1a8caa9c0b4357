"""Folding N members into the batch.

The wide model runs the template's own forward on a batch that holds every member, member-major:
rows ``[m0b0 .. m0b(B-1), m1b0, ...]``, i.e. the ``(N, B, ...)`` layout flattened to ``(N*B, ...)``.
This module holds the bookkeeping for that layout:

- :class:`Fold` is shared by every wide module of one model. It knows N and, during a forward, the
  number of rows, so a wide module fed a tensor with a leading dim of 1 (a broadcast input such as
  BERT's ``position_ids`` of shape ``(1, T)``) can still produce all ``N*B`` rows. The rows are per-call
  state: each thread sees only those of its own forward, so one wide model serves several threads.
- :class:`~hf_wide.inputs.PerMember` marks an input that already has a leading member dim ``(N, B, ...)``.
- :func:`~hf_wide.inputs.fold_inputs` / :func:`~hf_wide.unfold.unfold_outputs` move between the user's ``(B, ...)``
  / ``(N, B, ...)`` tensors and the folded ``(N*B, ...)`` rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch


class _CallState:
    """One thread's state of one wide model's calls."""

    def __init__(self):
        self.anchor: torch.Tensor | None = None
        self.recording = False
        self.outer: list[torch.Tensor | None] = []  # the rows around each call of an inner model (ChoiceRows)


class _Calls(threading.local):
    """Each thread's :class:`_CallState`. ``threading.local`` runs ``__init__`` anew in every thread that reads it.
    The state is an object of its own, not the local's attributes: dynamo drops what compiled code sets on a
    ``threading.local`` at a graph break (the code after the break read no rows: XLM, whose forward breaks the
    graph at ``.item()``, failed to compile), and keeps what it sets on a plain object."""

    def __init__(self):
        self.state = _CallState()


@dataclasses.dataclass
class Fold:
    """N, and the rows of the forward in flight in this thread. Also the forward pre-hook that records them.

    The rows are held as the shape of an empty ``(N*B, 0)`` tensor, not as an int: ``torch.compile``
    would bake an int attribute into its guards and recompile for every batch size, while a tensor's
    size stays symbolic. They live in a ``threading.local`` (which dynamo reads without a graph break):
    two threads in one wide model each fold their own batch.
    """

    num_members: int
    _calls: _Calls = dataclasses.field(default_factory=_Calls, init=False, repr=False, compare=False)
    # Set by ``WideModel.compile(dynamic=False)``: compiled graphs have fixed shapes, so vectorised modules keep vmap
    # (hf_wide.primitives.vectorised); not copied, as a copy of a compiled model is not compiled
    compiled_static: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    @property
    def anchor(self) -> torch.Tensor | None:
        """(N*B, 0) during a forward in this thread, else None."""
        return self._calls.state.anchor

    @anchor.setter
    def anchor(self, value: torch.Tensor | None) -> None:
        self._calls.state.anchor = value

    @property
    def recording(self) -> bool:
        """Whether the pre-hook records rows in this thread (during ``generate``, whose forwards it calls)."""
        return self._calls.state.recording

    @recording.setter
    def recording(self, value: bool) -> None:
        self._calls.state.recording = value

    @contextlib.contextmanager
    def rows_of(self, x: torch.Tensor) -> Iterator[None]:
        """``x``'s rows as the forward's within the block: for a model that runs a part of it on an input with a
        batch of its own (CLIP's image tower on its N*B' images, beside its N*B texts: :mod:`hf_wide.rewrites`),
        whose wide modules expand broadcasts and split members by the forward's rows."""
        before = self.anchor
        self.anchor = x.new_empty(x.shape[0], 0)
        try:
            yield
        finally:
            self.anchor = before

    def __deepcopy__(self, memo) -> "Fold":
        return Fold(self.num_members)  # per-call state is never copied

    def __getstate__(self) -> dict:
        return {"num_members": self.num_members}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["num_members"])

    @property
    def rows(self) -> int | None:
        return None if self.anchor is None else self.anchor.shape[0]

    @property
    def batch(self) -> int | None:
        return None if self.anchor is None else self.anchor.shape[0] // self.num_members

    def reset(self) -> None:
        self.anchor = None
        self.recording = False
        self._calls.state.outer.clear()

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(N*B, *rest) -> (N, B, *rest); a broadcast (1, *rest) -> (N, 1, *rest) without a copy."""
        n = self.num_members
        if x.shape[0] == 1 and n > 1:  # N*B rows are at least N: one row is a broadcast
            return x.unsqueeze(0).expand(n, *x.shape)
        if x.shape[0] % n:
            raise RuntimeError(
                f"A wide module got {x.shape[0]} rows, which do not split into {n} members: only inputs "
                f"with all N*B rows (member-major) or a broadcast leading dim of 1 can be folded."
            )
        return x.view(n, x.shape[0] // n, *x.shape[1:])  # splitting one dim is always a view

    def merge(self, y: torch.Tensor, batch: int | None = None) -> torch.Tensor:
        """(N, b, *rest) -> (N*B, *rest), expanding a broadcast b == 1 to the B rows of the forward (or ``batch``)."""
        batch = self.batch if batch is None else batch
        if y.shape[1] == 1 and batch is not None:  # only a broadcast needs the batch size
            y = y.expand(y.shape[0], batch, *y.shape[2:])
        return y.reshape(-1, *y.shape[2:])

    def __call__(self, module, args, kwargs):
        """Forward pre-hook on the folded model, installed once: while this thread is in ``generate``
        (``recording``), record the rows of each forward that ``generate`` makes."""
        if not self.recording:
            return None
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                self.anchor = value.new_empty(value.shape[0], 0)
                break
        return None


class _MemberCode(threading.local):
    """``inside``: this thread runs one member's own code (see in_member_code). Set in every thread as it first reads
    it: a compiled graph's guard on it then holds in a thread that never ran member code (one that read it missing
    compiled the forward again)."""

    def __init__(self):
        self.inside = False


_member_code = _MemberCode()


def in_member_code() -> bool:
    """Whether this thread runs one member's own code: a fallback's call of a member (its module, or its code over
    its tensors), or one member's part of a split loss. What splits a loss by member (hf_wide.losses,
    hf_wide.routers) leaves such code alone: its loss is already the member's."""
    return _member_code.inside


def enter_member_code() -> bool:
    """Mark this thread as running one member's own code; returns what to give :func:`leave_member_code`."""
    outer = _member_code.inside
    _member_code.inside = True
    return outer


def leave_member_code(outer: bool) -> None:
    _member_code.inside = outer
