"""How a wide module's output is held against its members' outputs: the tolerance, by dtype and scale, and the
layouts a wide output may take (``(N*B, ...)``: the folded rows, member-major; ``(N, ...)``: one per member; a
broadcast, ``(1, ...)`` expanded to the rows; or the member's very shape, the same for every member)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils import _pytree as pytree

UNCHECKED = object()  # in place of a member's output: that member is not checked in this comparison


# TF32 keeps 10 of float32's 23 mantissa bits: a unit roundoff of 4.9e-4, an eighth of bfloat16's (held to 2e-2 here);
# a quarter of bfloat16's tolerance leaves room for what adds up over the layers
TF32_REL = 5e-3


def tolerance(reference: torch.Tensor, tf32: bool = False) -> float:
    """The largest difference accepted against ``reference``: relative to its scale, by its dtype's precision.
    ``tf32``: float32 work on CUDA may have run in TF32 (:func:`tf32_possible`), so a float32 reference there is
    held to TF32's precision."""
    if reference.dtype in (torch.float32, torch.float64):
        rel = TF32_REL if tf32 and reference.dtype == torch.float32 and reference.is_cuda else 1e-4
    else:
        rel = 2e-2
    return rel * max(1.0, reference.detach().abs().max().item()) if reference.numel() else 0.0


def tf32_possible(model: nn.Module) -> bool:
    """Whether ``model``'s float32 work on CUDA may run in TF32: its matrix products where torch allows it
    (``torch.backends.cuda.matmul.allow_tf32``, ``set_float32_matmul_precision("high")``; off by default), its
    convolutions and recurrent layers where cuDNN does (``torch.backends.cudnn.allow_tf32``: on by default). Two
    computations of the same float32 convolution by different kernels then differ by TF32's rounding (a ConvNeXt's
    downsampling convolution on an H100: 3.7e-4 of its output's scale), which is no member's error."""
    if torch.backends.cuda.matmul.allow_tf32:
        return True
    return torch.backends.cudnn.allow_tf32 and any(isinstance(m, _CUDNN_TF32) or getattr(m, "runs_on_cudnn", False)
                                                   for m in model.modules())


_CUDNN_TF32 = (nn.modules.conv._ConvNd, nn.RNNBase)  # and hf-wide's modules that say so (WideConv)


def equal(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


def member_error(out, refs: list, rows: int, tf32: bool = False) -> float:
    """The largest error of the wide output ``out`` against the members' ``refs`` (:data:`UNCHECKED` for a member
    not checked here), in units of the tolerance (> 1 fails); inf where the layouts cannot be matched."""
    first, n = next(r for r in refs if r is not UNCHECKED), len(refs)
    if not isinstance(first, torch.Tensor):
        return 0.0 if all(equal(out, r) for r in refs if r is not UNCHECKED) or out is first else float("inf")
    if not isinstance(out, torch.Tensor):
        return float("inf")
    if first.dim() and out.shape == (n * first.shape[0], *first.shape[1:]):
        views = out.view(n, first.shape[0], *first.shape[1:])
    elif first.dim() and first.shape[0] == 1 and out.shape == (rows, *first.shape[1:]):  # broadcast, expanded
        views = out.view(n, rows // n, *first.shape[1:])
    elif out.shape == (n, *first.shape):
        views = out
    elif out.shape == first.shape:
        views = [out] * n
    else:
        return float("inf")
    worst = 0.0
    for view, ref in zip(views, refs):
        if ref is UNCHECKED:
            continue
        if not ref.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(view.expand_as(ref) if view.shape != ref.shape else view, ref)
                        else float("inf"))
            continue
        diff = (view.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
        worst = max(worst, diff / tolerance(ref, tf32) if diff else 0.0)
    return worst


def compare_outputs(output, member_outputs: list, rows: int, tf32: bool = False) -> str | None:
    """None if ``output`` (the wide module's) holds every member's output (but those :data:`UNCHECKED`); else what
    differs. ``tf32``: see :func:`tolerance`."""
    out_leaves, out_spec = pytree.tree_flatten(output)
    ref_flat = [None if o is UNCHECKED else pytree.tree_flatten(o) for o in member_outputs]
    if any(flat is not None and flat[1] != out_spec for flat in ref_flat):
        return "returned outputs of another structure than its members'"
    columns = [[UNCHECKED] * len(out_leaves) if flat is None else flat[0] for flat in ref_flat]
    for k, (out, *refs) in enumerate(zip(out_leaves, *columns)):
        error = member_error(out, refs, rows, tf32)
        if error > 1 and dataclasses.is_dataclass(out) and not isinstance(out, type):  # (a ModelOutput is a dict)
            return (f"returned a dataclass ({type(out).__name__}), whose tensors hf-wide cannot see (output {k}): "
                    "return a tuple, a dict or a transformers ModelOutput")
        if error > 1:
            what = "a layout that matches no member's" if error == float("inf") else f"{error:.3g}x the tolerance"
            return f"disagreed with its members (output {k}: {what})"
    return None


def device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is the accelerator's own failure (a CUDA device-side assert, say): the process's context on the
    device is gone and every later call on it fails too, so it is raised as it is, never taken for a strategy that
    disagrees and tried another way."""
    return isinstance(exc, getattr(torch, "AcceleratorError", ()))


def first_line(exc: BaseException, limit: int = 160) -> str:
    """``exc``'s type and the first line of its message, for a note in the plan: ``AssertionError`` alone for a bare
    ``assert`` (FSMT's attention checks its shapes so), whose message is empty."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__
