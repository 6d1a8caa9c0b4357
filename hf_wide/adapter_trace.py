"""Member 0 of adapters traced as soon as it has loaded (:func:`trace_ahead`), for the fusion to plan from.

``torch.export`` leaves the process memory that only Python objects reuse (pymalloc arenas that a few of its objects
keep: eight of 1 MiB for a BERT-base), and the members' module trees (PEFT's wrappers, 2.4 MiB of Python objects per
adapter of a BERT-base) are such objects. Traced after every member has loaded, as any fusion traces, nothing reuses
that memory; traced as member 0 loads, the other members' trees fill it (4 adapters of a BERT-base: the load peaks 4-8
MiB lower). That takes adapters whose configs build the same modules (:func:`alike_structure`), and the fusion uses
the trace only where member 0 is still as it was traced (:func:`module_structure`): otherwise (padded for another
adapter's targets, say) it traces member 0 as it is then.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from torch import nn

from .adapter_views import shared_view
from .cpu import collected

# Options of an adapter's config that leave the modules PEFT builds as they are (values, not structure)
VALUE_OPTIONS = frozenset({"base_model_name_or_path", "revision", "lora_alpha", "alpha_pattern", "use_rslora",
                           "inference_mode", "init_lora_weights", "peft_version"})


def module_structure(model: nn.Module) -> tuple:
    """What a trace of ``model`` depends on besides its code: its modules' paths and classes, and its tensors'
    names, shapes, dtypes, devices and ``requires_grad`` (tied ones under every name)."""
    modules = tuple((path, type(m)) for path, m in model.named_modules(remove_duplicate=False))
    tensors = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in (
        *model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)))
    return modules, tensors


def trace_ahead(model: nn.Module) -> tuple | None:
    """Member 0 traced as soon as it has loaded, on the sample the fusion will then check the members on:
    (sample, :func:`~hf_wide.sample_trace.trace_members`' result, :func:`module_structure`), for
    :func:`~hf_wide.fuse.fuse_models` to use where member 0 is still so at the end. The trace runs a structural copy
    holding member 0's very tensors, so that what a forward leaves on its modules is not member 0's. None where member
    0 does not run its sample: the fusion then traces, and says why, as it always did."""
    from .compare import device_lost
    from .sample_trace import trace_members
    from .samples import sample_inputs

    # The export leaves reference cycles (3 MiB of a small BERT's), collected for the next members' objects to reuse
    # their memory
    with collected():
        view = shared_view(model)
        try:
            sample = sample_inputs(view)
            return sample, trace_members(view, (), sample, built=True), module_structure(model)
        except Exception as exc:
            if device_lost(exc):
                raise
            return None
        finally:
            del view


def alike_structure(configs: Sequence[dict | None]) -> bool:
    """Whether the members are adapters whose configs build the same modules (differing at most in
    :data:`VALUE_OPTIONS`): then no member needs modules another lacks, and member 0 traced as it loads is member 0 as
    the fusion finds it (checked there, not assumed)."""
    if any(c is None for c in configs):
        return False
    layouts = {json.dumps({k: v for k, v in c.items() if k not in VALUE_OPTIONS}, sort_keys=True, default=str)
               for c in configs}
    return len(layouts) == 1
