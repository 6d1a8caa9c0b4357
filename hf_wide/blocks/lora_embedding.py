"""LoRA members of an embedding: PEFT's ``lora.Embedding``, one lookup in the base's table for every member plus
each member's low-rank update.

    y = E[x] + scale_m * A_m.T[x_m] @ B_m.T        x_m: member m's ids
    E: (V, D), the base's one table; A: (N, V, r), each member's ``lora_embedding_A`` (r, V) transposed: a table of
    rank-r rows, member m's at rows m*V.. of its (N*V, r) view, so every member's rows are one lookup; B: (N, D, r)
    each member's ``lora_embedding_B``; scale: (N,)

As for :class:`~hf_wide.blocks.lora.WideLoraLinear`, the base is one ``nn.Embedding`` where every member's table is
equal (adapters of one base) and a :class:`~hf_wide.primitives.embedding.WideEmbedding` where the tables differ;
ranks are zero-padded to the largest, and each member has its own scaling. PEFT saves the table whole with an
adapter that targets it (``save_embedding_layers``): :func:`hf_wide.adapter_views.reshare` holds it once again.

Only vanilla LoRA with one adapter, active, unmerged, over an exact ``nn.Embedding`` without ``max_norm``,
``scale_grad_by_freq`` or ``sparse`` is taken (PEFT's DoRA and MiCA variants, a scaled embedding such as Gemma's,
tensor-parallel hooks are declined: the module then runs as each member's own code). PEFT's embedding applies no dropout, and neither does this.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..primitives.base import kept, meta_copies
from ..primitives.embedding import WideEmbedding, no_padding_gradient
from ..registry import register_block
from .base import WideBlock
from .lora_parts import equal_tensors, one_scale

try:
    from peft.tuners.lora import Embedding as LoraEmbedding
except ImportError:  # peft is optional: without it there are no LoRA members to fuse
    LoraEmbedding = None


def lora_embedding_refusal(module: nn.Module) -> str | None:
    """Why :class:`WideLoraEmbedding` cannot take this ``lora.Embedding``, or None."""
    names = list(module.lora_embedding_A.keys())
    if len(names) != 1 or list(module.active_adapters) != names:
        return f"it holds adapters {names}, active {list(module.active_adapters)}: one adapter, active, is needed"
    (name,) = names
    if module.merged or module.disable_adapters:
        return "its adapter is merged into the base table or disabled"
    if name in module.lora_variant:
        return f"its adapter is a {type(module.lora_variant[name]).__name__} (not vanilla LoRA)"
    if type(module.base_layer) is not nn.Embedding:  # a scaled one (Gemma's) scales the update too
        return f"its base layer is a {type(module.base_layer).__name__}, not an nn.Embedding"
    if module.base_layer.max_norm is not None:
        return "its base layer renormalises its table in place (max_norm)"
    if module.base_layer.scale_grad_by_freq or module.base_layer.sparse:  # PEFT's lookup passes these to A's
        return "its base layer scales its gradient by frequency or makes it sparse"
    if getattr(module, "input_fns", None) or getattr(module, "output_fns", None):
        return "it has tensor-parallel hooks"
    return None


class WideLoraEmbedding(WideBlock):
    """N members' ``lora.Embedding`` layers: ``base_layer`` shared or wide, ``lora_embedding_A`` (N, V, r),
    ``lora_embedding_B`` (N, D, r), ``scaling`` (N,), ``rank`` (N,) each member's own (``r`` the padded one)."""

    keeps_shared_tensors = True  # the base's one table: an output layer tied to it reads it too
    own_modules = (nn.ParameterDict,)  # lora_embedding_A and lora_embedding_B: {adapter: tensor}

    @staticmethod
    def member_attribute(path: str, name: str) -> bool:
        """Whether attribute ``name`` of the submodule at ``path`` may differ between members (see
        :meth:`WideLoraLinear.member_attribute`): the rank and the scaling, and the dropout (which PEFT's
        embedding does not apply)."""
        if not path:
            return name in ("r", "lora_alpha", "scaling", "use_rslora", "kwargs")
        return path.startswith("lora_dropout.")

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return lora_embedding_refusal(module) is None

    @classmethod
    def refusal(cls, module: nn.Module) -> str | None:
        return lora_embedding_refusal(module)

    @staticmethod
    def shapes_may_differ(name: str) -> bool:
        """Whether a tensor of this name (relative to the module) may differ in shape between members: the rank."""
        return name.startswith(("lora_embedding_A.", "lora_embedding_B."))

    def build(self, mods: Sequence[nn.Module]) -> None:
        (self.adapter,) = mods[0].lora_embedding_A.keys()
        bases = [m.base_layer for m in mods]
        if all(equal_tensors(b, bases[0]) for b in bases[1:]):
            self.base_layer = kept(bases[0])  # adapters of one base: its one table
        else:
            self.base_layer = WideEmbedding.from_modules(bases, self.fold)
        ranks = [m.r[self.adapter] for m in mods]
        r, n = max(ranks), len(mods)
        vocab, dim = bases[0].num_embeddings, bases[0].embedding_dim
        # float32 over a half-precision base, where PEFT upcasts the adapters (autocast_adapter_dtype)
        dtypes = {t.dtype for m in mods for t in (*m.lora_embedding_A.values(), *m.lora_embedding_B.values())}
        dtype = dtypes.pop() if len(dtypes) == 1 else bases[0].weight.dtype
        device = bases[0].weight.device
        a = torch.zeros(n, vocab, r, dtype=dtype, device=device)
        b = torch.zeros(n, dim, r, dtype=dtype, device=device)
        for i, (m, rank) in enumerate(zip(mods, ranks)):
            a[i, :, :rank] = m.lora_embedding_A[self.adapter].detach().T  # (r_i, V) -> (V, r_i)
            b[i, :, :rank] = m.lora_embedding_B[self.adapter].detach()
        trainable = mods[0].lora_embedding_A[self.adapter].requires_grad  # as the source's: PEFT trains only these
        self.lora_embedding_A = nn.Parameter(a, requires_grad=trainable)
        self.lora_embedding_B = nn.Parameter(b, requires_grad=trainable)
        self.__dict__.pop("scaling", None)  # member 0's {adapter: scaling}, copied from the source: each member's here
        self.register_buffer("scaling", torch.tensor([m.scaling[self.adapter] for m in mods], dtype=dtype,
                                                     device=device))
        self.register_buffer("rank", torch.tensor(ranks), persistent=False)
        self.register_buffer("offsets", torch.arange(n, device=device).view(n, 1) * vocab, persistent=False)
        self.padding_idx = bases[0].padding_idx  # the members' one vocabulary's (PEFT looks A up with it)
        object.__setattr__(self, "protos", meta_copies(mods, self.proto))  # each member's ranks and attributes

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # x: (N*B, ...) ids -> (N*B, ..., D)
        n = self.fold.num_members
        if x.shape[0] % n:
            raise RuntimeError(f"A wide LoRA embedding got {x.shape[0]} rows, which do not split into {n} members.")
        result = self.base_layer(x)  # (N*B, ..., D)
        a = self.lora_embedding_A
        # member m's ids index rows m*V.. of the (N*V, r) table: every member's low-rank rows in one lookup
        ids = x.reshape(n, -1)  # (N, M)
        low = F.embedding(ids + self.offsets, a.view(-1, a.shape[-1]))  # (N, M, r)
        low = no_padding_gradient(low, ids, self.padding_idx)  # PEFT looks A up with the base's padding_idx
        scale = one_scale(self)
        b = self.lora_embedding_B.transpose(1, 2)  # (N, r, D)
        if result.dtype != a.dtype:
            # Adapters kept in float32 over a half-precision base (PEFT's autocast_adapter_dtype): PEFT's own order,
            # the product, then the scale, added to the lookup in float32 and rounded once. Its roundings, so a sum
            # that falls near a half-precision step rounds as the member's does (that step moved whole logits).
            update = torch.bmm(low, b) * (self.scaling.view(n, 1, 1) if scale is None else scale)  # (N, M, D)
            return (result.to(a.dtype).view_as(update) + update).view(result.shape).to(result.dtype)
        if scale is None:  # the members' scalings differ: each member's on its (small) low-rank rows
            low = low * self.scaling.view(n, 1, 1)
            scale = 1.0
        result.view(n, -1, result.shape[-1]).baddbmm_(low, b, alpha=scale)
        return result

    @property
    def weight(self) -> torch.Tensor:
        """The base table, as PEFT's LoRA layers give it (model code reads an embedding's ``weight.dtype``)."""
        return self.base_layer.weight

    _scale_key: tuple[int, int] | None = None  # see hf_wide.blocks.lora.one_scale
    _scale: float | None = None

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        rank = int(self.rank[i])
        base = self.base_layer
        state = {f"base_layer.{k}": t[i] if isinstance(base, WideEmbedding) else t
                 for k, t in base._parameters.items() if t is not None}
        state[f"lora_embedding_A.{self.adapter}"] = self.lora_embedding_A[i, :, :rank].T  # PEFT's (r_i, V): a view
        state[f"lora_embedding_B.{self.adapter}"] = self.lora_embedding_B[i, :, :rank]
        return state

    def to_module(self, i: int, share: bool = False) -> nn.Module:
        mod = copy.deepcopy(self.protos[i])  # member i's own rank, scaling and the rest
        # copies laid out as PEFT's own (safetensors saves no transposed view); with share, the views themselves
        state = {k: v.detach() if share else v.detach().clone(memory_format=torch.contiguous_format)
                 for k, v in self.member_state_dict(i).items()}
        mod.load_state_dict(state, strict=True, assign=True)
        return mod


if LoraEmbedding is not None:
    register_block(LoraEmbedding)(WideLoraEmbedding)
