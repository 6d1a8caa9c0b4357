"""One call of a wide model: the inputs folded into N*B rows, the members' forward (or a feature method such as
CLIP's ``get_text_features``) run once on them, and the outputs unfolded to ``(N, B, ...)``, with each member's
loss and router logits apart (:mod:`hf_wide.losses`, :mod:`hf_wide.routers`) and, members split over ranks,
gathered from every rank (:mod:`hf_wide.parallel`). ``WideModel.forward`` is this; under ``torch.compile`` it is
what the graph holds."""

from __future__ import annotations

import torch
from torch import nn
from transformers.utils import ModelOutput

from .adapters import PEFT_FORWARD_ARGS, without_peft_args
from .capture import asks_for_capture, require_recorded
from .fold import Fold
from .inputs import fold_inputs, other_batches
from .losses import LABEL_ARGUMENTS, member_loss_outputs, member_losses, replace_loss
from .parallel_calls import gather_members, gather_outputs, local_inputs
from .primitives import PerMemberFallback, VectorisedFallback
from .primitives.member_cache import contiguous_keys
from .routers import asks_for_router_logits, member_router_logits, replace_router_logits
from .training import check_training, needs_check
from .unfold import unfold_outputs


def run_members(wide, method: str | None, args: tuple, kwargs: dict):
    """The members' ``forward`` (``method`` None) or their ``method``, every member on the folded rows."""
    group = wide.members_group
    if group is None:
        outputs, as_tuple, _ = _run_here(wide, method, args, kwargs)
        return _as_asked(outputs, as_tuple)
    try:
        outputs, as_tuple, (unfolded, losses, routed) = _run_here(wide, method, args, kwargs)
    except Exception as error:  # told to every rank, which raise too: they wait for this one's outputs to gather
        gather_outputs(group, None, [], (args, kwargs), error)
        raise
    outputs = gather_outputs(group, outputs, unfolded, (args, kwargs))
    for loss in losses:
        outputs = replace_loss(outputs, loss, gather_members(group, loss))
    if routed:
        outputs = replace_router_logits(outputs, lambda t: gather_members(group, t))
    return _as_asked(outputs, as_tuple)


def _run_here(wide, method: str | None, args: tuple, kwargs: dict) -> tuple:
    """This process's members' outputs ``(n, B, ...)``, whether a tuple was asked for, and, members split over
    ranks, what is gathered from every rank: the tensors given a member dim, the members' losses and whether router
    logits were asked for."""
    if needs_check(wide):  # members that would not each train as alone: refused (hf_wide.training)
        check_training(wide)
    if (not wide._capture_hooks or wide._unrecorded) and asks_for_capture(kwargs, wide.config):
        wide._install_capture_hooks()
        require_recorded(wide._unrecorded, kwargs, wide.config)
    if wide._inner and not PEFT_FORWARD_ARGS.isdisjoint(kwargs):
        kwargs = without_peft_args(kwargs)
    # A tuple asked for (return_dict=False, or the config's) is the unfolded ModelOutput's, as transformers makes it
    # (``to_tuple``): unfolding reads the outputs' names (XLNet's time-major mems, each layer's flattened rows)
    as_tuple = method is None and kwargs.get("return_dict", getattr(wide.config, "return_dict", True)) is False
    if as_tuple:
        kwargs = {**kwargs, "return_dict": True}
    group = wide.members_group
    given = (args, kwargs)  # (before PerMember inputs are cut to the rank's)
    n = wide.fold.num_members
    args, kwargs, batch = fold_inputs(n, *(given if group is None else local_inputs(group, args, kwargs)),
                                      own_batches=wide.own_batches,
                                      whole=isinstance(wide.model, (VectorisedFallback, PerMemberFallback)))
    wide.fold.anchor = first_tensor((*args, *kwargs.values())).new_empty(n * batch, 0)
    labelled = not LABEL_ARGUMENTS.isdisjoint(kwargs)  # each member's loss, on its own rows
    routed = asks_for_router_logits(kwargs, wide.config)  # each member's router logits and balancing loss
    model = wide._called
    call = model if method is None else getattr(model, method)
    try:
        if method is None and ((labelled and n > 1) or routed):
            outputs = _split_by_member(model, wide.fold, n * batch, labelled and n > 1, routed, args, kwargs)
        else:
            outputs = call(*args, **kwargs)
    finally:
        wide.fold.reset()
    if torch.compiler.is_compiling():  # the cache's strides as every later step leaves them: one decoding graph
        contiguous_keys(outputs)
    losses, routers = (), ()
    if labelled or isinstance(outputs, dict):  # a ModelOutput's losses are checked, labels or not
        outputs, losses = member_loss_outputs(outputs, n, labelled)  # each (N,)
    if routed:
        routers = member_router_logits(outputs, n)  # each (N, B*T, E)
    unfolded = None if group is None else []  # the tensors given a member dim, which the ranks gather
    outputs = unfold_outputs(outputs, n, batch, (*losses, *routers), other_batches(given[1], batch), unfolded)
    return outputs, as_tuple, (unfolded, losses, routed)


def _as_asked(outputs, as_tuple: bool):
    return outputs.to_tuple() if as_tuple and isinstance(outputs, ModelOutput) else outputs


@torch.compiler.disable
def _split_by_member(model: nn.Module, fold: Fold, rows: int, labelled: bool, routed: bool, args: tuple,
                     kwargs: dict):
    """``model(*args, **kwargs)`` over ``rows`` folded rows, with each member's losses split by member
    (:func:`~hf_wide.losses.member_losses`), run eagerly under ``torch.compile``: the split is a
    ``TorchFunctionMode``, which compiled code entered inside does not apply (the loss came out reduced over every
    member's rows, and was refused). The fold's rows are set here again: set in compiled code, this thread's
    state did not hold them when the eager call ran."""
    fold.anchor = first_tensor((*args, *kwargs.values())).new_empty(rows, 0)
    with member_losses(model, fold, labelled, routed):
        return model(*args, **kwargs)


def first_tensor(output) -> torch.Tensor:
    """The first tensor of a model's output (a tensor, a ``ModelOutput`` or another dict, a tuple)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):  # ModelOutput is a dict
        return next(v for v in output.values() if isinstance(v, torch.Tensor))
    return next(v for v in output if isinstance(v, torch.Tensor))
