"""The members' calls that verification checks the wide model against (:mod:`hf_wide.verify`), recorded by hooks.

    with Recorder(model, paths) as recorder:   # the first call of each module at ``paths``
        model(**sample)
    recorder.calls[path]                       # (args, kwargs, output), copies
    record_members(members, paths, (), sample) # one such dict per member, its whole output under None
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .samples import sample_kwargs

AGREED = object()  # a wide module's call that agreed with its members there and then: nothing kept
NO_INPUTS = object()  # a member's call recorded by its output alone


class Recorder:
    """Forward hooks that keep the first call of each named module: ``calls[path] = (args, kwargs, output)``.
    ``running`` holds the paths entered and not yet left: after an exception, where it was raised.
    With ``inputs=False`` only outputs are kept (``NO_INPUTS`` for the inputs); a call for which
    ``agrees(path, args, kwargs, output)`` holds is kept as ``AGREED`` alone. The sample's activations are not
    small next to a model's weights, and only a module that disagrees needs its inputs."""

    def __init__(self, model: nn.Module, paths: Sequence[str], inputs: bool = True, agrees=None):
        self.calls: dict[str, tuple] = {}
        self.running: list[str] = []
        self.inputs, self.agrees = inputs, agrees
        modules = dict(model.named_modules())
        self.handles = []
        for p in paths:
            if p in modules:
                self.handles.append(modules[p].register_forward_pre_hook(self._enter(p)))
                self.handles.append(modules[p].register_forward_hook(self._hook(p), with_kwargs=True))

    def _enter(self, path: str):
        def hook(module, args):
            self.running.append(path)
        return hook

    def _hook(self, path: str):
        def hook(module, args, kwargs, output):
            self.running.pop()
            if path in self.calls:
                return
            if self.agrees is not None and self.agrees(path, args, kwargs, output):
                self.calls[path] = AGREED
            elif self.inputs:  # copies: later code may write into these tensors in place
                self.calls[path] = copied((args, dict(kwargs), output))
            else:
                self.calls[path] = (NO_INPUTS, NO_INPUTS, copied(output))
        return hook

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def copied(tree):
    """``tree`` with every tensor a detached copy: what the forward goes on to write in place stays as recorded."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def record_members(references: Sequence[nn.Module], paths: Sequence[str], args: tuple, kwargs: dict,
                   inputs: bool = True) -> list[dict]:
    """For each reference model, the first call (args, kwargs, output) of every module in ``paths`` (with
    ``inputs=False``, its output alone); the model's own output under the key ``None``."""
    recorded = []
    for model in references:
        with Recorder(model, paths, inputs) as recorder, torch.no_grad():
            output = model(*args, **sample_kwargs(model, kwargs))
        recorder.calls[None] = ((), {}, copied(output))
        recorded.append(recorder.calls)
    return recorded
