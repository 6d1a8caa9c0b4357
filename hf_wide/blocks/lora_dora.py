"""DoRA (weight-decomposed LoRA: PEFT's ``use_dora=True``) in a :class:`~hf_wide.blocks.lora.WideLoraLinear`.

PEFT's DoRA layer scales each output feature of the adapted weight to a magnitude it learnt:

    y = base(x) + (m / n - 1) * (base(x) - b) + (m / n) * s * (x @ A.T) @ B.T       n = ||W + s * B @ A||, each row
    m: (D_out,) the magnitude; n: (D_out,) the norms of the adapted weight's rows, held constant (no gradient)

For N members: ``magnitude`` (N, D_out), and the norms (N, D_out), computed one member at a time (one adapted weight
in memory, as in each PEFT member's forward) and kept until a tensor they come from changes (its storage or its
version: an optimiser's step, a state dict loaded): a forward then costs the LoRA update and two elementwise passes
over the output, not N weight-sized products. Under ``torch.compile`` they are computed in the graph at every call.
Taken over one ``nn.Linear`` or GPT-2 ``Conv1D`` base (adapters of one base), or their wide classes (members whose
base weights differ); PEFT's DoRA on convolutions and embeddings runs as each member's own code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..primitives.linear import WideConv1D, WideLinear

try:
    from peft.tuners.lora.dora import DoraLinearLayer
    from peft.tuners.lora.variants import DoraLinearVariant
except ImportError:  # peft is optional
    DoraLinearLayer = DoraLinearVariant = None


def is_dora(module: nn.Module, adapter: str) -> bool:
    """Whether ``module`` (a ``lora.Linear``) runs ``adapter`` as DoRA."""
    return DoraLinearVariant is not None and type(module.lora_variant.get(adapter)) is DoraLinearVariant


def stacked_magnitudes(mods: Sequence[nn.Module], adapter: str, device: torch.device) -> nn.Parameter | None:
    """The members' DoRA magnitudes, (N, D_out) in their dtype; None where no member's adapter is DoRA. Members must
    all be DoRA or none: the planner sees a ``lora_magnitude_vector`` in some members only, and does not build."""
    flags = [is_dora(m, adapter) for m in mods]
    if not any(flags):
        return None
    if not all(flags):
        raise ValueError("WideLoraLinear: some members' adapters are DoRA and some are not.")
    weights = [m.lora_magnitude_vector[adapter].weight for m in mods]
    return nn.Parameter(torch.stack([w.detach() for w in weights]).to(device), requires_grad=weights[0].requires_grad)


def weight_norms(layer: nn.Module) -> torch.Tensor:
    """(N, D_out): each member's ``||W + s * B @ A||`` by rows, as PEFT's ``DoraLinearLayer.get_weight_norm``, in the
    adapters' dtype. Computed at every forward that trains them (gradients on, one of their tensors trainable), as
    PEFT does, and the kept ones dropped (a training loop that steps through ``p.data``, which no version counter
    sees, read norms of the weights before its steps: 2.6% off after three, and its evaluations between steps too);
    kept for inference on ``layer`` with what it was computed from (``layer._dora_norms``: the tensors and their
    versions, which every in-place write but one through ``.data`` moves on: such a write between two forwards that
    train nothing is not seen)."""
    tensors = (layer.base_layer.weight, layer.lora_A, layer.lora_B, layer.scaling, layer.rank)
    trains = torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, layer.magnitude))
    if trains and not torch.compiler.is_compiling():
        layer.__dict__.pop("_dora_norms", None)
    if torch.compiler.is_compiling() or trains or any(t.is_inference() for t in (layer.lora_A, layer.lora_B)):
        return _norms(layer)  # (an inference tensor keeps no version: nothing would tell a write)
    key = tuple((id(t), t.untyped_storage().data_ptr(), t.storage_offset(), t._version) for t in tensors)
    kept = layer.__dict__.get("_dora_norms")
    if kept is None or kept[0] != key:
        kept = (key, _norms(layer))
        layer._dora_norms = kept  # one attribute, (key, norms): a thread reads both as they were written
    return kept[1]


def base_weights(layer: nn.Module) -> torch.Tensor:
    """The members' base weights as (N or 1, D_out, D_in) (a view: GPT-2's ``Conv1D`` holds (D_in, D_out))."""
    base = layer.base_layer
    weight = base.weight if isinstance(base, (WideLinear, WideConv1D)) else base.weight.unsqueeze(0)
    return weight.transpose(1, 2) if isinstance(base, (Conv1D, WideConv1D)) else weight


@torch.no_grad()
def _norms(layer: nn.Module) -> torch.Tensor:
    dtype, weights = layer.lora_A.dtype, base_weights(layer)
    norms = []
    for i, rank in enumerate(layer.rank.tolist()):
        weight = weights[i if weights.shape[0] > 1 else 0]  # (D_out, D_in)
        a, b = layer.lora_A[i, :rank], layer.lora_B[i, :, :rank]  # (r, D_in), (D_out, r): the member's own rank
        lora_weight = F.linear(a.t(), b).t()  # B @ A, as PEFT computes it: lora_B(lora_A(eye)).T
        adapted = weight.to(dtype) + layer.scaling[i].item() * lora_weight
        norms.append(torch.linalg.norm(adapted, dim=1).to(dtype))
    return torch.stack(norms)  # (N, D_out)


def dora_output(layer: nn.Module, x: torch.Tensor, rows: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The layer's output for DoRA members. ``x`` (N*B, ..., D_in) the input, ``rows`` (N, M, D_in) it in the
    adapters' dtype (dropped out, in training), ``low`` (N, M, r) their ``rows @ A.T``, unscaled."""
    n = layer.fold.num_members
    result = layer._base(x)  # (N*B, ..., D_out), the base's dtype, with its bias: this call's own tensor
    out = result.view(n, -1, result.shape[-1])  # (N, M, D_out)
    base = layer.base_layer
    bias = layer.base_bias if layer.base_bias is not None else base.bias  # (N, D_out), (D_out,) or None
    bias = None if bias is None else bias.view(-1, 1, bias.shape[-1])  # (N or 1, 1, D_out)
    scale = (layer.magnitude / weight_norms(layer)).unsqueeze(1)  # (N, 1, D_out): m / n
    scaling = layer.scaling.view(n, 1, 1)
    dropped = layer.training and not isinstance(layer.lora_dropout, nn.Identity)
    if not dropped and out.dtype == low.dtype:
        # base + (m/n - 1) * (base - b) + m/n * s * lora = m/n * (base - b + s * lora) + b: the update in the batched
        # matmul itself, then a pass (three with a bias) over the output, not five
        if bias is not None:
            out.sub_(bias)
        out.baddbmm_(low * scaling, layer.lora_B.transpose(1, 2))
        out.mul_(scale)
        if bias is not None:
            out.add_(bias)
        return result
    # PEFT's own order: over a half-precision base, the update in the adapters' float32, added and rounded once; in
    # training with a dropout, the base again on the dropped rows
    if dropped:
        weight = base_weights(layer).expand(n, -1, -1)  # (N, D_out, D_in)
        base_result = torch.bmm(rows, weight.to(rows.dtype).transpose(1, 2))  # (N, M, D_out), no bias
    else:
        base_result = out if bias is None else out - bias
    lora = torch.bmm(low, layer.lora_B.transpose(1, 2))  # (N, M, D_out)
    update = (scale - 1) * base_result + scale * lora * scaling
    return (out + update).to(result.dtype).view(result.shape)
