"""Member 0 traced on the sample inputs, for the planner: the export's trace (:mod:`hf_wide.tracer`), the tensors'
readers on the paths it does not take (:mod:`hf_wide.path_reads`), and the FLOPs each module costs."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .compare import first_line
from .path_reads import probe_reads, with_reads
from .samples import sample_kwargs
from .tracer import Trace, module_flops, trace


def trace_members(template: nn.Module, args: tuple = (), kwargs: dict | None = None,
                  built: bool = False) -> tuple[Trace, dict, str]:
    """Trace ``template`` on the sample inputs and count its FLOPs: (trace, FLOPs per module, sample shapes).
    ``built``: the sample is the one hf-wide built from the config, and a model it does not run is told so."""
    kwargs = sample_kwargs(template, kwargs or {})
    shapes = [f"{k}{tuple(v.shape)}" for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)]
    shapes += [f"arg{i}{tuple(a.shape)}" for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    try:
        flops = module_flops(template, args, kwargs)
    except Exception as exc:
        if _runs(template, args, kwargs):  # torch's counter failed, not the model (2.11's on GQA flash attention)
            warnings.warn(f"FLOPs not counted: torch's FLOP counter failed on {type(template).__name__} "
                          f"({first_line(exc)})", stacklevel=3)
            return _traced(template, args, kwargs), {}, ", ".join(shapes)
        if not built:
            raise
        raise ValueError(f"{type(template).__name__} does not run on the sample inputs hf-wide built from its config "
                         f"({', '.join(shapes)}): {type(exc).__name__}: {exc}. Load the members with transformers "
                         "and pass sample inputs they run on: WideModel.from_models(models, {...}).") from exc
    return _traced(template, args, kwargs), flops, ", ".join(shapes)


def _traced(template: nn.Module, args: tuple, kwargs: dict) -> Trace:
    """The trace of the sample, with the tensors' readers on the paths it does not take (hf_wide.path_reads)."""
    traced = trace(template, args, kwargs)
    traced.users = with_reads(traced.users, probe_reads(template, args, kwargs))
    return traced


def _runs(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception:
        return False
    return True
