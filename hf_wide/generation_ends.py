"""Members done early where nothing pads them.

transformers pads a row that is done (its stopping criteria said so) with the pad token only when an
end-of-sequence token is among the criteria. Without one (``eos_token_id=None``, stopping on ``stop_strings`` or on
the user's ``stopping_criteria``), a row that is done goes on with real tokens while the batch's other rows run. Alone,
a member stops when its own rows are done; in a wide model's generate its rows went on with the other members', and
its sequences held tokens past its own end that it never generates alone. So the rows' ends are recorded from the
criteria transformers calls, and each member's sequences are padded past the step its last row was done at, as a
member done early is padded where an end-of-sequence token ends it.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from transformers import StoppingCriteriaList

_CALL = threading.local()  # .ends: the RowEnds of the wide generate this thread runs, else None


class RowEnds:
    """One generate's rows: the sequence length at which each was first done (-1: not yet)."""

    def __init__(self, model: nn.Module, outer: RowEnds | None = None):
        self.model = model  # the model whose generate it records (not a member(i) copy's, run inside a criterion)
        self.at: torch.Tensor | None = None  # (rows,) long
        self.padded = True  # whether transformers pads the rows that are done itself (an end-of-sequence criterion)
        self.outer = outer  # an outer generate's, this thread's

    def record(self, done: torch.Tensor, length: int) -> None:
        if self.at is None or self.at.shape != done.shape:
            self.at = torch.full(done.shape, -1, dtype=torch.long, device=done.device)
        self.at = torch.where(done & (self.at < 0), length, self.at)

    def pad_members(self, sequences: torch.Tensor, n: int, pad: int) -> None:
        """Pad, in place, each member's rows of ``sequences`` (N*R, T), member-major, past the length its last row
        was done at. Nothing where transformers padded them itself, or where the rows recorded are not these."""
        if self.padded or self.at is None or self.at.shape[0] != sequences.shape[0]:
            return
        at = self.at.view(n, -1)  # (N, R)
        length = sequences.shape[-1]
        end = torch.where((at >= 0).all(dim=1), at.max(dim=1).values, length)  # (N,)
        past = torch.arange(length, device=sequences.device) >= end.unsqueeze(1)  # (N, T)
        sequences.view(n, -1, length).masked_fill_(past.unsqueeze(1), pad)


class _Recording(StoppingCriteriaList):
    """transformers' stopping criteria of one generate, its answers recorded in ``ends``."""

    def __init__(self, criteria: StoppingCriteriaList, ends: RowEnds):
        super().__init__(criteria)
        self.ends = ends
        ends.padded = any(hasattr(c, "eos_token_id") for c in criteria)  # as transformers' _sample decides it

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = super().__call__(input_ids, scores, **kwargs)
        self.ends.record(done, input_ids.shape[-1])
        return done


class RecordRowEnds:
    """The model's ``_get_stopping_criteria``, its criteria recorded while this thread runs a wide model's generate
    (inert otherwise: ``wide.member(i)``'s copy keeps it)."""

    def __init__(self, get):
        self.get = get  # the model's own, bound

    def __call__(self, *args, **kwargs) -> StoppingCriteriaList:
        criteria = self.get(*args, **kwargs)
        ends = getattr(_CALL, "ends", None)
        mine = ends is not None and ends.model is getattr(self.get, "__self__", None)
        return _Recording(criteria, ends) if mine else criteria


def record_row_ends(model: nn.Module) -> RowEnds:
    """Install :class:`RecordRowEnds` on the model transformers' generate runs (once), and start recording this
    thread's next generate; :func:`stop_recording` ends it."""
    generator = next((m for m in model.modules() if hasattr(type(m), "_get_stopping_criteria")), None)
    if generator is not None and not isinstance(generator.__dict__.get("_get_stopping_criteria"), RecordRowEnds):
        generator._get_stopping_criteria = RecordRowEnds(generator._get_stopping_criteria)
    _CALL.ends = RowEnds(generator, getattr(_CALL, "ends", None))
    return _CALL.ends


def stop_recording(ends: RowEnds) -> None:
    _CALL.ends = ends.outer
