"""A generating model's cache path: the keyword it takes its cache under, and the inputs of one decoding step.

The sample runs without a cache; a model that generates takes another path with one (a prefill, then one token at a
time). Two places walk that path at fusion: :mod:`hf_wide.path_reads` (which module's code reads which tensor there:
Reformer's LSH attention reads its child's ``query_key.weight`` itself when it has a cache, and nowhere else) and
:mod:`hf_wide.verify_cache` (the wide model's outputs there against each member's).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .inputs import CacheRowsError
from .versions import CACHE_NAMES


def cache_name(model: nn.Module) -> str | None:
    """The keyword under which ``model`` takes and returns its cache, or None where it keeps none."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel passes it on
    if getattr(getattr(inner, "config", None), "use_cache", None) is None:
        return None
    parameters = inspect.signature(inner.forward).parameters
    if "use_cache" not in parameters:
        return None
    return next((name for name in CACHE_NAMES if name in parameters), None)


def token_ids_name(kwargs: dict) -> str | None:
    """The keyword of the token ids a decoding step extends (a seq2seq model's decoder's), None if there are none."""
    ids = "decoder_input_ids" if "decoder_input_ids" in kwargs else "input_ids"
    return ids if isinstance(kwargs.get(ids), torch.Tensor) else None


def next_step(kwargs: dict, ids: str) -> dict:
    """The inputs of one more token after a prefill of ``kwargs``: the last token again, its mask one longer."""
    step = dict(kwargs)
    step[ids] = kwargs[ids][..., -1:]
    mask = "decoder_attention_mask" if ids == "decoder_input_ids" else "attention_mask"
    if isinstance(step.get(mask), torch.Tensor):
        step[mask] = torch.cat([step[mask], step[mask][..., -1:]], -1)
    step.pop("position_ids", None)
    return step


def decode(model: nn.Module, kwargs: dict, ids: str, name: str):
    """A prefill of ``kwargs`` with a cache and one decoding step with the cache it returned: (prefill output, step
    output), or None if the model returned no cache (an encoder given ``use_cache``). The step takes its mask one
    longer; a model that refuses it there gets none, as its generate passes none (Reformer computes its own), after
    a prefill again (the failed step may have extended the cache's first layers)."""
    first = model(**kwargs, use_cache=True)
    cache = getattr(first, name, None)
    if cache is None:
        return None
    step = next_step(kwargs, ids)
    try:
        return first, model(**step, **{name: cache}, use_cache=True)
    except CacheRowsError:
        raise
    except Exception:
        unmasked = {k: v for k, v in step.items() if k not in ("attention_mask", "decoder_attention_mask")}
        if len(unmasked) == len(step):
            raise
        first = model(**kwargs, use_cache=True)
        return first, model(**unmasked, **{name: getattr(first, name)}, use_cache=True)
