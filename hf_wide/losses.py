"""Each member's loss: ``wide(**inputs, labels=y).loss`` is ``(N,)``, member i's equal to checkpoint i's alone.

A head given labels computes its loss on what it sees: the wide forward's N*B rows, member-major. Reduced over
them, it is one number that is no member's loss (for a mean, the members' mean). transformers' heads compute
it through the model's ``loss_function`` (causal LM, sequence and token classification, question answering):
:class:`MemberLosses` stands in for that function on the folded model, and calls it once per member on that
member's rows. A head that computes its loss in its own code (``CrossEntropyLoss()(...)`` inline, as BERT's
classifiers do) cannot be split after the fact: :func:`member_losses` refuses the mixed number with an error
that says how to get each member's.

For training the members together, ``loss.sum()`` (or ``.mean()``) is the joint objective: each member's
gradient is its own loss's.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from .fold import Fold

LABEL_ARGUMENTS = frozenset({"labels", "start_positions", "end_positions", "next_sentence_label",
                             "sentence_order_label", "mc_labels"})  # what transformers' heads compute losses from


class MemberLosses:
    """A model's ``loss_function`` that, inside a wide forward, returns each member's loss on its own rows,
    ``(N,)``; outside one (a member taken out of the wide model), the function itself."""

    def __init__(self, loss_function, fold: Fold, own=None):
        self.loss_function = loss_function
        self.fold = fold
        self.own = own  # the model's own ``_loss_function``, if it had one (given back to a member taken out)
        self._made = threading.local()  # the last loss this thread made, to find it among the outputs

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        rows, n = self.fold.rows, self.fold.num_members
        if rows is None:
            return self.loss_function(*args, **kwargs)
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0]
        leading = tensors[0].shape[0]  # N*B rows, or N*B*T flattened tokens: member-major either way
        if leading % n:
            raise ValueError(f"A loss over {leading} rows cannot be split into {n} members' rows.")
        block = leading // n

        def part(value, m):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == leading:
                return value[m * block : (m + 1) * block]
            return value

        losses = torch.stack([self.loss_function(*(part(a, m) for a in args), **{k: part(v, m) for k, v in
                                                                                kwargs.items()}) for m in range(n)])
        self._made.loss = losses  # (N,)
        return losses

    def take(self) -> torch.Tensor | None:
        """The loss this thread's forward made (once), or None."""
        loss, self._made.loss = getattr(self._made, "loss", None), None
        return loss

    def __deepcopy__(self, memo) -> "MemberLosses":  # the copy's fold: the copied model's (memo), or a new one
        return MemberLosses(self.loss_function, copy.deepcopy(self.fold, memo), self.own)


def install_member_losses(model: nn.Module, fold: Fold) -> MemberLosses | None:
    """Put a :class:`MemberLosses` in place of ``model``'s transformers ``loss_function``, where it has one."""
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return None
    losses = MemberLosses(model.loss_function, fold, own=model.__dict__.get("_loss_function"))
    model.loss_function = losses
    return losses


def uninstall_member_losses(module: nn.Module) -> None:
    """Give a member taken out of the wide model its own loss function back."""
    losses = module.__dict__.get("_loss_function")
    if isinstance(losses, MemberLosses):
        if losses.own is None:
            del module._loss_function
        else:
            module._loss_function = losses.own


def check_losses(outputs, made: torch.Tensor | None, kwargs: dict) -> None:
    """Refuse a loss the model computed over every member's rows at once (a head's own code): one number
    mixing the members, which a caller would take for the ensemble's or a member's."""
    if isinstance(outputs, dict):
        for key, value in outputs.items():
            if "loss" in key and isinstance(value, torch.Tensor) and value is not made:
                raise ValueError(
                    f"The model computed {key!r} over all members' rows at once (its own code, not transformers' "
                    "loss_function, which hf-wide splits by member): one number mixing the members. Call the wide "
                    "model without labels and compute each member's loss from its outputs (out.logits[i]).")
    elif made is None and not LABEL_ARGUMENTS.isdisjoint(kwargs):  # a tuple: its loss, if any, has no name
        raise ValueError("This model computes its loss in its own code (not transformers' loss_function, which "
                         "hf-wide splits by member), over all members' rows at once: one number mixing the members. "
                         "Call the wide model without labels and compute each member's loss from its outputs.")


def replace_loss(outputs, loss: torch.Tensor, new: torch.Tensor):
    """``outputs`` with ``loss`` (a rank's members' losses) replaced by ``new`` (every rank's)."""
    if isinstance(outputs, dict):
        for key, value in outputs.items():
            if value is loss:
                outputs[key] = new
        return outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(new if value is loss else value for value in outputs)
    return outputs
