"""LoRA members: PEFT's ``lora.Linear``, one base matmul for every member plus each member's low-rank update.

    y = base(x) + scale_m * (x_m @ A_m.T) @ B_m.T        x_m: member m's rows
    A: (N, r, D_in), B: (N, D_out, r), scale: (N,)

The base layer stays one ``nn.Linear`` where every member's base weights are equal (adapters of one base: one
matmul over all N*B rows with the base's one weight, the ideal's weight traffic), with each member's own bias
``base_bias`` (N, D_out) where only the biases differ (PEFT's ``bias="all"`` and ``"lora_only"`` train them), and
is a ``WideLinear`` where the weights differ. The updates run as two batched matmuls over the members. Ranks may
differ: ``A`` and ``B`` are zero-padded to the largest rank (the padded rows and columns add zeros).
``lora_alpha`` and ``use_rslora``, and so the scaling, may differ: ``scale`` holds each member's.

Only LoRA with one adapter, active, unmerged, over an exact ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2's,
which PEFT wraps with ``fan_in_fan_out``: that flag only transposes the merged delta, the forward is the same) is
taken, vanilla or DoRA (:mod:`hf_wide.blocks.lora_dora`, ``magnitude`` (N, D_out)); PEFT's
other variants, a bias on ``lora_B`` or any other base layer are declined, and the module then runs as each
member's own code.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..primitives.base import keeps_storage, kept, meta_copies, same_value
from ..primitives.linear import WideConv1D, WideLinear
from ..registry import register_block
from .base import WideBlock
from .lora_dora import DoraLinearLayer, dora_output, is_dora, stacked_magnitudes
from .lora_parts import MemberDropout, adapter_dtype, equal_tensors, member_dropout, one_scale

try:
    from peft.tuners.lora import Linear as LoraLinear
except ImportError:  # peft is optional: without it there are no LoRA members to fuse
    LoraLinear = None


# The base layers taken, and the fan_in_fan_out PEFT gives each (it sets the flag from the base layer's class).
BASE_LAYERS = {nn.Linear: False, Conv1D: True}


def lora_refusal(module: nn.Module) -> str | None:
    """Why :class:`WideLoraLinear` cannot take this ``lora.Linear``, or None."""
    names = list(module.lora_A.keys())
    if len(names) != 1 or list(module.active_adapters) != names:
        return f"it holds adapters {names}, active {list(module.active_adapters)}: one adapter, active, is needed"
    (name,) = names
    if module.merged or module.disable_adapters:
        return "its adapter is merged into the base weight or disabled"
    if name in module.lora_variant and not is_dora(module, name):
        return f"its adapter is a {type(module.lora_variant[name]).__name__} (not vanilla LoRA or DoRA)"
    if is_dora(module, name) and module.ephemeral_gpu_offload:
        return "its DoRA adapter is set to ephemeral_gpu_offload"
    if BASE_LAYERS.get(type(module.base_layer)) != module.fan_in_fan_out:  # Conv1D's weight is (D_in, D_out)
        return f"its base layer is a {type(module.base_layer).__name__} (fan_in_fan_out={module.fan_in_fan_out})"
    if module.lora_B[name].bias is not None or module.lora_A[name].bias is not None:
        return "its adapter has a bias (lora_bias=True)"
    return None


class WideLoraLinear(WideBlock):
    """N members' ``lora.Linear`` layers: ``base_layer`` shared or wide, ``base_bias`` (N, D_out) or None (a
    shared base layer's biases, where they differ), ``lora_A`` (N, r, D_in), ``lora_B`` (N, D_out, r), ``scaling``
    (N,), ``rank`` (N,) each member's own rank (``r`` is the padded one), ``magnitude`` (N, D_out) DoRA's, or None."""

    @staticmethod
    def member_attribute(path: str, name: str) -> bool:
        """Whether attribute ``name`` of the submodule at ``path`` (relative; "" is the layer) may differ between
        members, taken here per member: the rank and the scaling it comes from (and ``kwargs``, PEFT's record of
        how the layer was made, which its forward does not read), and the dropout, whole (:func:`member_dropout`)."""
        if not path:  # lora_variant: PEFT's DoRA object, one per member (DoRA in all of them, or in none: planner)
            return name in ("r", "lora_alpha", "scaling", "use_rslora", "kwargs", "lora_variant")
        if path.startswith("lora_dropout."):  # each member's own, whatever it is (nn.Identity where p is 0)
            return True
        return (path.startswith("lora_A.") and name == "out_features") or (
            path.startswith("lora_B.") and name == "in_features")

    own_modules = () if DoraLinearLayer is None else (DoraLinearLayer,)  # DoRA's magnitude: lora_dora.py

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return lora_refusal(module) is None

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        return lora_refusal(module)

    @staticmethod
    def shapes_may_differ(name: str) -> bool:
        """Whether a tensor of this name (relative to the module) may differ in shape between members: the rank."""
        return name.startswith(("lora_A.", "lora_B."))

    def build(self, mods: Sequence[nn.Module]) -> None:
        (self.adapter,) = mods[0].lora_A.keys()
        bases = [m.base_layer for m in mods]
        if any(b.weight.shape != bases[0].weight.shape for b in bases):
            raise ValueError("WideLoraLinear: the members' base layers differ in shape.")
        self.register_parameter("base_bias", None)
        # Held once where it is the same in every member and nothing of it trains: a bias PEFT's bias="all" trains,
        # held once, took every member's gradient
        trains = [t.requires_grad for t in (bases[0].weight, bases[0].bias) if t is not None]
        if not any(trains) and all(equal_tensors(b, bases[0]) for b in bases[1:]):
            self.base_layer = kept(bases[0])
        elif (bases[0].bias is not None and not trains[0]
              and all(same_value(b.weight, bases[0].weight) for b in bases[1:])):
            # the base's one weight and each member's own bias (PEFT's bias="all" or "lora_only" trains them)
            self.base_layer = _without_bias(bases[0])
            self.base_bias = nn.Parameter(torch.stack([b.bias.detach() for b in bases]),
                                          requires_grad=bases[0].bias.requires_grad)  # (N, D_out)
        else:
            wide = WideConv1D if type(bases[0]) is Conv1D else WideLinear
            self.base_layer = wide.from_modules(bases, self.fold)
        ranks = [m.r[self.adapter] for m in mods]
        r = max(ranks)
        d_in, d_out = mods[0].in_features, mods[0].out_features  # PEFT's, read from either base layout
        dtype = adapter_dtype(mods) or bases[0].weight.dtype
        a = _stacked([m.lora_A[self.adapter].weight for m in mods], (len(mods), r, d_in), 0, dtype)
        b = _stacked([m.lora_B[self.adapter].weight for m in mods], (len(mods), d_out, r), 1, dtype)
        if a is None or b is None:
            a = torch.zeros(len(mods), r, d_in, dtype=dtype)
            b = torch.zeros(len(mods), d_out, r, dtype=dtype)
            for i, (m, rank) in enumerate(zip(mods, ranks)):
                a[i, :rank] = m.lora_A[self.adapter].weight.detach()
                b[i, :, :rank] = m.lora_B[self.adapter].weight.detach()
        self.hold(a, b, torch.tensor([m.scaling[self.adapter] for m in mods], dtype=dtype), torch.tensor(ranks),
                  stacked_magnitudes(mods, self.adapter, bases[0].weight.device),
                  member_dropout([m.lora_dropout[self.adapter] for m in mods]), meta_copies(mods, self.proto),
                  trainable=mods[0].lora_A[self.adapter].weight.requires_grad)  # as the source's: PEFT trains these
        if keeps_storage():  # our own members (adapters loaded here): theirs become views of these, held once
            for i, (m, rank) in enumerate(zip(mods, ranks)):
                _rebind(m.lora_A[self.adapter], self.lora_A.detach()[i, :rank])
                _rebind(m.lora_B[self.adapter], self.lora_B.detach()[i, :, :rank])
                if self.base_bias is not None:
                    m.base_layer.bias = nn.Parameter(self.base_bias.detach()[i], m.base_layer.bias.requires_grad)

    def hold(self, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, ranks: torch.Tensor,
             magnitude: nn.Parameter | None, dropout: nn.Module, protos: list, trainable: bool) -> None:
        """Take the members' stacked tensors (``a`` (N, r, D_in), ``b`` (N, D_out, r), ``scaling`` and ``ranks``
        (N,), DoRA's ``magnitude``), their dropout and their meta copies, on the base layer's device."""
        device = self.base_layer.weight.device
        self.lora_A = nn.Parameter(a.to(device), requires_grad=trainable)
        self.lora_B = nn.Parameter(b.to(device), requires_grad=trainable)
        self.__dict__.pop("scaling", None)  # member 0's {adapter: scaling}, copied from the source: each member's here
        self.register_buffer("scaling", scaling.to(device))
        self.register_buffer("rank", ranks, persistent=False)
        self.register_parameter("magnitude", magnitude)  # DoRA
        self.lora_dropout = dropout
        object.__setattr__(self, "protos", protos)  # each member's ranks and attributes

    @classmethod
    def join(cls, layers: Sequence["WideLoraLinear"], fold) -> "WideLoraLinear | None":
        """One layer of the members of ``layers`` (wide LoRA layers over one base layer: groups of adapters,
        :mod:`hf_wide.adapter_groups`), in order, their stacked tensors concatenated; None where they do not join so
        (a base layer of the members' own, adapters padded to other ranks, each member's own dropout)."""
        first = layers[0]
        if (isinstance(first.base_layer, (WideLinear, WideConv1D)) or isinstance(first.lora_dropout, MemberDropout)
                or not all(_alike(layer, first) for layer in layers[1:])):
            return None
        joined = cls(fold, first.proto)
        joined.adapter, joined.base_layer = first.adapter, first.base_layer

        def cat(name: str) -> torch.Tensor | None:
            tensors = [getattr(layer, name) for layer in layers]
            return None if tensors[0] is None else torch.cat([t.detach() for t in tensors])

        bias = cat("base_bias")
        joined.register_parameter("base_bias", None if bias is None else nn.Parameter(
            bias, requires_grad=first.base_bias.requires_grad))
        magnitude = cat("magnitude")
        joined.hold(cat("lora_A"), cat("lora_B"), cat("scaling"), cat("rank"), None if magnitude is None else
                    nn.Parameter(magnitude, requires_grad=first.magnitude.requires_grad), copy.deepcopy(
                        first.lora_dropout), [proto for layer in layers for proto in layer.protos],
                    trainable=first.lora_A.requires_grad)
        return joined

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # x: (N*B, ..., D_in)
        # Kept to the ops themselves: at 16 rows per member a layer's Python costs as much as its update.
        n = self.fold.num_members
        if x.shape[0] % n:
            raise RuntimeError(f"A wide LoRA layer got {x.shape[0]} rows, which do not split into {n} members.")
        # Adapters kept in float32 over a half-precision base (PEFT's autocast_adapter_dtype): the update in
        # float32, added to the base's output in float32 and rounded once, as PEFT does.
        dtype = self.lora_A.dtype
        rows = x if x.dtype == dtype else x.to(dtype)
        rows = (self.lora_dropout(rows) if self.training else rows).reshape(n, -1, x.shape[-1])  # (N, M, D_in)
        # x_m @ A_m.T computed as A_m @ x_m.T, with the rank as the GEMM's rows: about twice as fast on CPU
        low = torch.bmm(self.lora_A, rows.transpose(1, 2)).transpose(1, 2)  # (N, M, r): a view of (N, r, M)
        if self.magnitude is not None:
            return dora_output(self, x, rows, low)
        scale = one_scale(self)
        if scale is None:  # the members' scalings differ: each member's on its (small) low-rank activations
            low = low.mul_(self.scaling.view(n, 1, 1))
            scale = 1.0
        base = self.base_layer
        if type(base) is not nn.Linear or self.base_bias is not None:
            result = self._base(x)
        elif _per_member(x, n) and x.dtype == dtype:
            return self._per_member_rows(x, low, scale)
        else:  # one matmul over every member's rows with the base's one weight: (N*B, ..., D_out)
            result = F.linear(x, base.weight, base.bias)
        # result += scale_m * low_m @ B_m.T, in the batched matmul itself: no pass over a separate delta (the
        # base layer's output is this call's own tensor, which the base's backward does not keep)
        out = result if result.dtype == dtype else result.to(dtype)
        out.view(n, -1, result.shape[-1]).baddbmm_(low, self.lora_B.transpose(1, 2), alpha=scale)
        return out if out is result else out.to(result.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight, as PEFT's LoRA layers give it: transformers' T5 reads ``wo.weight.dtype``."""
        return self.base_layer.weight

    def _base(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D_in) -> (N*B, ..., D_out)
        """The base layer's output where it is not one ``nn.Linear``: a WideLinear or WideConv1D (the members'
        bases differ), one Conv1D, or the base's one weight with each member's own bias (added after the matmul:
        in half precision, one rounding more than the member's own addmm)."""
        base = self.base_layer
        if self.base_bias is None:
            return base(x)
        # Conv1D holds its weight as (D_in, D_out)
        result = F.linear(x, base.weight) if type(base) is nn.Linear else torch.matmul(x, base.weight)
        result.view(self.fold.num_members, -1, result.shape[-1]).add_(self.base_bias.unsqueeze(1))
        return result

    def _per_member_rows(self, x: torch.Tensor, low: torch.Tensor, scale: float) -> torch.Tensor:
        """The same, one member's rows at a time, each update while its output is still in cache."""
        n, weight, bias = self.fold.num_members, self.base_layer.weight, self.base_layer.bias
        rows = x.reshape(n, -1, x.shape[-1])  # (N, M, D_in)
        result = rows.new_empty(n, rows.shape[1], weight.shape[0])  # (N, M, D_out)
        for m in range(n):
            if bias is None:
                torch.mm(rows[m], weight.t(), out=result[m])
            else:
                torch.addmm(bias, rows[m], weight.t(), out=result[m])
            result[m].addmm_(low[m], self.lora_B[m].t(), alpha=scale)
        return result.view(*x.shape[:-1], weight.shape[0])

    _scale_key: tuple[int, int] | None = None  # see one_scale
    _scale: float | None = None

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        rank = int(self.rank[i])
        base = self.base_layer
        if isinstance(base, (WideLinear, WideConv1D)):
            state = {f"base_layer.{k}": t[i] for k, t in base._parameters.items() if t is not None}
        else:
            state = {f"base_layer.{k}": t for k, t in base._parameters.items() if t is not None}
            if self.base_bias is not None:
                state["base_layer.bias"] = self.base_bias[i]
        state[f"lora_A.{self.adapter}.weight"] = self.lora_A[i, :rank]
        state[f"lora_B.{self.adapter}.weight"] = self.lora_B[i, :, :rank]
        if self.magnitude is not None:
            state[f"lora_magnitude_vector.{self.adapter}.weight"] = self.magnitude[i]
        return state

    def to_module(self, i: int, share: bool = False) -> nn.Module:
        mod = copy.deepcopy(self.protos[i])  # member i's own rank, scaling and the rest
        state = {k: v.detach() if share else v.detach().clone() for k, v in self.member_state_dict(i).items()}
        mod.load_state_dict(state, strict=True, assign=True)
        return mod


PER_MEMBER_ROWS = 384  # rows per member from which a CPU call runs each member's rows as a matmul of their own


def _per_member(x: torch.Tensor, n: int) -> bool:
    """Whether to run each member's rows apart: on CPU, without autograd, with many rows per member. The
    update's pass over the output is then cheap, made while that member's output is still in cache; over all
    N*B rows at once it goes to memory (rank 8, 256 -> 688 features, 8 members of 512 rows on the 2-core
    benchmark machine: the update costs 7% of the base matmul this way, 21% the other). With few rows each op's
    fixed cost rules, and one op for all members wins; on a GPU so do fewer, larger kernels."""
    return (x.numel() // (n * x.shape[-1]) >= PER_MEMBER_ROWS and x.device.type == "cpu"
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def _stacked(weights: Sequence[torch.Tensor], shape: tuple[int, int, int], rank_dim: int,
             dtype: torch.dtype) -> torch.Tensor | None:
    """The ``(N, ...)`` tensor of ``shape`` whose member ``i``, cut to its rank along ``rank_dim`` (0 for A, 1 for
    B), each of the members' ``weights`` already is, as :func:`hf_wide.adapter_layers.stack_adapters` leaves
    them: taken as it is, not copied (within :func:`keeping_storage` only). None where they are not such views."""
    storage = weights[0].untyped_storage()
    if not keeps_storage() or weights[0].dtype != dtype or storage.nbytes() != math.prod(shape) * dtype.itemsize:
        return None
    whole = weights[0].detach().new_empty(0).set_(storage, 0, shape)
    for i, w in enumerate(weights):
        view = whole[i].narrow(rank_dim, 0, w.shape[rank_dim])
        if (w.untyped_storage().data_ptr() != storage.data_ptr() or w.storage_offset() != view.storage_offset()
                or w.shape != view.shape or w.stride() != view.stride()):
            return None
    return whole


def _without_bias(layer: nn.Module) -> nn.Module:
    """A copy of the base layer ``layer`` (``nn.Linear`` or ``Conv1D``) with no bias, holding ``layer``'s own
    weight within :func:`keeping_storage` (a copy of it otherwise)."""
    memo = {id(layer.bias): None}  # deepcopy takes the memo's value: the copy's bias is None
    if keeps_storage():
        memo[id(layer.weight)] = layer.weight
    return copy.deepcopy(layer, memo)


def _alike(a: WideLoraLinear, b: WideLoraLinear) -> bool:
    """Whether two wide LoRA layers' members concatenate as they are (:meth:`WideLoraLinear.join`): one base layer's
    tensors, one adapter name, one padded rank, one dropout, and the same optional tensors (biases, DoRA's)."""
    same_dropout = type(a.lora_dropout) is type(b.lora_dropout) and getattr(a.lora_dropout, "p", None) == getattr(
        b.lora_dropout, "p", None)
    return (equal_tensors(a.base_layer, b.base_layer) and a.adapter == b.adapter and same_dropout
            and a.lora_A.shape[1:] == b.lora_A.shape[1:] and (a.base_bias is None) == (b.base_bias is None)
            and (a.magnitude is None) == (b.magnitude is None))


def _rebind(linear: nn.Linear, view: torch.Tensor) -> None:
    """``linear.weight`` becomes ``view`` (of the stacked tensor); its own storage is freed with the last reference."""
    linear.weight = nn.Parameter(view, requires_grad=linear.weight.requires_grad)


if LoraLinear is not None:
    register_block(LoraLinear)(WideLoraLinear)
