"""``WideModel.generate``: each member's own continuation, from one ``generate`` over the folded rows.

The members' rows are folded into one batch of N*B and transformers' ``generate`` runs on the wide model: each step
is one wide forward over a KV cache of N*B rows. The fold's pre-hook records the rows of every forward it makes
(beams and several sequences per input multiply them), so the output is cut back into members by the last one.

That one ``generate`` runs one generation config for every row, the wide model's (its first member's as loaded):
where the members' own configs (``generation_config.json``) differ in a setting the call does not give, the call is
refused (:func:`~hf_wide.generation_configs.check_generation_configs`), since a member would not continue as it does
alone.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from .capture import asks_for_capture, require_recorded
from .generation_configs import check_generation_configs
from .generation_ends import record_row_ends, stop_recording
from .inputs import fold_inputs
from .parallel_calls import agree_on_inputs, gather_members, local_inputs, on_every_rank_alike
from .unfold import unfold_generated


def generate_wide(wide, args: tuple, kwargs: dict):
    """:meth:`hf_wide.WideModel.generate`: ``(N, B, T')`` tokens, or transformers' output with every member's."""
    if not hasattr(wide.model, "generate"):
        raise TypeError(f"{type(wide.model).__name__} cannot generate.")
    group = wide.members_group
    if group is None:
        check_generation_configs(wide.member_generation_configs, kwargs)
        out, rows, _ = _generate_here(wide, args, kwargs)
        return out if isinstance(out, torch.Tensor) else unfold_generated(out, wide.fold.num_members, rows)
    agree_on_inputs(group, (args, kwargs))  # (each rank continued its own prompt, and the members were mixed)
    error = None
    try:
        check_generation_configs(wide.member_generation_configs, kwargs)
        out, rows, returns_dict = _generate_here(wide, *local_inputs(group, args, kwargs))
    except Exception as exc:  # told to every rank, which raise too: they wait for this one's tokens to gather
        error = exc
    on_every_rank_alike(group, error)
    if returns_dict:  # the same on every rank: raised by all of them
        raise NotImplementedError("A member-parallel wide model's generate returns the sequences alone: each "
                                  "rank stops when its own members are done, so their steps' scores differ in "
                                  "number. Call it without return_dict_in_generate.")
    # Each rank stops when its own members are done; padded as one process pads members done early.
    return gather_members(group, out, pad_token(kwargs, wide.model))


def _generate_here(wide, args: tuple, kwargs: dict) -> tuple:
    """This process's members' continuations: ``(n, B, T')`` tokens, or transformers' output over the folded rows
    (with the rows of its last forward, to cut it into members), and whether that output was asked for."""
    n = wide.fold.num_members
    refuse_one_sequence_options(kwargs, wide.model)
    refuse_row_subsets(args, kwargs, wide.model)
    args, kwargs, batch = fold_inputs(n, args, kwargs)
    kwargs = per_row_options(kwargs, n, batch, wide.model)
    returns_dict = _returns_dict(kwargs, wide.model)
    if (not wide._capture_hooks or wide._unrecorded) and asks_for_capture(kwargs, wide.config):
        wide._install_capture_hooks()  # asked for, or by config (router logits, whose loss generate drops)
        if returns_dict:
            require_recorded(wide._unrecorded, kwargs, wide.config)
    wide.fold.recording = True  # the pre-hook records the rows of every forward generate() makes
    # (and before the first, the N*B inputs': a multimodal model's image features, which transformers' generate
    # computes with get_image_features, no forward: a broadcast inside, SigLIP's positions, made N rows, not N*B)
    first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if first is not None and batch:
        wide.fold.anchor = first.new_empty(n * batch, 0)
    outer, WIDE_GENERATE.active = getattr(WIDE_GENERATE, "active", False), True
    ends = record_row_ends(wide.model)
    try:
        out = wide.model.generate(*args, **kwargs)
        rows = wide.fold.rows  # of its last forward: N*B, times the beams
    finally:
        wide.fold.reset()
        WIDE_GENERATE.active = outer
        stop_recording(ends)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    if (_effective_config(kwargs, wide.model).num_beams or 1) == 1:  # (beams: rows reordered, and padded by beams)
        ends.pad_members(sequences, n, pad_token(kwargs, wide.model))  # done early, where nothing padded them
    if isinstance(out, torch.Tensor) or wide.members_group is not None:
        out = sequences.view(n, -1, sequences.shape[-1])  # (N, B, T')
    return out, rows, returns_dict


# Ways of generating that transformers runs on one sequence at a time, where a wide model generates N*B rows
ONE_SEQUENCE = {"assistant_model": "assisted generation", "prompt_lookup_num_tokens": "prompt lookup decoding",
                "streamer": "a streamer", "assistant_early_exit": "self-speculative decoding"}


def pad_token(kwargs: dict, model: nn.Module) -> int:
    """The token ``generate`` pads sequences done early with: the pad token of the config it runs with (a
    ``generation_config=`` passed, or the model's, with ``kwargs`` on it), else its first end-of-sequence token, as
    transformers falls back (the ranks of a member-parallel model padded with 0 where one process pads with it)."""
    config = _effective_config(kwargs, model)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        eos = getattr(config, "eos_token_id", None)
        eos = eos.reshape(-1).tolist() if isinstance(eos, torch.Tensor) else eos
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    return 0 if pad is None else int(pad)


def _effective_config(kwargs: dict, model: nn.Module):
    """The generation config ``generate`` will run with: the one passed, what it leaves unset filled from the model's
    (as transformers fills it), or the model's; with ``kwargs`` on it."""
    own, passed = getattr(model, "generation_config", None), kwargs.get("generation_config")
    config = copy.deepcopy(passed if passed is not None else own)
    if passed is not None and own is not None:
        for key, value in vars(own).items():
            if value is not None and getattr(config, key, None) is None:
                setattr(config, key, copy.deepcopy(value))
    if config is not None:
        config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def refuse_one_sequence_options(kwargs: dict, model: nn.Module) -> None:
    """Refuse what transformers runs on one sequence only (its error would speak of a batch the user did not
    give: the wide model's N*B rows)."""
    config = _effective_config(kwargs, model)
    for key, what in ONE_SEQUENCE.items():
        if kwargs.get(key) is not None or getattr(config, key, None) is not None:
            raise ValueError(f"{what} ({key}=) runs one sequence at a time, and a wide model's generate runs every "
                             f"member's rows at once: run it on one member, wide.member(i).generate(..., {key}=...).")


def refuse_row_subsets(args: tuple, kwargs: dict, model: nn.Module) -> None:
    """Refuse Whisper's long-form transcription and its temperature fallback: transformers drops the rows that are
    done (an audio transcribed to its end) or re-runs those that need it, so a forward holds some rows of some
    members, which the fold cannot tell apart (shapes that do not divide among the members raised; those that do
    would run a row with another member's weights)."""
    if not hasattr(model, "_retrieve_total_input_frames"):  # transformers' WhisperGenerationMixin
        return
    _keep_every_row(model)
    features = kwargs.get("input_features", args[0] if args else None)
    features = getattr(features, "tensor", features)  # (a PerMember's)
    encoder = model.get_encoder()  # (a PeftModel holds the model a level down)
    stride = getattr(encoder.conv1, "stride", (1,))[0] * getattr(encoder.conv2, "stride", (2,))[0]
    long_form = isinstance(features, torch.Tensor) and features.shape[-1] > stride * model.config.max_source_positions
    config = _effective_config(kwargs, model)
    if long_form or isinstance(config.temperature, (list, tuple)) and len(config.temperature) > 1:
        what = ("long-form transcription (input features longer than one window)" if long_form else
                "a temperature fallback (temperature=(...))")
        raise ValueError(f"Whisper's {what} drops or re-runs some rows of a batch as they finish or fail, and a wide "
                         "model's rows are every member's: run it on each member, wide.member(i).generate(...).")
    # Whisper's generate hands back each sequence's logits, hidden states and attentions by the sequence's row among
    # the beams' rows: over N*B sequences, member 1's read member 0's beams (as many returned as beams too)
    beams, returned = config.num_beams or 1, config.num_return_sequences or 1
    asked = [k for k in ("output_logits", "output_hidden_states", "output_attentions") if getattr(config, k, False)]
    if config.return_dict_in_generate and beams > 1 and asked:
        raise ValueError(f"Whisper's beam search ({beams} beams, {returned} returned) gives each sequence's "
                         f"{', '.join(k.removeprefix('output_') for k in asked)} by its row among the beams', which a "
                         "wide model's rows of every member would mix up: run it on each member, "
                         "wide.member(i).generate(...), or ask for scores only.")


def _keep_every_row(model: nn.Module) -> None:
    """Make Whisper's generate raise where, in a wide model's generate, it would go on with some rows only. It
    transcribes window after window while a row's audio is not done, and a segment that ends before its window's end
    (with timestamps, or as tokens fall) leaves the next window to begin there: rows done sooner are dropped from the
    batch, and the rest of the fold would run with other members' weights (or not split into members). Installed once
    on the model; inert outside a wide model's generate (``wide.member(i)``'s copy keeps it)."""
    whisper = next(m for m in model.modules() if hasattr(type(m), "_maybe_reduce_batch"))  # (a PeftModel's base's)
    if not isinstance(whisper.__dict__.get("_maybe_reduce_batch"), KeepEveryRow):
        whisper._maybe_reduce_batch = KeepEveryRow(type(whisper)._maybe_reduce_batch)  # (a static method: read from
                                                                                      # the instance first)


class KeepEveryRow:
    """Whisper's ``_maybe_reduce_batch``, refusing to drop rows while this thread runs a wide model's generate."""

    def __init__(self, reduce):
        self.reduce = reduce

    def __call__(self, input_features, seek, max_frames, cur_bsz, batch_idx_map):
        reduced = self.reduce(input_features, seek, max_frames, cur_bsz, batch_idx_map)
        if reduced[1] < cur_bsz and getattr(WIDE_GENERATE, "active", False):
            raise ValueError(f"Whisper's generate went on to another window with {reduced[1]} of its {cur_bsz} rows, "
                             "dropping those whose audio was done (a segment ended before its window's end: with "
                             "return_timestamps=True, or as the tokens fell), and a wide model's rows are every "
                             "member's: run it on each member, wide.member(i).generate(...).")
        return reduced


WIDE_GENERATE = threading.local()  # .active: this thread runs a wide model's generate


def per_row_options(kwargs: dict, n: int, batch: int, model: nn.Module) -> dict:
    """``kwargs`` with what transformers takes per row of the batch made per row of the N*B folded ones: Whisper's
    ``language`` list (one per input), and a ``prefix_allowed_tokens_fn``, which transformers calls with the row's
    index among N*B inputs and is given its index among the user's B."""
    language = kwargs.get("language")
    if isinstance(language, (list, tuple)) and len(language) == batch:
        kwargs = {**kwargs, "language": list(language) * n}  # member-major, as the rows
    allowed = kwargs.get("prefix_allowed_tokens_fn")
    if allowed is not None:  # (transformers' batch id is the input's, beams and sequences of it together)
        kwargs = {**kwargs, "prefix_allowed_tokens_fn": lambda batch_id, ids: allowed(batch_id % batch, ids)}
    return kwargs


def _returns_dict(kwargs: dict, model: nn.Module) -> bool:
    """Whether ``generate`` with ``kwargs`` returns transformers' output rather than the sequences alone."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return bool(kwargs.get("return_dict_in_generate", getattr(config, "return_dict_in_generate", False)))
