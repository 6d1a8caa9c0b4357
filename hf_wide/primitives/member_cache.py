"""Each member's rows of the wide model's cache, for one call of a module run member by member.

A wide forward's cache holds N*B rows, member-major. A module that runs member by member (a fallback, or a
state-space mixer that vmap cannot take) must see only its member's B rows of every layer's state, and its
member's flags: a Mamba layer's ``has_previous_state`` set by member 0's prefill would make member 1 read member
0's convolution state as its own past. So each member gets a shallow copy of the cache whose layers are copies
holding views of that member's rows (:func:`split`); the cache's own code (``update``, ``update_conv_state``,
``update_recurrent_state``, lazy initialisation) runs on them unchanged, and :func:`merge` folds the members'
layers back into the one cache: where a member replaced a tensor (a cache that grows by concatenation) the N
tensors are concatenated, member-major; where it wrote in place (a convolution state's ``copy_``) its writes are
already in the cache's rows. Members that make their caches themselves (a module asked for one and handed none)
have theirs gathered into one of N*B rows (:func:`gather`, or :func:`row_tensors` and :func:`set_row_tensors`
for a cache made under vmap).

Dynamic caches only (alone, or the two of an encoder-decoder cache), with the layer types below (key/value layers, full or sliding window, and the linear
attention layers of Mamba and the hybrids): a static layer counts its length in a tensor that every member would
advance, and other layers keep state this does not know how to split. Anything else is refused.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

SPLIT_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer,
                LinearAttentionAndSlidingWindowAttentionLayer)
ROW_TENSORS = ("keys", "values")  # (B, H, T, d)
ROW_STATES = ("conv_states", "recurrent_states")  # {state index: (B, ...)}
MEMBER_DICTS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                "conv_kernel_size")  # per-state flags each member sets for itself
# Caches of a model's own class, no transformers Cache: their lists of a (B, ...) tensor per layer (Reformer's LSH
# attention reads its past buckets and states there, run member by member: member m's rows only)
ROW_LISTS = {"ReformerDynamicCache": ("buckets_cache", "states_cache")}


def is_cache(value) -> bool:
    """Whether ``value`` is a cache whose rows a module run member by member must split: a transformers ``Cache``,
    or one of :data:`ROW_LISTS`."""
    return isinstance(value, Cache) or (type(value).__name__ in ROW_LISTS
                                        and type(value).__module__.startswith("transformers."))


def split(cache: Cache, num_members: int, batch: int) -> list[Cache]:
    """N shallow copies of ``cache``, member m's holding views of rows ``[m*B, (m+1)*B)`` of every layer (an
    encoder-decoder cache: of both its caches, with each member's own flags of which cross-attention layers it
    has filled)."""
    if type(cache) is EncoderDecoderCache:
        selfs = split(cache.self_attention_cache, num_members, batch)
        crosses = split(cache.cross_attention_cache, num_members, batch)
        views = []
        for own, cross in zip(selfs, crosses):
            view = copy.copy(cache)
            view.self_attention_cache, view.cross_attention_cache = own, cross
            view.is_updated = dict(cache.is_updated)
            views.append(view)
        return views
    if type(cache).__name__ in ROW_LISTS:
        return [_row_lists(cache, m * batch, batch) for m in range(num_members)]
    _check_shareable(cache)
    views = []
    for m in range(num_members):
        view = copy.copy(cache)
        view.layers = [_layer_rows(layer, m * batch, batch) for layer in cache.layers]
        views.append(view)
    return views


def gather(caches: list[Cache]) -> Cache:
    """One cache of N*B rows, member-major, from the N caches of B rows that the members made themselves (a
    module run member by member, or vmapped, handed no cache and asked for one)."""
    first = caches[0]
    if type(first) is EncoderDecoderCache:
        cache = copy.copy(first)
        cache.self_attention_cache = gather([c.self_attention_cache for c in caches])
        cache.cross_attention_cache = gather([c.cross_attention_cache for c in caches])
        cache.is_updated = dict(first.is_updated)
        return cache
    for c in caches:
        _check_shareable(c)
    cache = copy.copy(first)
    cache.layers = []
    merge(cache, caches)  # every layer new to it: the members' rows concatenated
    return cache


def held_rows(cache: Cache) -> int | None:
    """The rows ``cache`` holds (its first filled layer's), or None while it holds none."""
    own = cache.self_attention_cache if type(cache) is EncoderDecoderCache else cache
    for layer in getattr(own, "layers", ()):
        states = [getattr(layer, name, None) for name in ROW_TENSORS]
        states += [v for name in ROW_STATES for v in (getattr(layer, name, None) or {}).values()]
        filled = next((t for t in states if _has_rows(t)), None)
        if filled is not None:
            return filled.shape[0]
    return None


def row_tensors(cache: Cache) -> list[torch.Tensor]:
    """The tensors of ``cache`` that hold rows, in a fixed order (the order :func:`set_row_tensors` takes)."""
    found = []
    _map_rows(cache, lambda t: found.append(t) or t)
    return found


def set_row_tensors(cache: Cache, tensors: list[torch.Tensor]) -> None:
    """Replace the row tensors of ``cache``, in :func:`row_tensors`' order (a cache made under vmap: its
    member's tensors by the N members' ones, folded)."""
    given = iter(tensors)
    _map_rows(cache, lambda t: next(given))


def contiguous_keys(output) -> None:
    """Make the keys and values of a model output's dynamic cache contiguous, for ``torch.compile``. A layer's first
    update holds them as the attention made them (a transposed view of the projection), every later one as their
    concatenation (contiguous); a compiled forward handed the cache back guards on their strides, so the second
    decoding step compiled a graph of its own, and the third another. Under compilation only; a no-op on
    contiguous tensors."""
    caches = [v for v in output.values() if isinstance(v, Cache)] if isinstance(output, dict) else []
    for cache in caches:
        for own in (cache.self_attention_cache, cache.cross_attention_cache) if type(
                cache) is EncoderDecoderCache else (cache,):
            for layer in own.layers if type(own) is DynamicCache else ():
                if type(layer) is DynamicLayer and layer.is_initialized:
                    layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()


def _map_rows(cache: Cache, fn) -> None:
    if type(cache) is EncoderDecoderCache:
        _map_rows(cache.self_attention_cache, fn)
        _map_rows(cache.cross_attention_cache, fn)
        return
    _check_shareable(cache)
    for layer in cache.layers:
        for name in ROW_TENSORS:
            if _has_rows(getattr(layer, name, None)):
                setattr(layer, name, fn(getattr(layer, name)))
        for name in ROW_STATES:
            states = getattr(layer, name, None)
            if states is not None:
                setattr(layer, name, {k: fn(v) if _has_rows(v) else v for k, v in states.items()})


def _check_shareable(cache: Cache) -> None:
    reason = unshareable(cache)
    if reason:
        raise NotImplementedError(reason)


def unshareable(cache: Cache) -> str | None:
    """Why the members cannot share ``cache`` (each its own rows of it), or None where they can."""
    if type(cache) is EncoderDecoderCache:
        return unshareable(cache.self_attention_cache) or unshareable(cache.cross_attention_cache)
    if type(cache) is not DynamicCache:
        return (f"A module run member by member was handed a {type(cache).__name__}; the members can share only a "
                "DynamicCache (or an EncoderDecoderCache of two). Pass use_cache=False, or a DynamicCache.")
    if cache.offloading:
        return ("A module run member by member cannot share an offloading cache between members: pass "
                "use_cache=False, or a DynamicCache without offloading.")
    for layer in cache.layers:
        if type(layer) not in SPLIT_LAYERS:
            return (f"A module run member by member cannot share a cache layer of type {type(layer).__name__} "
                    f"between members (it can: {', '.join(t.__name__ for t in SPLIT_LAYERS)}). Pass use_cache=False.")
    return None


def merge(cache: Cache, views: list[Cache]) -> None:
    """Fold the members' layers back into ``cache``: N*B rows, member-major. Layers a member added (a cache that
    makes its layers as they are first updated) are added too."""
    if type(cache) is EncoderDecoderCache:
        merge(cache.self_attention_cache, [view.self_attention_cache for view in views])
        merge(cache.cross_attention_cache, [view.cross_attention_cache for view in views])
        cache.is_updated.update(views[0].is_updated)  # the same for every member: they saw the same layers
        return
    if type(cache).__name__ in ROW_LISTS:
        _merge_row_lists(cache, views)
        return
    for index, parts in enumerate(zip(*(view.layers for view in views))):
        if index < len(cache.layers):
            _merge_layer(cache.layers[index], parts)
        else:
            layer = parts[0]  # a new object: member 0's, given every member's rows
            _merge_layer(layer, parts, fresh=True)
            cache.layers.append(layer)


def _layer_rows(layer, start, batch):
    """A copy of ``layer`` holding views of rows ``[start, start + batch)`` of its states. (Not a ``slice`` object:
    compiled, one of the batch's symbolic size fixed the batch in the graph, and T5's decoder, whose first attention
    runs member by member over the cache, compiled a graph for every batch size.)"""
    view = copy.copy(layer)
    for name in ROW_TENSORS:
        value = getattr(layer, name, None)
        if _has_rows(value):
            setattr(view, name, value.narrow(0, start, batch))
    for name in ROW_STATES:
        states = getattr(layer, name, None)
        if states is not None:
            setattr(view, name, {k: v.narrow(0, start, batch) if _has_rows(v) else v for k, v in states.items()})
    for name in MEMBER_DICTS:
        if hasattr(layer, name):
            setattr(view, name, dict(getattr(layer, name)))
    return view


def _row_lists(cache, start: int, batch: int):
    """A shallow copy of a :data:`ROW_LISTS` cache whose lists hold views of rows ``[start, start + batch)``."""
    view = copy.copy(cache)
    for name in ROW_LISTS[type(cache).__name__]:
        setattr(view, name, [t.narrow(0, start, batch) if _has_rows(t) else t for t in getattr(cache, name)])
    return view


def _merge_row_lists(cache, views: list) -> None:
    """Fold the members' lists back into a :data:`ROW_LISTS` cache (entries they added or replaced concatenated,
    member-major); its other attributes (a count of tokens seen) are member 0's, the same for every member."""
    names = ROW_LISTS[type(cache).__name__]
    for name, value in vars(views[0]).items():
        if name not in names:
            setattr(cache, name, value)
    for name in names:
        old = getattr(cache, name)
        for index, parts in enumerate(zip(*(getattr(view, name) for view in views))):
            if index < len(old):
                old[index] = _rows_of(old[index], list(parts), fresh=False)
            else:
                old.append(_rows_of(None, list(parts), fresh=True))


def _has_rows(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0  # not a lazy layer's empty one


def _merge_layer(layer, parts: tuple, fresh: bool = False) -> None:
    first = parts[0]
    for name, value in vars(first).items():  # flags and lengths: the same for every member (they saw the same
        if name not in ROW_TENSORS and name not in ROW_STATES:  # sequence), member 0's
            setattr(layer, name, value)
    for name in ROW_TENSORS:
        if hasattr(first, name):
            setattr(layer, name, _rows_of(getattr(layer, name, None), [getattr(p, name) for p in parts], fresh))
    for name in ROW_STATES:
        if hasattr(first, name):
            old = {} if fresh else getattr(layer, name)
            keys = getattr(first, name).keys()
            setattr(layer, name, {k: _rows_of(old.get(k), [getattr(p, name)[k] for p in parts], fresh)
                                  for k in keys})


def _rows_of(old, values: list, fresh: bool):
    """The cache's tensor after the members' call: the old one where every member wrote into its own view of it
    (or left it), else the members' tensors concatenated (N*B, ...)."""
    if not fresh and _has_rows(old) and all(_is_view_of(v, old, m, len(values)) for m, v in enumerate(values)):
        return old
    if not all(_has_rows(v) for v in values):
        return values[0]  # nothing there yet (None, or a lazy layer's empty tensor)
    return torch.cat(values)


def _is_view_of(value, old: torch.Tensor, member: int, num_members: int) -> bool:
    """Whether ``value`` is still member ``member``'s view of ``old``'s rows (its writes are in ``old``). Compiled,
    never: dynamo cannot read a storage's address (a graph break per layer and step), and the members' tensors
    concatenated hold the same rows, their writes included."""
    if torch.compiler.is_compiling() or not isinstance(value, torch.Tensor) or value.shape[1:] != old.shape[1:]:
        return False
    batch = old.shape[0] // num_members
    return (value.shape[0] == batch and value.untyped_storage().data_ptr() == old.untyped_storage().data_ptr()
            and value.storage_offset() == old.storage_offset() + member * batch * old.stride(0))
