"""Padding-free encoder forwards: the layers of a padded batch run on its real tokens only.

A batch of texts is padded to its longest, and every padded position costs a real token's matmuls. Inside an
encoder whose layers act on each token alone apart from their attention (BERT, RoBERTa, XLM-RoBERTa, CamemBERT,
ELECTRA, DistilBERT, ALBERT, DeBERTa v1-v3, MPNet), only attention looks across positions, and it masks the padded
ones. So the encoder may carry its hidden states *packed*: the real tokens of the batch, member-major, ``(N, K, D)``.
That is the folded layout of one sequence of K tokens per member, which every wide primitive takes as it is. A fused
attention block (:mod:`hf_wide.blocks.attention`, ``.deberta``, ``.deberta_v2``, ``.mpnet``) scatters its Q, K and V
to the padded ``(N*B, T, .)`` layout for the attention call and gathers the call's output; the region's output is
scattered back, with zeros at the padded positions. The region is the encoder, or each layer where the encoder's own
code reads its states' length between layers (DeBERTa's relative positions); MPNet's encoder (:mod:`hf_wide.rewrites`)
takes the padded length from the packing.

What changes is the outputs at padded positions (zeros where the model computed values nothing should read). So
only pipelines pack, whose answers never read them (a sequence's first token, each input's own tokens), never
``wide(**inputs)``; and a model packs only where :func:`hf_wide.pipelines.packing.enable_packing` finds every
module inside its encoder known and a probe batch gives, packed, what it gives padded. This module holds the
layout, the per-call state (per thread, as the fold's rows) and the encoder's hooks.

A sequence classifier's head reads one token of each input, its first ([CLS], ``<s>``). Its encoder's last layer
then needs every token's keys and values but nothing else of the other tokens: called with ``first_tokens``, that
layer runs on the rows' first tokens, ``(N, B, D)``, and its fused attention takes its keys and values from the
layer's input at every token (:func:`keys_from`), its queries from the first tokens only. Measured (8 BERT members,
8 texts, one thread): a text-classification batch 1.32x faster at 2 layers of hidden 128, 1.12x at 6 layers of 256,
1.04x at 12. Pipelines ask for it where the model's probe agrees
(:func:`hf_wide.pipelines.packing.enable_first_tokens`); every other position of the encoder's output is then zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
from torch import nn

MIN_PADDED = 0.25  # pack a batch from this share of padded positions on (18% saved nothing here, 34% 22%)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where a batch's real tokens are: ``keep`` (K,), their indices among the B*T positions, row by row;
    ``source`` (B*T,), each position's index among the K packed tokens (K at padded positions); ``firsts`` (B,),
    each row's first position among the packed tokens, where every row's first position is a real token (else None)."""

    keep: torch.Tensor
    source: torch.Tensor
    firsts: torch.Tensor | None
    batch: int
    length: int

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "Packing":  # attention_mask: (B, T), 1 at real tokens
        batch, length = attention_mask.shape
        real = attention_mask.reshape(-1) != 0
        keep = real.nonzero().squeeze(1)
        source = torch.full((batch * length,), keep.numel(), dtype=torch.long)
        source[keep] = torch.arange(keep.numel())
        lengths = real.view(batch, length).sum(1)
        firsts = lengths.cumsum(0) - lengths if bool(real.view(batch, length)[:, 0].all()) else None
        return cls(keep, source, firsts, batch, length)

    def to(self, device: torch.device) -> "Packing":
        return dataclasses.replace(self, keep=self.keep.to(device), source=self.source.to(device),
                                   firsts=None if self.firsts is None else self.firsts.to(device))

    def pack(self, x: torch.Tensor) -> torch.Tensor:  # (N*B, T, ...) -> (N, K, ...)
        n = x.shape[0] // self.batch
        return x.reshape(n, self.batch * self.length, *x.shape[2:]).index_select(1, self.keep)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:  # (N, K, ...) -> (N*B, T, ...), zeros at padded positions
        n, rest = x.shape[0], x.shape[2:]
        # one gather from the packed rows and a row of zeros: a third faster than zero-filling the whole padded
        # buffer and copying the rows in (8 members, 8 texts of 30 positions, 126 real: 0.10 against 0.17 ms)
        rows = torch.cat([x, x.new_zeros(n, 1, *rest)], 1)  # (N, K + 1, ...)
        return rows.index_select(1, self.source).view(n * self.batch, self.length, *rest)

    def unpack_firsts(self, x: torch.Tensor) -> torch.Tensor:  # (N, B, ...) -> (N*B, T, ...), zeros but first positions
        n, rest = x.shape[0], x.shape[2:]
        padded = x.new_zeros(n * self.batch, self.length, *rest)
        padded[:, 0] = x.reshape(n * self.batch, *rest)
        return padded


class _State(threading.local):
    """This thread's packed call: its :class:`Packing`, whether the encoder's states are packed right now, whether
    an island (a module inside the encoder that runs padded) is running, whether the call asked for its encoders'
    last layers at the rows' first tokens only (``first_tokens``), and while such a layer runs, its input states
    (``keys_from``: its attention's keys and values come from every token)."""

    def __init__(self):
        self.packing: Packing | None = None
        self.inside = False
        self.island = False
        self.entered = False
        self.first_tokens = False
        self.keys_from: torch.Tensor | None = None
        self.pruned = False  # the encoder running now: its last layer ran at first tokens
        self.cut = False  # some encoder's did, in this call


_STATE = _State()


def active() -> Packing | None:
    """The packing of this thread's forward while its encoder's hidden states are packed, else None."""
    return _STATE.packing if _STATE.inside else None


def keys_from() -> torch.Tensor | None:
    """While an encoder's last layer runs at the rows' first tokens only (its states ``(N, B, D)``): that layer's
    input states at every real token, packed ``(N, K, D)``, whose keys and values its attention reads. Else None."""
    return _STATE.keys_from if _STATE.inside else None


@contextlib.contextmanager
def packed(attention_mask: torch.Tensor, device: torch.device | None = None, first_tokens: bool = False):
    """Run the wide forwards inside on ``attention_mask``'s real tokens only (in the encoders of models that
    :func:`hf_wide.pipelines.packing.enable_packing` took); with ``first_tokens``, each encoder's last layer runs,
    past its keys and values, on each row's first token only (in models that
    :func:`hf_wide.pipelines.packing.enable_first_tokens` took: their heads read nothing else).
    ``attention_mask``: (B, T) on the CPU, where finding its tokens costs a GPU no synchronisation."""
    packing = Packing.of(attention_mask)
    if device is not None:
        packing = packing.to(device)
    _STATE.packing, _STATE.inside, _STATE.island, _STATE.entered = packing, False, False, False
    _STATE.first_tokens, _STATE.keys_from, _STATE.pruned, _STATE.cut = first_tokens, None, False, False
    try:
        yield _STATE
    finally:
        _STATE.packing, _STATE.inside, _STATE.island = None, False, False
        _STATE.first_tokens, _STATE.keys_from, _STATE.pruned = False, None, False


def worth_packing(attention_mask: torch.Tensor) -> bool:
    """Whether enough of a batch is padding for packing to pay for its gathers and scatters."""
    return attention_mask.dim() == 2 and 1 - attention_mask.float().mean().item() >= MIN_PADDED


# ---------------------------------------------------------------- the encoder's hooks
def _enter(module: nn.Module, args: tuple, kwargs: dict):
    packing = _STATE.packing
    if packing is None or _STATE.inside:
        return None
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not (isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == packing.length
            and hidden.shape[0] % packing.batch == 0) or kwargs.get("query_states") is not None:
        return None  # not the batch this packing was made for (or DeBERTa's queries from elsewhere): runs padded
    _STATE.inside = _STATE.entered = True
    states = packing.pack(hidden)  # (N, K, D)
    return ((states, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": states})


_RECORDED = "A packed encoder returned per-layer states; hf-wide packs only calls that ask for none."


def _leave(module: nn.Module, args: tuple, kwargs: dict, output):
    if not _STATE.inside:
        return None
    _STATE.inside = False
    packing = _STATE.packing
    unpack = packing.unpack_firsts if _STATE.pruned else packing.unpack  # its last layer's (N, B, D) or (N, K, D)
    _STATE.pruned = False
    if isinstance(output, tuple):  # a layer's (states, its attention's probabilities, computed padded): DeBERTa
        if any(isinstance(r, tuple) for r in output[1:]):  # an encoder's (states, every layer's states, ...): MPNet
            raise RuntimeError(_RECORDED)
        return (unpack(output[0]), *output[1:])
    if any(output.get(k) is not None for k in ("hidden_states", "attentions")):
        raise RuntimeError(_RECORDED)
    output["last_hidden_state"] = unpack(output["last_hidden_state"])  # (N*B, T, D)
    return output


def _enter_last(module: nn.Module, args: tuple, kwargs: dict):
    """An encoder's last layer, in a call that asked for first tokens: its input states at every token become
    :func:`keys_from`, and it runs on each row's first token only."""
    packing = active()
    if packing is None or not _STATE.first_tokens or packing.firsts is None or _STATE.island:
        return None
    hidden = args[0] if args else kwargs["hidden_states"]  # (N, K, D)
    firsts = hidden.index_select(1, packing.firsts)  # (N, B, D)
    _STATE.keys_from, _STATE.pruned, _STATE.cut = hidden, True, True
    return ((firsts, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": firsts})


def _leave_last(module: nn.Module, args: tuple, kwargs: dict, output):
    _STATE.keys_from = None
    return None


def _enter_island(module: nn.Module, args: tuple, kwargs: dict):
    if not _STATE.inside:
        return None
    _STATE.inside, _STATE.island = False, True
    if args:
        return (_STATE.packing.unpack(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": _STATE.packing.unpack(kwargs["hidden_states"])}


def _leave_island(module: nn.Module, args: tuple, kwargs: dict, output):
    if not _STATE.island:
        return None
    _STATE.inside, _STATE.island = True, False
    if isinstance(output, torch.Tensor):
        return _STATE.packing.pack(output)
    return (_STATE.packing.pack(output[0]), *output[1:])  # (hidden states, attention weights, ...)


def install_hooks(encoder: nn.Module, islands: list[nn.Module] = (), last: nn.Module | None = None) -> list:
    """Hooks that pack ``encoder``'s input states and unpack its output in calls inside :func:`packed` (and do
    nothing in others), that run each of the ``islands`` inside it padded (its first input unpacked, its first
    output packed: an attention that is the model's own code), and that run its ``last`` layer on the rows' first
    tokens in calls that ask for it; returns their handles."""
    handles = [encoder.register_forward_pre_hook(_enter, with_kwargs=True),
               encoder.register_forward_hook(_leave, with_kwargs=True)]
    for island in islands:
        handles += [island.register_forward_pre_hook(_enter_island, with_kwargs=True),
                    island.register_forward_hook(_leave_island, with_kwargs=True)]
    if last is not None:
        handles += [last.register_forward_pre_hook(_enter_last, with_kwargs=True),
                    last.register_forward_hook(_leave_last, with_kwargs=True)]
    return handles


def is_packing_hook(hook) -> bool:
    return hook in (_enter, _leave, _enter_island, _leave_island, _enter_last, _leave_last)


def remove_packing_hooks(model: nn.Module) -> None:
    """Take this module's packing hooks out of ``model`` (a member's copy, which packs nothing)."""
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if is_packing_hook(h)]:
                del hooks[key]
                for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
                    getattr(module, extra).pop(key, None)
