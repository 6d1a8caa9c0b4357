"""The registry of wide builders, keyed by the class of the module they replace.

A wide builder is a class with ``from_modules(mods, fold)`` (N ordinary modules -> one wide module) and
``to_modules()`` (the inverse). Builders register themselves with a decorator::

    @register_wide(nn.Linear)
    class WideLinear(WideModule):
        @classmethod
        def from_modules(cls, mods, fold): ...
        def to_modules(self): ...

Lookup walks the module's MRO, so a subclass of ``nn.Linear`` finds ``WideLinear`` unless a more
specific builder is registered for it, but only while the subclass keeps its ancestor's ``forward``:
Gemma 3's ``Gemma3TextScaledWordEmbedding`` subclasses ``nn.Embedding`` and scales its output, which a
``WideEmbedding`` would silently leave out (it has a builder of its own).

hf-wide's own builders (:mod:`hf_wide.primitives`, :mod:`hf_wide.blocks`, :mod:`hf_wide.rewrites`) register as their
modules are imported: every lookup, and every registration from outside hf-wide, imports them first (``import
hf_wide`` alone imports none of them), so that a user's builder for a class replaces hf-wide's own.
"""

from __future__ import annotations

import importlib
import sys

from torch import nn

_REGISTRY: dict[type[nn.Module], type] = {}
_BLOCKS: dict[type[nn.Module], type] = {}
_STACKED_READS: dict[type[nn.Module], dict[str, tuple[type[nn.Module], ...]]] = {}
_REWRITES: dict[type[nn.Module], tuple[type[nn.Module], tuple[str, ...]]] = {}


_OWN_MODULES = ("hf_wide.primitives", "hf_wide.blocks", "hf_wide.rewrites")
_own_imported = False


def _import_own() -> None:
    """Import hf-wide's own builders (each registers as its module is imported). The flag is set only once the
    imports are done: a thread that comes here while another imports them waits on Python's import lock, and finds
    every builder when it returns."""
    global _own_imported
    if not _own_imported:
        for name in _OWN_MODULES:
            importlib.import_module(name)
        _own_imported = True


def _before_a_users(depth: int = 2) -> None:
    """A registration from outside hf-wide imports hf-wide's own first, so that the user's replaces them, as when
    ``import hf_wide`` imported them all. (hf-wide's own never register one class twice.)"""
    if not sys._getframe(depth).f_globals.get("__name__", "").startswith("hf_wide."):
        _import_own()


def _registrar(table: dict[type[nn.Module], type], module_classes: tuple[type[nn.Module], ...]):
    _before_a_users(depth=3)  # the caller of register_wide or register_block

    def decorator(wide_cls: type) -> type:
        for module_class in module_classes:
            table[module_class] = wide_cls
        wide_cls.source_classes = tuple(getattr(wide_cls, "source_classes", ())) + module_classes
        return wide_cls

    return decorator


def transformers_classes(*names: str) -> list[type[nn.Module]]:
    """Module classes of transformers families, named ``"family.ClassName"`` (from
    ``transformers.models.<family>.modeling_<family>``), for registering builders of families that share
    one forward."""
    found = []
    for name in names:
        family, class_name = name.split(".")
        found.append(getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), class_name))
    return found


def register_wide(*module_classes: type[nn.Module]):
    """Class decorator: register the decorated wide class as the builder for ``module_classes``."""
    return _registrar(_REGISTRY, module_classes)


def register_block(*module_classes: type[nn.Module]):
    """Class decorator: register a fused block, which replaces a whole module *with its children*
    (an attention or MLP block) instead of one leaf layer. Same contract as :func:`register_wide`, plus
    ``accepts(module) -> bool`` to decline instances it cannot fuse."""
    return _registrar(_BLOCKS, module_classes)


def register_stacked_read(module_class: type[nn.Module], tensor: str, consumers: tuple[type[nn.Module], ...]) -> None:
    """Declare that ``module_class``'s forward reads a descendant's tensor directly (``tensor``: its path from
    the module, e.g. DeBERTa's encoder reads ``"rel_embeddings.weight"``) and hands it on only to row-wise
    layers and to modules of the ``consumers`` classes. When every such consumer is a fused block that takes
    the tensor stacked, ``(N, ...)``, the planner stacks the tensor's module like any other instead of
    running the reader member by member."""
    _before_a_users()
    _STACKED_READS.setdefault(module_class, {})[tensor] = consumers


def stacked_read_consumers(module: nn.Module, tensor: str) -> tuple[type[nn.Module], ...] | None:
    """The consumer classes declared for ``module`` (exact class) reading ``tensor``, or None."""
    _import_own()
    return _STACKED_READS.get(type(module), {}).get(tensor)


def declares_stacked_reads(module: nn.Module) -> bool:
    """Whether ``module``'s exact class declared a stacked read (its forward hands a table to its blocks)."""
    _import_own()
    return type(module) in _STACKED_READS


def register_rewrite(module_class: type[nn.Module], reads: tuple[str, ...]):
    """Class decorator: the decorated subclass of ``module_class`` overrides the methods that run a child's tensors
    on an input without the batch dim (MPNet's encoder computes its position bias from a ``(T, T)`` bucket
    table), reading the stacked tensors of the children named in ``reads`` to compute every member's result at
    once. The module stays the template's, its children planned as usual; in the wide model its class becomes
    the decorated one (:mod:`hf_wide.rewrites`)."""
    _before_a_users()

    def decorator(rewrite_cls: type[nn.Module]) -> type[nn.Module]:
        if not issubclass(rewrite_cls, module_class):
            raise TypeError(f"{rewrite_cls.__name__} must subclass {module_class.__name__}.")
        rewrite_cls.source_class = module_class
        _REWRITES[module_class] = (rewrite_cls, tuple(reads))
        return rewrite_cls

    return decorator


def find_rewrite(module: nn.Module) -> tuple[type[nn.Module], tuple[str, ...]] | None:
    """(rewrite class, the children it reads) for this exact module class, or None."""
    _import_own()
    return _REWRITES.get(type(module))


def rewrite_classes() -> tuple[type[nn.Module], ...]:
    _import_own()
    return tuple(cls for cls, _ in _REWRITES.values())


def find_block(module: nn.Module) -> type | None:
    """The fused block for this exact module class, if one is registered and accepts the instance.
    Exact class, not MRO: a subclass may change the forward the block reimplements."""
    _import_own()
    return _BLOCKS.get(type(module))


def find_wide(module_class: type[nn.Module]) -> type | None:
    """The wide builder for ``module_class`` (first match along its MRO, if ``module_class`` runs that
    class's ``forward``), or None."""
    _import_own()
    for klass in module_class.__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass] if module_class.forward is klass.forward else None
    return None


def has_exact_builder(module_class: type[nn.Module]) -> bool:
    """Whether a builder is registered for exactly this class (not an ancestor): what a fused block may hold."""
    _import_own()
    return module_class in _REGISTRY


def get_wide(module_class: type[nn.Module]) -> type:
    """Like :func:`find_wide`, but raise with the supported list when nothing matches."""
    _import_own()
    wide_cls = find_wide(module_class)
    if wide_cls is None:
        supported = ", ".join(sorted(k.__name__ for k in _REGISTRY))
        raise KeyError(f"No wide builder for {module_class.__name__}. Supported: {supported}.")
    return wide_cls


def supported_classes() -> list[type[nn.Module]]:
    _import_own()
    return list(_REGISTRY)
