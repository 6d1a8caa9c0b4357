"""The user's inputs folded into the wide model's ``(N*B, ...)`` rows, member-major (:func:`fold_inputs`).

Plain tensors ``(B, ...)`` are shared by every member and repeated N times; :class:`PerMember` tensors ``(N, B, ...)``
give each member its own rows and are flattened. The batch B is read from the model's main input
(:data:`PRIMARY_INPUTS`); inputs that never hold it (:data:`NOT_BATCHED`), and those of another modality with a batch
of their own (CLIP's images beside its texts: :data:`BATCHED_INPUTS`, :func:`other_batches`), are told apart.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


class PerMember:
    """An input that gives every member its own rows: a tensor of shape ``(N, B, ...)``.

    Plain tensors passed to a wide model are shared: every member sees the same ``(B, ...)`` batch.
    Wrap a tensor in ``PerMember`` to say that its leading dim indexes the members instead::

        wide(input_ids=PerMember(ids))    # ids: (N, B, T), member i reads ids[i]
    """

    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            raise TypeError("PerMember takes a tensor of shape (N, B, ...) with a member dim and a batch dim.")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"PerMember(shape={tuple(self.tensor.shape)})"


def _batch_of(value: Any, n: int) -> int | None:
    if isinstance(value, PerMember):
        if value.tensor.shape[0] != n:
            raise ValueError(
                f"A PerMember input has {value.tensor.shape[0]} members in its leading dim, but the wide model "
                f"has {n}: per-member inputs have shape (N={n}, B, ...)."
            )
        return value.tensor.shape[1]
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.shape[0]
    return None


class CacheRowsError(ValueError):
    """A cache given to a wide model holds other rows than its members' N*B."""


def _check_caches(kwargs: dict, n: int, batch: int) -> None:
    """Refuse a cache of other rows than the wide model's (a member's own, of B rows): torch.cat failed on it deep in
    the attention with a message of sizes."""
    for key, value in kwargs.items():
        if not isinstance(value, Cache):
            continue
        from .primitives.member_cache import held_rows  # (here: the primitives import this module)

        rows = held_rows(value)
        if rows is not None and rows % (n * batch):
            raise CacheRowsError(
                f"{key} holds a cache of {rows} rows, and the wide model's {n} members read {n * batch} beside a "
                f"batch of {batch} (N*B, member-major): pass the cache a wide forward or generate returned, or a "
                "member's own cache to that member alone (wide.member(i)).")


def fold_inputs(n: int, args: tuple, kwargs: dict, own_batches: bool = False,
                whole: bool = False) -> tuple[tuple, dict, int]:
    """Fold the user's inputs into ``(N*B, ...)`` rows. Returns ``(args, kwargs, B)``.

    B is read from the model's main input (:data:`PRIMARY_INPUTS`). Shared tensors with leading dim B are repeated
    member-major; ``PerMember`` tensors are flattened; other tensors (leading dim 1 broadcasts, 0-dim) pass
    unchanged, but with ``own_batches`` (a model whose wide code takes every member's images:
    :mod:`hf_wide.rewrites`) the :data:`BATCHED_INPUTS` that hold a batch of their own (CLIP's B' images beside its
    B texts, one image too) are repeated as well, ``(N*B', ...)``. ``whole``: the model runs whole, per member (a
    fallback): the inputs of another modality than the main one (:data:`MODALITIES`) are each member's whole, never
    folded, whatever their length (B images beside B texts were folded, N*B images beside N*B texts, where the
    fallback had learnt from an earlier call of B' images that they are no rows: every member ran on every
    member's copy of them).
    """
    if kwargs.get("mems") is not None:
        raise ValueError(
            "A wide model cannot take `mems` (XLNet's memory of earlier segments, time-major (T, B, D) per layer): "
            "the members' memories would not be told apart. Run each member's segments on wide.member(i).")
    leaves = [v for v in (*args, *kwargs.values()) if isinstance(v, (torch.Tensor, PerMember))]
    encoder = kwargs.get("encoder_outputs")  # its first states hold the batch too (generate given them alone raised)
    states = list(encoder.values()) if isinstance(encoder, dict) else encoder if isinstance(encoder, (tuple, list)) \
        else []
    leaves += [v for v in states[:1] if isinstance(v, (torch.Tensor, PerMember))]
    batches = [_batch_of(v, n) for v in leaves]
    batches = [b for b in batches if b is not None]
    if not batches:
        raise ValueError("The wide model needs at least one batched tensor input (e.g. input_ids or pixel_values).")
    # The batch is the model's main input's (its first argument, or the first of PRIMARY_INPUTS given), whatever the
    # order of the keyword arguments: a broadcast (1, T) position_ids given first made B 1, and input_ids' B rows
    # were read as B members' one row each
    primary = [args[0]] if args else []
    primary += [kwargs[k] for k in PRIMARY_INPUTS if k in kwargs]
    batch = next((b for b in (_batch_of(v, n) for v in primary) if b is not None), batches[0])
    kwargs = _expand_per_position(kwargs, batch)
    named = [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]
    for key, value in named:
        if isinstance(value, PerMember) and value.tensor.shape[1] != batch:
            main = next((f" of {k}" for k, v in named if k in ("argument 0", *PRIMARY_INPUTS) and v is not value
                         and _batch_of(v, n) == batch), "")
            raise ValueError(
                f"{key} gives each member {value.tensor.shape[1]} rows, but the batch{main} has {batch}: a per-member "
                "input holds each member's own rows of the batch, (N, B, ...). Inputs with a batch of their own "
                "(CLIP's images beside its texts) can only be shared by every member.")

    if n > 1 and not own_batches:
        for key, value in kwargs.items():  # a batch of its own, passed whole to every member, that reads as folded
            if key in BATCHED_INPUTS and isinstance(value, torch.Tensor) and value.dim() and value.shape[0] != batch \
                    and value.shape[0] == n * batch:
                raise ValueError(
                    f"{key} holds {value.shape[0]} rows beside a batch of {batch}: as many as the {n} members' "
                    f"{n * batch} folded rows, which the wide model's modules would split among the members (member i "
                    f"would see its {batch} of them only). Give another number of rows, as many as the batch, or run "
                    "the members alone (wide.member(i)).")

    if n > 1:
        _check_caches(kwargs, n, batch)

    def fold(value, own_batch: bool = False):
        if isinstance(value, PerMember):
            return value.tensor.reshape(-1, *value.tensor.shape[2:])
        if isinstance(value, torch.Tensor) and value.dim() > 0 and (value.shape[0] == batch or own_batch):
            return torch.cat([value] * n)  # member-major and contiguous (several times faster than repeat)
        return value

    main = next((k for k in (*PRIMARY_INPUTS, *kwargs) if k in kwargs and k in MODALITIES), None)

    def fold_kwarg(key: str, value):
        if key in NOT_BATCHED:
            return value
        if whole and main is not None and MODALITIES.get(key, MODALITIES[main]) != MODALITIES[main]:
            if isinstance(value, PerMember):  # (it reached the members' code as it was, and failed there)
                raise ValueError(
                    f"{key} gives each member its own beside {main}, and this model runs whole, member by member (a "
                    f"fallback: CLIP's members whose logit_scale differs), taking another modality's batch as every "
                    f"member's: give one {key} to all, or run the members alone (wide.member(i)).")
            return value  # another modality's batch, each member's whole
        if key == "encoder_outputs" and isinstance(value, (tuple, list)):  # given by the user: each member's rows
            return type(value)(fold(v) for v in value)
        if key == "encoder_outputs" and isinstance(value, dict):  # (a ModelOutput: its fields by name)
            return type(value)(**{k: fold(v) for k, v in value.items()})
        return fold(value, own_batches and key in BATCHED_INPUTS)

    return tuple(fold(a) for a in args), {k: fold_kwarg(k, v) for k, v in kwargs.items()}, batch


def _expand_per_position(kwargs: dict, batch: int) -> dict:
    """``kwargs`` with a 1-D ``token_type_ids`` beside 2-D ``input_ids`` (or 3-D ``inputs_embeds``) expanded to the
    batch, ``(T,) -> (B, T)``: one segment id per position, which the member's embedding lookup broadcasts over its
    rows (BERT's ``(T, D)`` added to ``(B, T, D)``). Left 1-D, its T positions read as T rows and were split among
    the members."""
    types = kwargs.get("token_type_ids")
    text = kwargs.get("input_ids")
    dims = text.dim() if isinstance(text, torch.Tensor) else None
    if dims is None and isinstance(kwargs.get("inputs_embeds"), torch.Tensor):
        dims = kwargs["inputs_embeds"].dim() - 1
    if isinstance(types, torch.Tensor) and types.dim() == 1 and dims == 2:
        return {**kwargs, "token_type_ids": types.expand(batch, *types.shape)}  # (B, T)
    return kwargs


# The inputs a model's batch is read from, in order (after its first positional argument)
PRIMARY_INPUTS = ("input_ids", "inputs_embeds", "input_values", "input_features", "pixel_values", "decoder_input_ids")
# The modality of each of BATCHED_INPUTS: those of one modality share its batch (texts' ids and mask)
MODALITIES = {"input_ids": "text", "attention_mask": "text", "token_type_ids": "text", "inputs_embeds": "text",
              "pixel_values": "image", "pixel_mask": "image", "input_features": "audio", "input_values": "audio"}
# Inputs that never hold the batch, whatever their length: indices of the positions to compute logits for, the
# cache's positions (a logits_to_keep of B indices was repeated N times, as the batch), Whisper's prompt for every row
# (prompt_ids of B tokens were repeated N times, and every member continued another prompt)
NOT_BATCHED = frozenset({"logits_to_keep", "num_logits_to_keep", "cache_position", "prompt_ids",
                         "num_items_in_batch"})


# Inputs that each hold a batch of their own in multimodal models (CLIP's texts and images), batch first
BATCHED_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "inputs_embeds", "pixel_values",
                            "pixel_mask", "input_features", "input_values"})


def other_batches(kwargs: dict, batch: int) -> tuple[int, ...]:
    """The batch sizes of :data:`BATCHED_INPUTS` other than ``batch`` (the first input's): CLIP's images beside its
    texts. Passed unfolded and seen whole by each member, they come back with N times their rows."""
    return tuple({v.shape[0] for k, v in kwargs.items() if k in BATCHED_INPUTS and isinstance(v, torch.Tensor)
                  and v.dim() and v.shape[0] != batch})
