"""The rows of a multiple-choice head's encoder: ``(N*B, C, T)`` choices flattened into N*B*C rows.

A wide module expands a broadcast input (BERT's ``position_ids``, ``(1, T)``) to the rows of the forward in flight
(:class:`~hf_wide.fold.Fold`): the N*B of the user's batch. A multiple-choice head calls its encoder on the choices
flattened into its rows, and GPT's double heads give their decoder the choices to flatten: within that call the rows
are N*B*C. These hooks say so for the length of the call.
"""

from __future__ import annotations

import torch

from .fold import Fold


class ChoiceRows:
    """Hooks on the encoder of a multiple-choice head, which its head calls on the choices flattened into the rows:
    ``(N*B, C, T)`` inputs as N*B*C rows. Within that call the forward's rows are its input's, for its wide modules
    to expand broadcasts by (BERT's ``position_ids``, ``(1, T)``); after it, the head's again. A forward pre-hook
    (``enter``) and a forward hook called also on an exception (``leave``)."""

    def __init__(self, fold: Fold):
        self.fold = fold

    def enter(self, module, args, kwargs):
        calls = self.fold._calls.state
        calls.outer.append(calls.anchor)
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if calls.anchor is not None and first is not None:  # (outside a wide forward, nothing to follow)
            calls.anchor = first.new_empty(self.rows(first, args, kwargs), 0)
        return None

    def rows(self, first: torch.Tensor, args: tuple, kwargs: dict) -> int:
        """The rows of the encoder's call: its first input's (the head has flattened the choices into them)."""
        return first.shape[0]

    def leave(self, module, args, kwargs, output):
        calls = self.fold._calls.state
        if calls.outer:
            calls.anchor = calls.outer.pop()
        return None


class FlattenedChoiceRows(ChoiceRows):
    """:class:`ChoiceRows` of a model that takes the choices to its decoder unflattened, ``(N*B, C, T)``, and
    flattens them there (GPT-2's and GPT's ``*DoubleHeadsModel``): its rows are every dim's but the tokens'."""

    def rows(self, first: torch.Tensor, args: tuple, kwargs: dict) -> int:
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
        if ids is not None:
            return ids.shape[:-1].numel()  # (N*B, C, T) ids
        embeds = kwargs.get("inputs_embeds")
        return embeds.shape[:-2].numel() if embeds is not None else first.shape[0]  # (N*B, C, T, D)


def install_choice_rows(model, fold: Fold) -> None:
    """:class:`ChoiceRows` on a multiple-choice head's encoder (transformers' ``*ForMultipleChoice``), and
    :class:`FlattenedChoiceRows` on a ``*DoubleHeadsModel``'s decoder."""
    encoder = getattr(model, "base_model", model)
    name = type(model).__name__
    if name.endswith(("ForMultipleChoice", "DoubleHeadsModel")) and encoder is not model:
        rows = ChoiceRows(fold) if name.endswith("ForMultipleChoice") else FlattenedChoiceRows(fold)
        encoder.register_forward_pre_hook(rows.enter, with_kwargs=True)
        encoder.register_forward_hook(rows.leave, with_kwargs=True, always_call=True)


def is_fold_hook(hook) -> bool:
    """Whether a module's hook is one a wide model put there: its fold's row recorder, or :class:`ChoiceRows`'."""
    return isinstance(hook, Fold) or isinstance(getattr(hook, "__self__", None), ChoiceRows)
