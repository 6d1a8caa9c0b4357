"""Each member's router logits and load-balancing loss from a wide mixture of experts (``output_router_logits``).

transformers' MoE models, asked for router logits (``output_router_logits=True``, by argument or by their config),
record each layer's with forward hooks on its router and compute an auxiliary load-balancing loss from them:
``load_balancing_loss_func`` of the model's own module, over every token the routers saw, added to the loss when
there are labels. In a wide model the routers see every member's tokens, N*B*T rows, member-major:

- the hooks go on the wide routers (:mod:`hf_wide.capture`), which record every member's rows;
- while a wide forward that asked for them runs, the module's ``load_balancing_loss_func`` is called once per
  member, on that member's rows of every layer's logits and of the attention mask: ``aux_loss`` is ``(N,)``, and
  with labels the model's own ``loss += coef * aux_loss`` gives member i ``ce_i + coef * aux_i``, its own loss.
  The function is replaced in its module the first time a wide forward asks (:func:`splitting_balancing_losses`);
  everywhere else (a model that is not wide, another thread) it is transformers' own;
- each layer's router logits come back ``(N, B*T, E)``: member i's are what checkpoint i alone returns.

A loss computed some other way (Switch Transformers' router z-loss, say) comes out as one number over every member's
tokens, and is refused by :func:`hf_wide.losses.member_loss_outputs`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading

import torch
from torch import nn

from .fold import Fold, in_member_code

ROUTER_OUTPUTS = "router_logits"  # the ModelOutput keys that hold them end so (encoder_router_logits, ...)
_active = threading.local()  # ``fold``: of the wide forward this thread runs, while it asks for router logits
_install_lock = threading.Lock()


def asks_for_router_logits(kwargs: dict, config) -> bool:
    """Whether a forward with ``kwargs`` records router logits (by argument, or by the model's config)."""
    return bool(kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)))


class MemberBalancingLoss:
    """A modeling module's ``load_balancing_loss_func`` that, inside a wide forward asking for router logits,
    returns each member's loss on its own rows, ``(N,)``; elsewhere, the function itself."""

    def __init__(self, function):
        self.function = function
        self.signature = inspect.signature(function)

    def __call__(self, *args, **kwargs):
        fold: Fold | None = getattr(_active, "fold", None)
        bound = self.signature.bind(*args, **kwargs)
        layers = bound.arguments.get("gate_logits")
        if fold is None or fold.rows is None or in_member_code() or not isinstance(layers, tuple) or not layers:
            return self.function(*args, **kwargs)
        n, rows = fold.num_members, fold.rows
        if any(t.shape[0] % rows for t in layers):  # N*B*T flattened tokens, member-major, in every layer
            raise ValueError(f"Router logits of {[t.shape[0] for t in layers]} rows do not split into the "
                             f"{rows} rows of {n} members.")
        mask = bound.arguments.get("attention_mask")
        losses = []
        for m in range(n):
            bound.arguments["gate_logits"] = tuple(t.view(n, -1, *t.shape[1:])[m] for t in layers)
            if isinstance(mask, torch.Tensor) and mask.shape[0] == rows:
                bound.arguments["attention_mask"] = mask.view(n, -1, *mask.shape[1:])[m]
            losses.append(self.function(*bound.args, **bound.kwargs))
        return torch.stack(losses)


def _install(model: nn.Module) -> bool:
    """Put a :class:`MemberBalancingLoss` in place of the ``load_balancing_loss_func`` of ``model``'s modeling
    module (once per module); False where it has none that takes ``gate_logits``."""
    module = sys.modules.get(type(model).__module__)
    function = getattr(module, "load_balancing_loss_func", None)
    if isinstance(function, MemberBalancingLoss):
        return True
    if not callable(function) or "gate_logits" not in inspect.signature(function).parameters:
        return False
    with _install_lock:
        if not isinstance(module.load_balancing_loss_func, MemberBalancingLoss):
            module.load_balancing_loss_func = MemberBalancingLoss(function)
    return True


@contextlib.contextmanager
def splitting_balancing_losses(model: nn.Module, fold: Fold):
    """For one wide forward (or ``generate``) asking for router logits: ``model``'s load-balancing loss, each
    member's."""
    _install(model)
    outer, _active.fold = getattr(_active, "fold", None), fold
    try:
        yield
    finally:
        _active.fold = outer


def member_router_logits(outputs, num_members: int) -> list[torch.Tensor]:
    """Give each layer's router logits in ``outputs`` (a ModelOutput) a member dim, ``(N*B*T, E) -> (N, B*T, E)``, in
    place; returns them (to keep from the unfolding of the other outputs)."""
    kept = []
    if not isinstance(outputs, dict):
        return kept
    for key, value in outputs.items():
        if key.endswith(ROUTER_OUTPUTS) and isinstance(value, tuple):
            value = tuple(t.view(num_members, -1, *t.shape[1:]) if isinstance(t, torch.Tensor) and t.dim()
                          and t.shape[0] % num_members == 0 else t for t in value)
            outputs[key] = value
            kept.extend(t for t in value if isinstance(t, torch.Tensor))
    return kept


def replace_router_logits(outputs, replace) -> object:
    """``outputs`` with each layer's router logits ``t`` replaced by ``replace(t)`` (a member-parallel rank's by
    every rank's)."""
    if isinstance(outputs, dict):
        for key, value in outputs.items():
            if key.endswith(ROUTER_OUTPUTS) and isinstance(value, tuple):
                outputs[key] = tuple(replace(t) if isinstance(t, torch.Tensor) else t for t in value)
    return outputs
