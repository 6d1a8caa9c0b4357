"""Which module reads which tensor on a code path the sample does not take.

The trace sees the ops of the sample's forward only. A vision model asked to ``interpolate_pos_encoding`` at another
image size than its own takes another path, and some read a child's table there in their own code: SigLIP's
embeddings take ``self.position_embedding.weight`` itself and interpolate it. Planned from the sample alone, that
child became a wide embedding, whose weight is every member's, ``(N, P, D)``: SigLIP read N as its number of
positions and raised (verified or not: the sample never went there).

So the planner also runs the template down the sample's path, such paths, and a generating model's cache path (a
prefill with a cache, then one decoding step: Reformer's LSH attention reads its ``query_key.weight`` itself there
only, and a wide ``generate`` raised) (:func:`probe_reads`, plain forwards without gradients), and records, for each
parameter and buffer, the modules whose code calls a torch function on it: a module that reads a child's tensor is
planned as one that reads it in the trace would be (its tensor's owner cannot be a wide primitive of its own).
"""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .cache_path import cache_name, decode, token_ids_name
from .versions import CACHE_NAMES

logger = logging.getLogger(__name__)


# What a wide module's stacked tensor answers as one member's would: ViT's model reads its patch projection's
# weight.dtype (its shape, a stacked tensor's, would be every member's: that is a read)
SAME_FOR_EVERY_MEMBER = frozenset({"dtype", "device", "requires_grad", "is_cuda", "is_meta", "is_floating_point",
                                   "is_complex", "layout", "get_device", "element_size", "itemsize"})


def _name(func) -> str:
    """A torch function's name; a tensor property's (``t.dtype`` comes as its descriptor's ``__get__``)."""
    name = getattr(func, "__name__", "")
    return getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" else name


class _Reads(TorchFunctionMode):
    """Records ``found[tensor name]`` += the innermost module running, for every torch function given a tensor."""

    def __init__(self, names: dict[int, str], running: list[str], found: dict[str, set[str]],
                 held: dict[int, dict[str, str]]):
        super().__init__()
        self.names, self.running, self.found, self.held = names, running, found, held

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.running and _name(func) not in SAME_FOR_EVERY_MEMBER:
            for leaf in pytree.tree_leaves((args, kwargs)):
                name = self.names.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if name is not None:
                    reader = self.running[-1]
                    self.found[name].add(self.held.get(id(leaf), {}).get(reader, reader))
        return func(*args, **kwargs)


def probed_paths(model: nn.Module, kwargs: dict) -> list[dict]:
    """The sample's kwargs, as they are (the trace does not see a tensor's shape read: CLIP's text embeddings take
    ``self.position_embedding.weight.shape[0]``), and changed to take the paths they do not: a vision model's
    ``interpolate_pos_encoding`` at twice its image size."""
    paths = [kwargs]
    forward = getattr(model, "forward", None)
    takes = inspect.signature(forward).parameters if callable(forward) else {}
    pixels = kwargs.get("pixel_values")
    if "interpolate_pos_encoding" in takes and isinstance(pixels, torch.Tensor) and pixels.dim() == 4:
        bigger = torch.nn.functional.interpolate(pixels, scale_factor=2.0, mode="nearest")
        paths.append({**kwargs, "pixel_values": bigger, "interpolate_pos_encoding": True})
    return paths


def probe_reads(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, set[str]]:
    """Tensor name -> paths of the modules whose code reads it, on each of :func:`probed_paths` (nothing learned
    on a path where the model does not run)."""
    found: dict[str, set[str]] = defaultdict(set)
    paths = probed_paths(model, kwargs)
    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    held = _containers(model)
    running: list[str] = []

    def leave(module, args, output) -> None:  # (a hook that returned the path would replace the output)
        running.pop()

    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, p=path: running.append(p)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        for other in paths:
            try:
                with torch.no_grad(), _Reads(names, running, found, held):
                    model(*args, **other)
            except Exception as exc:  # the model does not take that path: nothing learned
                logger.info("hf-wide: %s does not run %s (%s: %s)", type(model).__name__,
                            sorted(set(other) - set(kwargs)) or "another path", type(exc).__name__, exc)
            running.clear()
        try:
            with torch.no_grad(), _Reads(names, running, found, held):
                _decode(model, args, kwargs)
        except Exception as exc:  # the model does not decode with a cache on the sample: nothing learned
            logger.info("hf-wide: %s does not decode with a cache (%s: %s)", type(model).__name__,
                        type(exc).__name__, exc)
        running.clear()
    finally:
        for handle in handles:
            handle.remove()
    return dict(found)


def _decode(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """A prefill of the sample with a cache, then one decoding step with the cache it returned (models that keep
    none, and samples without token ids, run neither)."""
    name = cache_name(model)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("use_cache", *CACHE_NAMES)}
    ids = token_ids_name(kwargs)
    if name is None or ids is None or args:
        return
    decode(model, kwargs, ids, name)


def _containers(model: nn.Module) -> dict[int, dict[str, str]]:
    """For a tensor a ``ParameterDict`` or ``ParameterList`` holds (PEFT's trainable tokens), the module around that
    container -> the container's path: its parent reads it, as a module reads its own (the trace sees no such read)."""
    held: dict[int, dict[str, str]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, t in model.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        if isinstance(modules.get(owner), (nn.ParameterDict, nn.ParameterList)):
            held.setdefault(id(t), {})[owner.rpartition(".")[0]] = owner
    return held


def with_reads(users: dict[str, set[str]], reads: dict[str, set[str]]) -> dict[str, set[str]]:
    """The trace's tensor readers with those of the other paths added."""
    merged = {name: set(paths) for name, paths in users.items()}
    for name, paths in reads.items():
        merged.setdefault(name, set()).update(paths)
    return merged
