"""Wide normalisation layers: normalise all N*B rows at once, then apply each member's affine.

Layer, RMS and group norms use per-row statistics, so one un-affine call covers every member; BatchNorm
in eval mode uses each member's running statistics, and in training mode each member's own rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deberta.modeling_deberta import DebertaLayerNorm

from ..registry import register_wide, transformers_classes
from .base import WideModule, affine


HALF = (torch.float16, torch.bfloat16)


def _float(t: torch.Tensor | None, upcast: bool = True) -> torch.Tensor | None:
    """``t`` in float32 (where ``upcast``): a half-precision input's norm computes in it and rounds once, as torch's
    kernels do, where one rounded before its affine and again after it (a last bit off, in 25-48% of outputs)."""
    return t.float() if upcast and t is not None else t


@register_wide(nn.LayerNorm)
class WideLayerNorm(WideModule):
    """N ``nn.LayerNorm``s: ``weight``/``bias``: (N, *normalized_shape)."""

    def setup(self, proto: nn.LayerNorm) -> None:
        self.normalized_shape = proto.normalized_shape
        self.eps = proto.eps
        self.features = proto.weight.numel() if proto.weight is not None else 0
        if self.weight is not None:
            # A unit affine for the shared normalisation: ATen's CPU layer norm gives the same values with it
            # (bit for bit) and runs 15-30% faster than with none. (2, *normalized_shape): ones, zeros.
            unit = torch.stack([torch.ones_like(self.weight[0]), torch.zeros_like(self.weight[0])])
            self.register_buffer("unit", unit, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., *normalized_shape)
        weight, bias = self.weight, self.bias
        if weight is None:
            return F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        unit = self.unit
        if x.dtype in HALF:  # in float32, its affine too, rounded once: as torch's kernel
            weight, bias, unit = weight.float(), _float(bias), unit.float()
            return self._affine(x.float(), weight, bias, unit).to(x.dtype)
        return self._affine(x, weight, bias, unit)

    def _affine(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, unit: torch.Tensor):
        n = weight.shape[0]
        y = F.layer_norm(x, self.normalized_shape, unit[0], unit[1], self.eps)
        broadcast = x.shape[0] == 1 and n > 1
        if broadcast:  # every member's affine on the one row
            y = y.expand(n, *y.shape[1:])
        # Members' rows and features flattened: (N, rows, D) against weight/bias (N, 1, D). As few ops as
        # possible: small models are bound by per-op overhead.
        ym = y.reshape(n, -1, self.features)
        w = weight.view(n, 1, -1)
        out = ym * w if bias is None else torch.addcmul(bias.view(n, 1, -1), ym, w)
        if broadcast:
            return self.fold.merge(out.view(n, 1, *x.shape[1:]))
        return out.view(x.shape)


@register_wide(*transformers_classes("llama.LlamaRMSNorm", "mistral.MistralRMSNorm", "mixtral.MixtralRMSNorm",
                                     "qwen2.Qwen2RMSNorm", "qwen2_moe.Qwen2MoeRMSNorm", "qwen3.Qwen3RMSNorm",
                                     "qwen3_moe.Qwen3MoeRMSNorm", "phi3.Phi3RMSNorm", "granite.GraniteRMSNorm",
                                     "smollm3.SmolLM3RMSNorm"))
class WideLlamaRMSNorm(WideModule):
    """N Llama-style RMSNorms (float32 statistics, ``weight * normed.to(input_dtype)``, eps in
    ``variance_epsilon``): ``weight``: (N, D)."""

    def setup(self, proto: nn.Module) -> None:
        self.variance_epsilon = proto.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D)
        # LlamaRMSNorm's float32 statistics, in one fused call: h * rsqrt(mean(h^2) + eps)
        h = F.rms_norm(x.to(torch.float32), x.shape[-1:], None, self.variance_epsilon).to(x.dtype)
        n, d = self.num_members, x.shape[-1]
        if x.shape[0] == 1 and n > 1:  # broadcast: every member's weight on the one row
            return self.fold.merge(self.weight.view(n, 1, *([1] * (x.dim() - 2)), d) * h)
        return (self.weight.view(n, 1, d) * h.reshape(n, -1, d)).view(x.shape)  # (N, 1, D) * (N, rows, D)


@register_wide(*transformers_classes("t5.T5LayerNorm", "mt5.MT5LayerNorm"))
class WideT5LayerNorm(WideModule):
    """N T5 layer norms (an RMS norm: float32 statistics, the input scaled in its own dtype and cast to a half
    weight's dtype, eps in ``variance_epsilon``): ``weight``: (N, D). The source's ops, in its order."""

    def setup(self, proto: nn.Module) -> None:
        self.variance_epsilon = proto.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        n, d = self.num_members, x.shape[-1]
        if x.shape[0] == 1 and n > 1:  # broadcast: every member's weight on the one row
            return self.fold.merge(self.weight.view(n, 1, *([1] * (x.dim() - 2)), d) * h)
        return (self.weight.view(n, 1, d) * h.reshape(n, -1, d)).view(h.shape)  # (N, 1, D) * (N, rows, D)


@register_wide(*transformers_classes("gemma.GemmaRMSNorm", "gemma2.Gemma2RMSNorm", "gemma3.Gemma3RMSNorm"))
class WideGemmaRMSNorm(WideModule):
    """N Gemma RMSNorms (float32 statistics, a ``(1 + weight)`` scale, eps in ``eps``; on hidden states, and
    on queries and keys per head): ``weight``: (N, D)."""

    def setup(self, proto: nn.Module) -> None:
        self.eps = proto.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D)
        h = x.float()  # the source's ops, in its order
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        n, d = self.num_members, x.shape[-1]
        scale = 1.0 + self.weight.float()  # (N, D)
        if x.shape[0] == 1 and n > 1:  # broadcast: every member's weight on the one row
            return self.fold.merge((h * scale.view(n, 1, *([1] * (x.dim() - 2)), d)).type_as(x))
        return (h.reshape(n, -1, d) * scale.view(n, 1, d)).view(x.shape).type_as(x)  # (N, rows, D) * (N, 1, D)


@register_wide(DebertaLayerNorm)
class WideDebertaLayerNorm(WideModule):
    """N DeBERTa (v1) layer norms (float32 statistics, epsilon inside the square root): ``weight``/``bias``:
    (N, D)."""

    def setup(self, proto: nn.Module) -> None:
        self.variance_epsilon = proto.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, ..., D)
        h = x.float()  # the source's ops, in its order
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = ((h - mean) / torch.sqrt(variance + self.variance_epsilon)).to(x.dtype)
        y = self.fold.split(h)  # (N, b, ..., D)
        shape = (y.shape[0], *([1] * (y.dim() - 2)), y.shape[-1])
        out = self.weight.view(shape) * y + self.bias.view(shape)
        # x's own rows (a packed encoder's (N, K, D) too); only a broadcast row is expanded to the forward's batch
        return self.fold.merge(out) if x.shape[0] == 1 else out.view(x.shape)


@register_wide(nn.RMSNorm)
class WideRMSNorm(WideModule):
    """N ``torch.nn.RMSNorm``s: ``weight``: (N, *normalized_shape)."""

    def setup(self, proto: nn.RMSNorm) -> None:
        self.normalized_shape = proto.normalized_shape
        self.eps = proto.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return F.rms_norm(x, self.normalized_shape, None, self.eps)
        # in float32 for a half x, rounded once, as torch's scales by its weight before it rounds
        y = self.fold.split(F.rms_norm(_float(x, x.dtype in HALF), self.normalized_shape, None, self.eps))
        k = len(self.normalized_shape)
        weight = _float(self.weight, x.dtype in HALF)  # (N, *normalized_shape)
        weight = weight.view(y.shape[0], *([1] * (y.dim() - 1 - k)), *self.normalized_shape)
        return self.fold.merge(y * weight).to(x.dtype)


@register_wide(nn.GroupNorm)
class WideGroupNorm(WideModule):
    """N ``nn.GroupNorm``s over channels-first activations: ``weight``/``bias``: (N, C)."""

    def setup(self, proto: nn.GroupNorm) -> None:
        self.num_groups = proto.num_groups
        self.eps = proto.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, C, *spatial)
        if self.weight is None:
            return F.group_norm(x, self.num_groups, None, None, self.eps)
        half = x.dtype in HALF  # in float32, rounded once, as torch's kernel applies the affine before it rounds
        y = self.fold.split(F.group_norm(_float(x, half), self.num_groups, None, None, self.eps))  # (N, b, C, ...)
        y = y * affine(_float(self.weight, half), y.dim(), 2) + affine(_float(self.bias, half), y.dim(), 2)
        return self.fold.merge(y).to(x.dtype)


@register_wide(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class WideBatchNorm(WideModule, nn.modules.batchnorm._BatchNorm):
    """N BatchNorms: ``weight``/``bias``/``running_mean``/``running_var``: (N, C).

    Eval mode normalises with each member's running statistics. Training mode computes each member's
    batch statistics over its own B rows only (members never see each other's rows) and updates its
    running statistics as ``nn.BatchNorm`` would.

    It is a ``_BatchNorm`` (built as a WideModule, with its own forward), as what finds a model's BatchNorms by that
    class expects: training with them frozen (``m.eval()`` for each, after ``model.train()``), SWA's ``update_bn``
    (their statistics reset and gathered anew), functorch's ``replace_all_batch_norm_modules_``. They found none in a
    wide model, and its BatchNorms went on updating their statistics (1.48 off the members so trained).
    """

    def setup(self, proto: nn.modules.batchnorm._BatchNorm) -> None:
        self.num_features, self.affine = proto.num_features, proto.affine  # (what _BatchNorm's users read)
        self.eps = proto.eps
        self.momentum = proto.momentum
        self.track_running_stats = proto.track_running_stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*B, C, *spatial)
        half = x.dtype in HALF  # statistics, scale and shift in float32 for a half x, rounded once, as torch's kernel
        xm = self.fold.split(_float(x, half))  # (N, b, C, *spatial)
        use_batch_stats = self.training or self.running_mean is None
        if use_batch_stats:
            if xm.numel() // (xm.shape[0] * xm.shape[2]) == 1:  # as torch refuses it, member by member
                raise ValueError("Expected more than 1 value per channel when training, got input size "
                                 f"{torch.Size([xm.shape[1], *xm.shape[2:]])}")
            dims = [1] + list(range(3, xm.dim()))
            mean = xm.mean(dim=dims)  # (N, C)
            var = xm.var(dim=dims, unbiased=False)
            if self.training and self.running_mean is not None:
                self._update_running_stats(mean, var, xm.numel() // (xm.shape[0] * xm.shape[2]))
        else:
            mean, var = _float(self.running_mean, half), _float(self.running_var, half)
        scale = torch.rsqrt(var + self.eps)  # (N, C)
        if self.weight is not None:
            scale = scale * _float(self.weight, half)
        shift = -mean * scale
        if self.bias is not None:
            shift = shift + _float(self.bias, half)
        return self.fold.merge(xm * affine(scale, xm.dim(), 2) + affine(shift, xm.dim(), 2)).to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        self.num_batches_tracked.add_(1)
        momentum = self.momentum  # None: a cumulative average, over each member's own count of batches
        if momentum is None:
            momentum = (1.0 / self.num_batches_tracked).to(mean.dtype).unsqueeze(-1)  # (N, 1)
        unbiased = var * count / max(count - 1, 1)
        self.running_mean.copy_(self.running_mean.to(mean.dtype).lerp_(mean, momentum))  # (in float32 for a half x)
        self.running_var.copy_(self.running_var.to(var.dtype).lerp_(unbiased, momentum))
