"""The config objects a wide model's modules read, shared as transformers shares them.

A transformers model hands its one config object to its modules, which read it when called (attention reads
``config._attn_implementation`` on every call), so ``model.set_attn_implementation("eager")`` changes it once, in
place, for all of them. hf-wide's copies of modules (the sources its wide modules keep, the copies they run, the
members taken back out) therefore read their model's config objects rather than copies of their own: copied, they
kept the old setting, and a wide model switched to eager attention went on running sdpa in its fused blocks (no
attentions returned where every member returned them).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator

from torch import nn
from transformers import PretrainedConfig

_REPLACED = contextvars.ContextVar("hf_wide_configs", default=None)  # id(config) -> the config copies read instead


def module_configs(module: nn.Module) -> list[PretrainedConfig]:
    """Every config object ``module`` and its submodules hold (as ``config``), each once."""
    found = {}
    for sub in module.modules():
        config = sub.__dict__.get("config")  # not getattr: a wide module answers unknown names from a member
        if isinstance(config, PretrainedConfig):
            found.setdefault(id(config), config)
    return list(found.values())


def config_tree(config: PretrainedConfig, path: str = "") -> dict[str, PretrainedConfig]:
    """``config`` and its sub-configs at any depth by path: ``{"": config, "text_config": ..., ...}``."""
    tree = {path: config}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            tree.update(config_tree(sub, f"{path}.{key}" if path else key))
    return tree


def same_places(old: PretrainedConfig, new: PretrainedConfig) -> dict[int, PretrainedConfig]:
    """``{id(c): new's config in c's place}`` for ``old`` and its sub-configs (those ``new`` has too)."""
    new_tree = config_tree(new)
    return {id(c): new_tree[path] for path, c in config_tree(old).items() if path in new_tree}


def follow_kernels(config, current) -> None:
    """Give ``config`` (a member's, as loaded) the attention and experts implementations the wide model's config
    ``current`` holds now: switched by ``wide.model.set_attn_implementation(...)`` after fusion, the members taken
    out run what the wide model runs."""
    now = config_tree(current)
    for path, sub in config_tree(config).items():
        for name in ("_attn_implementation_internal", "_experts_implementation_internal"):
            if path in now and name in now[path].__dict__:
                setattr(sub, name, now[path].__dict__[name])


def configs_in_place(model: nn.Module, template: nn.Module, replacements: dict[int, object]) -> dict[int, object]:
    """For the configs ``model`` reads, ``{id(c): replacement}``: the replacement of ``template``'s config in the
    same place of its config's tree, and a copy of any other."""
    given, own, theirs = {}, getattr(model, "config", None), getattr(template, "config", None)
    if isinstance(own, PretrainedConfig) and isinstance(theirs, PretrainedConfig):
        given = {k: replacements[id(c)] for k, c in same_places(own, theirs).items() if id(c) in replacements}
    return copies_of([c for c in module_configs(model) if id(c) not in given], given)


def copies_of(configs: list[PretrainedConfig], given: dict[int, PretrainedConfig] | None = None) -> dict[int, object]:
    """``{id(config): its replacement}`` for each of ``configs``: ``given``'s where it names one, else a copy; the
    copies are made together, so that a config that is a sub-config of another stays that one object."""
    memo = dict(given or {})
    copies = copy.deepcopy(configs, memo)
    return {**(given or {}), **{id(c): k for c, k in zip(configs, copies)}}


@contextlib.contextmanager
def configs_replaced(replacements: dict[int, object]) -> Iterator[None]:
    """Within it, copies of modules (:func:`hf_wide.primitives.base.copy_module`) read ``replacements[id(c)]``
    where their source reads the config ``c``."""
    token = _REPLACED.set(replacements)
    try:
        yield
    finally:
        _REPLACED.reset(token)


def config_memo(module: nn.Module) -> dict[int, object]:
    """A ``deepcopy`` memo under which a copy of ``module`` reads the configs ``module`` reads (or, within
    :func:`configs_replaced`, their replacements), not copies of them."""
    replaced = _REPLACED.get() or {}
    return {id(c): replaced.get(id(c), c) for c in module_configs(module)}
