"""The base class of every wide primitive.

A wide primitive keeps its source module's tensor names (``weight``, ``bias``, ``running_mean``, ...)
with a leading member dim: member i's ``weight`` is ``wide.weight[i]``. That convention makes
``from_modules`` and ``to_modules`` generic, so a subclass only reads its hyper-parameters in
``setup`` and writes ``forward``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import types
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..configs import config_memo
from ..fold import Fold


_KEEP_STORAGE = contextvars.ContextVar("hf_wide_keep_storage", default=False)


@contextlib.contextmanager
def keeping_storage() -> Iterator[None]:
    """Within it, what a wide model keeps whole from its members (shared modules, the one base layer of LoRA
    members) is the members' own tensors, not copies: loading adapters over one base then holds the base once."""
    token = _KEEP_STORAGE.set(True)
    try:
        yield
    finally:
        _KEEP_STORAGE.reset(token)


def keeps_storage() -> bool:
    return _KEEP_STORAGE.get()


def kept(module: nn.Module) -> nn.Module:
    """``module`` for the wide model to hold: a copy, or itself within :func:`keeping_storage`."""
    return module if keeps_storage() else copy.deepcopy(module)


def copy_module(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """``copy.deepcopy(module, memo)`` that reads the config objects ``module`` reads (see :mod:`hf_wide.configs`)."""
    return copy.deepcopy(module, {**config_memo(module), **(memo or {})})


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` and its children on the meta device: hyper-parameters and structure, no data."""
    memo = {}
    for sub in module.modules():
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is not None and id(t) not in memo:
                meta = t.to("meta")
                memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy_module(module, memo)


def meta_copies(modules: Sequence[nn.Module], first: nn.Module | None = None) -> list[nn.Module]:
    """:func:`meta_copy` of each of ``modules``, one object for those alike in all but their tensors' values (the
    members of an ensemble mostly are: a copy per member and layer was 3 MiB of Python objects while loading 4
    adapters of a 44.5 MiB BERT, 7 MiB at 727 MiB). ``first``: a meta copy of ``modules[0]`` already made."""
    copies: list[nn.Module] = []
    for i, module in enumerate(modules):
        twin = next((copies[j] for j in range(i) if _alike(modules[j], module)), None)
        copies.append(twin if twin is not None else first if i == 0 and first is not None else meta_copy(module))
    return copies


def _alike(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules differ in nothing but their tensors' values: the same classes, the same tensors'
    names, shapes, dtypes and flags, and equal attributes, all the way down."""
    if a is b:
        return True
    modules_a, modules_b = dict(a.named_modules()), dict(b.named_modules())
    if modules_a.keys() != modules_b.keys():
        return False
    for name, x in modules_a.items():
        y = modules_b[name]
        if type(x) is not type(y):
            return False
        for tx, ty in ((x._parameters, y._parameters), (x._buffers, y._buffers)):
            if tx.keys() != ty.keys() or any(_tensor_key(tx[k]) != _tensor_key(ty[k]) for k in tx):
                return False
        ax = {k: v for k, v in vars(x).items() if k not in ("_parameters", "_buffers", "_modules")}
        ay = {k: v for k, v in vars(y).items() if k not in ("_parameters", "_buffers", "_modules")}
        if ax.keys() != ay.keys():
            return False
        if not all(same_value(v, ay[k]) for k, v in ax.items()):
            return False
    return True


def same_value(a, b) -> bool:
    """Whether two attribute values of members' modules are the same: equal, with functions and partials bound to
    each member's own module compared by what they run, and tensors by their values."""
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # compare by identity otherwise
        return (same_value(a.func, b.func) and len(a.args) == len(b.args)
                and all(map(same_value, a.args, b.args)) and same_value(a.keywords, b.keywords))
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):  # each bound to its own module
        return a.__func__ is b.__func__ and type(a.__self__) is type(b.__self__)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):  # the very tensor: no pass over its values
        return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                          and a.dtype == b.dtype and torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # a value that cannot say whether it equals another: treat it as different
        return a is b


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.dtype, t.requires_grad)


class WideModule(nn.Module):
    """N members of one module class, their tensors stacked on a leading member dim."""

    source_classes: tuple[type[nn.Module], ...] = ()
    takes_stacked_inputs: bool = False  # see WideBlock's

    def __init__(self, fold: Fold, proto: nn.Module):
        nn.Module.__init__(self)  # (not the next class's: WideBatchNorm is a _BatchNorm too, built as a WideModule)
        self.fold = fold
        # The source module on the meta device: hyper-parameters for setup() and a mould for to_module().
        # Kept out of _modules so it is neither a child nor in the state dict.
        object.__setattr__(self, "proto", proto)

    @property
    def num_members(self) -> int:
        return self.fold.num_members

    def setup(self, proto: nn.Module) -> None:
        """Read the hyper-parameters the forward needs from the (meta) source module."""

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module], fold: Fold) -> "WideModule":
        """Stack N modules of one class: ``(*shape)`` tensors become ``(N, *shape)``."""
        if len(mods) != fold.num_members:
            raise ValueError(f"{cls.__name__} needs {fold.num_members} modules, got {len(mods)}.")
        first = mods[0]
        wide = cls(fold, meta_copy(first))
        for i, mod in enumerate(mods):
            if type(mod) is not type(first):
                raise TypeError(f"Member {i} is a {type(mod).__name__}, member 0 a {type(first).__name__}.")
            if mod.extra_repr() != first.extra_repr():
                raise ValueError(f"Member {i}'s {type(mod).__name__}({mod.extra_repr()}) differs from member 0's "
                                 f"({first.extra_repr()}).")
        for name, p in first._parameters.items():
            stacked = None if p is None else torch.stack([m._parameters[name].detach() for m in mods])
            wide.register_parameter(name, None if p is None else nn.Parameter(stacked, p.requires_grad))
        for name, b in first._buffers.items():
            stacked = None if b is None else torch.stack([m._buffers[name] for m in mods])
            wide.register_buffer(name, stacked, persistent=name not in first._non_persistent_buffers_set)
        wide.setup(wide.proto)
        return wide

    def to_module(self, i: int, share: bool = False) -> nn.Module:
        """Member i as an ordinary module: with storage of its own, or (``share=True``) with tensors that
        are views into the wide module's (no copy; writes to one show in the other)."""
        mod = copy.deepcopy(self.proto)
        take = (lambda t: t[i].detach()) if share else (lambda t: t[i].detach().clone())
        for name in mod._parameters:  # the source's own tensors, not helpers the wide class adds
            p = self._parameters[name]
            mod._parameters[name] = None if p is None else nn.Parameter(take(p), p.requires_grad)
        for name in mod._buffers:
            b = self._buffers[name]
            mod._buffers[name] = None if b is None else take(b)
        return mod

    def to_modules(self) -> list[nn.Module]:
        """The inverse of :meth:`from_modules`: every member as an ordinary module."""
        return [self.to_module(i) for i in range(self.num_members)]

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, source={type(self.proto).__name__}"


def affine(weight: torch.Tensor, ndim: int, feature_dim: int = -1) -> torch.Tensor:
    """View a stacked ``(N, C)`` parameter so it broadcasts against an ``(N, b, ...)`` activation of
    ``ndim`` dims whose features sit at ``feature_dim``."""
    shape = [1] * ndim
    shape[0] = weight.shape[0]
    shape[feature_dim] = weight.shape[1]
    return weight.view(shape)
