"""A vectorised module's code kept stateless: what a call leaves in its modules' plain attributes is taken back.

A :class:`~hf_wide.primitives.vectorised.VectorisedFallback` runs one copy of its source's code for every member, with
each member's tensors swapped in. Some modules keep what their forward derives from their tensors in plain
attributes, for the next call: LeViT's attentions cache their bias table in eval mode (``attention_bias_cache``). Run
as one code, member 0's call filled the cache and the other members read it (in a loop: member 1 took member 0's
biases; under vmap, a later call took the table an earlier one left, another member's or a batched one), so members
but one were off. :class:`FreshState` notes the copy's plain attributes as it is made (a dict of tensors emptied: a
cache that a member's forward filled before, at the trace), and puts back after every member's call (and every
vmapped one) what a call added or changed: each call starts from the source's own state.

Modules whose state must last from call to call (RecurrentGemma's recurrent state) run as each member's own module
(:data:`hf_wide.structure.STATEFUL`); nothing of theirs is here.

The other way round, what users set on the model's modules (their training flags, a dropout's probability, a
BatchNorm's momentum) reaches the registered copy of the structure, ``stacked``, and the code copy takes it from there
at every call (:func:`module_pairs`, :func:`take_settings`); a BatchNorm's statistics that a refused vmap updated are
put back (:func:`batchnorm_statistics`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

TRACKED = (dict, list, torch.Tensor)  # the plain attributes a call may leave state in (besides new ones)


class FreshState:
    """The plain attributes (not torch's own, whose names start with ``_``) of every submodule of ``module``, as they
    are now: :meth:`restore` puts them back. ``changed`` says whether a call ever changed any (that module keeps
    state: under ``torch.compile`` only such code is restored, apart from the graph)."""

    def __init__(self, module: nn.Module):
        self.entries = []
        self.changed = False
        for sub in empty_caches(module).modules():
            attrs = vars(sub)
            tracked = {k: [v, len(v) if isinstance(v, (dict, list)) else None, copy.copy(v)]
                       for k, v in attrs.items() if not k.startswith("_") and isinstance(v, TRACKED)}
            self.entries.append((sub, frozenset(attrs), tracked))
        # an empty dict, as a cache starts: restored under compilation from the first call on
        self.keeps_containers = any(isinstance(rec[2], dict) and not rec[2]
                                    for _, _, tracked in self.entries for rec in tracked.values())

    def restore(self) -> None:
        """Put back every plain attribute a call added, replaced or filled."""
        for sub, keys, tracked in self.entries:
            attrs = vars(sub)
            if len(attrs) != len(keys):  # attributes the call added
                for k in [k for k in attrs if k not in keys and not k.startswith("_")]:
                    del attrs[k]
                    self.changed = True
            for k, rec in tracked.items():
                current = attrs.get(k)
                if current is not rec[0] or (rec[1] is not None and len(current) != rec[1]):
                    rec[0] = attrs[k] = copy.copy(rec[2]) if rec[1] is not None else rec[2]
                    self.changed = True


def empty_caches(module: nn.Module) -> nn.Module:
    """``module`` with every plain dict of tensors in its submodules emptied, in place: a cache that the members'
    forwards filled before the copy was made (the trace ran member 0), member 0's, which every member would read."""
    for sub in module.modules():
        attrs = vars(sub)
        for k, v in list(attrs.items()):
            if not k.startswith("_") and isinstance(v, dict) and any(isinstance(t, torch.Tensor) for t in v.values()):
                attrs[k] = {}
    return module


@torch.compiler.disable
def restore_apart(state: FreshState) -> None:
    """:meth:`FreshState.restore`, outside a compiled graph (a graph break, for code that keeps state only)."""
    state.restore()


def module_pairs(code: nn.Module, structure: nn.Module) -> list[tuple[nn.Module, nn.Module, tuple[str, ...]]]:
    """Each module of a thread's code copy beside its place in ``stacked`` (the registered copy of the source's
    structure) and its :func:`_settings`, which with its training flag the code copy takes at every call: ``train()``,
    ``eval()`` and what users set on a model's modules reach ``stacked`` only. The copy kept its dropout on after
    TRL's ``disable_dropout_in_model`` set every ``nn.Dropout``'s p to 0 (BERT's embeddings: 0.43 off the members so
    trained), and off for Monte Carlo dropout (the dropout modules alone put back in training mode)."""
    modules = dict(structure.named_modules())
    return [(module, modules[name], _settings(module)) for name, module in code.named_modules() if name in modules]


def take_settings(pairs: list[tuple[nn.Module, nn.Module, tuple[str, ...]]]) -> None:
    """The code copy's training flags and :func:`_settings` as ``stacked``'s (the pairs of :func:`module_pairs`)."""
    for code, structure, settings in pairs:
        if code.training != structure.training:
            code.training = structure.training
        for name in settings:
            if getattr(code, name) != getattr(structure, name):
                setattr(code, name, getattr(structure, name))


def _settings(module: nn.Module) -> tuple[str, ...]:
    """The settings of ``module`` that users change on a model's modules by class, which the code copy takes from
    ``stacked`` at every call: a dropout's probability (TRL's ``disable_dropout_in_model``), a BatchNorm's momentum
    (SWA's ``update_bn`` sets it to None: its statistics, gathered with 0.1, were 1.7 off), eps and
    ``track_running_stats``."""
    if isinstance(module, _DropoutNd):
        return ("p",)
    if isinstance(module, _BatchNorm):
        return ("momentum", "eps", "track_running_stats")
    return ()


def batchnorm_statistics(structure: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, a copy) of the running statistics of the BatchNorms in ``structure``: a call in training that vmap
    refuses (a BatchNorm with momentum None reads its count with ``.item()``: SWA's ``update_bn``) updated them before
    it raised, and the loop that runs instead updated them again (each batch counted twice)."""
    return [(b, b.clone()) for m in structure.modules() if isinstance(m, _BatchNorm)
            for b in m.buffers(recurse=False) if b is not None]
