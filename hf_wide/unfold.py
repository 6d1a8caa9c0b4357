"""The wide model's outputs unfolded: every tensor of the N*B folded rows given a leading member dim, ``(N, B, ...)``."""

from __future__ import annotations

from typing import Any

import torch

# ModelOutput keys of per-layer tuples, whose tensors may hold rows flattened from the N*B, batch first
LAYER_OUTPUTS = ("hidden_states", "attentions")


def _unfold_layer(t: Any, n: int, rows: tuple[int, ...], unfolded: list | None = None) -> Any:
    """One layer's hidden states or attentions: N*B rows (or N*B' of an input with a batch of its own: CLIP's image
    tower), or rows flattened from them with the batch first (a multiple-choice head's N*B*C, a windowed attention's
    N*B*W), member-major: ``(N, rows / N, ...)``."""
    if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] and any(t.shape[0] % r == 0 for r in rows):
        return _made(t.view(n, t.shape[0] // n, *t.shape[1:]), unfolded)
    return t


def _made(t: torch.Tensor, unfolded: list | None) -> torch.Tensor:
    if unfolded is not None:
        unfolded.append(t)
    return t


def unfold_outputs(outputs: Any, n: int, batch: int, keep: tuple[torch.Tensor, ...] = (),
                   others: tuple[int, ...] = (), unfolded: list | None = None) -> Any:
    """Give every output tensor with ``N*B`` rows a leading member dim: ``(N*B, ...) -> (N, B, ...)``; the tensors
    in ``keep`` (the members' losses, ``(N,)``, which have N rows when B is 1) stay as they are. ``others``: the
    batch sizes of other inputs (:func:`hf_wide.inputs.other_batches`), whose outputs' ``N*B'`` rows become ``(N, B', ...)`` too.

    Works through tuples, lists, dicts and transformers ``ModelOutput``s (updated in place, so their
    attributes follow); caches and scalars pass unchanged. A ModelOutput's per-layer hidden states and attentions
    also split rows flattened from the N*B (:data:`LAYER_OUTPUTS`). A plain walk: pytree is several times slower
    here, and this runs on every forward. ``unfolded``: a list to which every tensor given a member dim is added
    (what the ranks of a member-parallel model gather).
    """
    rows = n * batch
    if isinstance(outputs, torch.Tensor):
        if not outputs.dim() or any(outputs is k for k in keep):
            return outputs
        if outputs.shape[0] == rows:
            return _made(outputs.view(n, batch, *outputs.shape[1:]), unfolded)
        if others and outputs.shape[0] in [n * b for b in others]:
            return _made(outputs.view(n, outputs.shape[0] // n, *outputs.shape[1:]), unfolded)
        return outputs
    if isinstance(outputs, dict):  # ModelOutput is a dict whose items mirror its attributes
        for key, value in outputs.items():
            if isinstance(value, tuple) and key.endswith(LAYER_OUTPUTS):
                outputs[key] = tuple(_unfold_layer(t, n, (rows, *(n * b for b in others)), unfolded) for t in value)
            elif key == "mems" and isinstance(value, tuple):  # XLNet's, time-major: (N*T, B, D) -> (N, T, B, D), B*C
                # rows for a multiple-choice head
                outputs[key] = tuple(_made(t.view(n, -1, *t.shape[1:]), unfolded) if isinstance(t, torch.Tensor)
                                     and t.dim() > 1 and t.shape[1] % batch == 0 and t.shape[0] % n == 0 else t
                                     for t in value)
            else:
                outputs[key] = unfold_outputs(value, n, batch, keep, others, unfolded)
        return outputs
    if isinstance(outputs, (tuple, list)):
        return _like(outputs, [unfold_outputs(v, n, batch, keep, others, unfolded) for v in outputs])
    return outputs


def _like(sequence: tuple | list, items: list) -> tuple | list:
    """``items`` in a sequence of ``sequence``'s type: a named tuple's takes them as its fields."""
    return type(sequence)(*items) if hasattr(sequence, "_fields") else type(sequence)(items)


def unfold_generated(output: Any, n: int, rows: int | None = None) -> Any:
    """``generate``'s output (``return_dict_in_generate``) with a member dim on every tensor: their rows are the N*B
    inputs' (times the beams, or the sequences returned per input), member-major: ``(N, rows / N, ...)``; walks the
    steps' tuples (scores, each layer's attentions); the cache passes unchanged. ``beam_indices`` index the rows
    of the forwards (``rows``: N*B times the beams): member i's are made its own, as if it had run alone."""
    if isinstance(output, torch.Tensor):
        return output.view(n, -1, *output.shape[1:]) if output.dim() and output.shape[0] % n == 0 else output
    if isinstance(output, dict):
        for key, value in output.items():
            output[key] = unfold_generated(value, n)
            if key == "beam_indices" and isinstance(value, torch.Tensor) and rows is not None:
                first = torch.arange(n, device=value.device).mul_(rows // n).view(n, *[1] * (value.dim()))
                output[key] = torch.where(output[key] >= 0, output[key] - first, output[key])  # -1: no beam
        return output
    if isinstance(output, (tuple, list)):
        return _like(output, [unfold_generated(v, n) for v in output])
    return output
