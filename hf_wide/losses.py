"""Each member's loss: ``wide(**inputs, labels=y).loss`` is ``(N,)``, member i's equal to checkpoint i's alone.

A head given labels computes its loss on what it sees: the wide forward's N*B rows, member-major. Reduced over
them, it is one number that is no member's loss (for a mean, the members' mean). So while a wide forward runs
with labels, the loss is split by member where it is computed:

- transformers' ``loss_function`` (causal LM, CTC, and the classification and question-answering heads that use
  it): :class:`MemberLosses` stands in for it on the folded model and calls it once per member, on that member's
  rows;
- a head's own loss method that lays the rows out in another order than member-major before reducing them
  (ProphetNet's ``_compute_loss`` puts its n-gram streams first, then averages a smoothing term over every row):
  :data:`LOSS_METHODS`, split by member before it runs, as ``loss_function`` is;
- a loss a head computes in its own code (``CrossEntropyLoss()(logits.view(-1, C), labels.view(-1))``, as BERT's
  classifiers do): :class:`SplitLosses`, a ``TorchFunctionMode`` active for that forward only, runs each of
  ``torch.nn.functional``'s reducing losses once per member on its block of the rows (``input`` and ``target``
  split along their first dim, N*B rows or N*B*T flattened tokens: member-major either way). What the head does
  with the N losses after that (a sum of two, a division) is elementwise.

A loss that still comes out as one number (reduced over the members by code that neither covers), with labels
or without (an auxiliary loss), is refused with an error, not returned. For training the members together, ``loss.sum()`` is the joint objective: each member's
gradient is its own loss's.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .fold import Fold, enter_member_code, in_member_code, leave_member_code
from .routers import splitting_balancing_losses

LABEL_ARGUMENTS = frozenset({"labels", "start_positions", "end_positions", "next_sentence_label",
                             "sentence_order_label", "mc_labels"})  # what transformers' heads compute losses from
# torch.nn.functional's losses of (input, target) with the batch first, which reduce it unless reduction="none"
REDUCING_LOSSES = frozenset(getattr(F, name) for name in (
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "soft_margin_loss",
    "multilabel_soft_margin_loss", "multilabel_margin_loss", "multi_margin_loss", "hinge_embedding_loss"))


# Heads whose own loss method the split cannot reach inside (its rows reordered first): class name -> method, which
# takes the wide forward's N*B rows, member-major, and is called once per member on its rows
LOSS_METHODS = {"ProphetNetForConditionalGeneration": "_compute_loss", "ProphetNetForCausalLM": "_compute_loss"}


def _split_calls(function, n: int, args: tuple, kwargs: dict, leading: int, rows=None) -> torch.Tensor:
    """``function`` once per member, on its block of every tensor with ``leading`` rows (that ``rows(tensor)``, where
    given, says carries them); the N results stacked."""
    block = leading // n

    def part(value, m):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == leading and (
                rows is None or rows(value)):
            return value[m * block : (m + 1) * block]
        return value

    outer = enter_member_code()
    try:
        return torch.stack([function(*(part(a, m) for a in args), **{k: part(v, m) for k, v in kwargs.items()})
                            for m in range(n)])
    finally:
        leave_member_code(outer)


class MemberLosses:
    """A model's ``loss_function`` that, inside a wide forward, returns each member's loss on its own rows,
    ``(N,)``; outside one (a member taken out of the wide model), the function itself."""

    def __init__(self, loss_function, fold: Fold, own=None):
        self.loss_function = loss_function
        self.fold = fold
        self.own = own  # the model's own ``_loss_function``, if it had one (given back to a member taken out)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        n = self.fold.num_members
        if self.fold.rows is None or in_member_code():
            return self.loss_function(*args, **kwargs)
        count = kwargs.get("num_items_in_batch")
        if isinstance(count, torch.Tensor) and count.numel() > 1:  # (each member's loss came back (N,): (N, N))
            raise ValueError(f"num_items_in_batch holds {count.numel()} numbers: it is one count, which every member's "
                             "loss is divided by. Give an int or a 0-dim tensor.")
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0]
        leading = tensors[0].shape[0]  # N*B rows, or N*B*T flattened tokens: member-major either way
        if not _member_major(leading, self.fold):
            raise ValueError(f"A loss over {leading} rows cannot be split into the {self.fold.rows} rows of "
                             f"{n} members.")
        return _split_calls(self.loss_function, n, args, kwargs, leading)

    def __deepcopy__(self, memo) -> "MemberLosses":  # the copy's fold: the copied model's (memo), or a new one
        # (a head's own method, a partial of its class's function and the module: the copied module's)
        return MemberLosses(copy.deepcopy(self.loss_function, memo), copy.deepcopy(self.fold, memo), self.own)


class SplitLosses(TorchFunctionMode):
    """For one wide forward given labels: every reducing loss of ``torch.nn.functional`` it calls, once per member
    on that member's rows, ``(N,)``."""

    def __init__(self, fold: Fold):
        super().__init__()
        self.fold = fold

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in REDUCING_LOSSES and kwargs.get("reduction", "mean") != "none" and len(args) >= 2 and \
                not in_member_code():
            x, target = args[0], args[1]
            if isinstance(x, torch.Tensor) and isinstance(target, torch.Tensor) and x.dim() and target.dim() and \
                    x.shape[0] == target.shape[0] and _member_major(x.shape[0], self.fold):
                # input and target carry the rows, and a weight broadcast to the input's shape (each element's);
                # one of other dims (cross_entropy's weight and BCE's pos_weight, a class's) is every member's whole,
                # as many as the rows or not (3 classes of 3 members' 1 row each were split among the members)
                return _split_calls(func, self.fold.num_members, args, kwargs, x.shape[0],
                                    rows=lambda t: t is x or t is target or t.dim() == x.dim())
        return func(*args, **kwargs)


def _member_major(leading: int, fold: Fold) -> bool:
    """Whether a leading dim of ``leading`` is the forward's N*B rows or its tokens flattened (a multiple of them):
    member-major, and so split into N equal blocks. Anything else (a time-major tensor's time) is not split."""
    rows = fold.rows
    return rows is not None and leading > 0 and leading % rows == 0


def install_member_losses(model: nn.Module, fold: Fold) -> MemberLosses | None:
    """Put a :class:`MemberLosses` in place of ``model``'s transformers ``loss_function``, where it has one, and of
    its own loss method (:data:`LOSS_METHODS`)."""
    method = next((LOSS_METHODS[c.__name__] for c in type(model).__mro__ if c.__name__ in LOSS_METHODS), None)
    if method is not None:
        function = getattr(type(model), method)
        model.__dict__[method] = MemberLosses(functools.partial(function, model), fold)
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return None
    losses = MemberLosses(model.loss_function, fold, own=model.__dict__.get("_loss_function"))
    model.loss_function = losses
    return losses


def uninstall_member_losses(module: nn.Module) -> None:
    """Give a member taken out of the wide model its own loss function (and loss method) back."""
    for name in {"_loss_function", *LOSS_METHODS.values()}:
        losses = module.__dict__.get(name)
        if isinstance(losses, MemberLosses):
            if losses.own is None:
                del module.__dict__[name]
            else:
                module.__dict__[name] = losses.own


def member_loss_outputs(outputs, num_members: int, labelled: bool) -> tuple[object, list[torch.Tensor]]:
    """``outputs`` of a wide forward, and those of them that hold each member's loss, ``(N,)`` (to keep as they
    are: at B=1 they have the N*B rows that other outputs are unfolded from). With one member, its loss is made
    ``(1,)``. Refuses a loss that came out as one number for several members (with or without labels: an
    auxiliary or contrastive loss too): reduced over every member's rows by code the split does not reach, it
    mixes the members."""
    if isinstance(outputs, (tuple, list)) and outputs and labelled:
        keys = [0]  # transformers puts the loss first when labels are given
    elif isinstance(outputs, dict):
        keys = [key for key in outputs if "loss" in key]
    else:
        return outputs, []
    kept = []
    for key in keys:
        value = outputs[key]
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0 and num_members == 1:
            value = value.reshape(1)
            if isinstance(outputs, dict):
                outputs[key] = value
            else:
                outputs = type(outputs)((value, *outputs[1:]))
        if value.dim() == 0:
            raise ValueError(
                f"The model reduced {'the loss' if key == 0 else repr(key)} over all members' rows at once, by code "
                "that hf-wide does not split by member: one number mixing the members. Call the wide model without "
                "what makes it compute one (labels, return_loss, a masked image model's bool_masked_pos, ...) and "
                "compute each member's from its outputs (out.logits[i]), or run the members alone (wide.member(i)).")
        if tuple(value.shape) == (num_members,):
            kept.append(value)
    return outputs, kept


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


@contextlib.contextmanager
def member_losses(model: nn.Module, fold: Fold, labelled: bool, routed: bool):
    """For one wide forward, what splits its losses by member: the reducing losses given labels
    (:class:`SplitLosses`), the load-balancing losses of routers asked for their logits (:mod:`hf_wide.routers`)."""
    with SplitLosses(fold) if labelled else contextlib.nullcontext(), \
            splitting_balancing_losses(model, fold) if routed else contextlib.nullcontext():
        yield
