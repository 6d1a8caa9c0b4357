"""transformers' output capture (``output_attentions``, ``output_hidden_states``) on a folded model.

transformers 5 records attentions and hidden states with forward hooks. On the first forward that asks
for them, it installs one on every module of the classes its model lists in ``_can_record_outputs``
(``{"hidden_states": LlamaDecoderLayer, "attentions": LlamaAttention}``), found by ``isinstance``. In a
folded model some of those modules are wide: a fused attention block is no ``LlamaAttention``, so its
attentions would be lost, and a per-member fallback holds N real ones, which would each record B rows.

:func:`install_capture_hooks` installs the hooks itself, the first time a wide forward asks for these
outputs: on a wide module where its source class is listed (its outputs have the source's structure, with
N*B rows), never inside one, and on kept modules as transformers would. It then marks every
``PreTrainedModel`` in it as hooked, so that transformers installs no others. Until then the folded model
carries no capture hooks (a hook makes every call of its module slower): :func:`reset_capture_hooks`
drops those copied from members that already ran a forward with ``output_attentions``.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel
from transformers.utils import output_capturing
from transformers.utils.output_capturing import OutputRecorder

from .blocks import WideBlock
from .primitives import PerMemberFallback, WideModule

_HOOK = output_capturing.install_output_capuring_hook  # (sic): transformers' own name
_INSTALLED = "_output_capturing_hooks_installed"  # the flag transformers checks before installing its hooks


def source_class(module: nn.Module) -> type[nn.Module] | None:
    """The class a wide module stands in for; None for a module that is not wide."""
    if isinstance(module, (WideModule, WideBlock)):
        return type(module.proto)
    if isinstance(module, PerMemberFallback):
        return type(module.members[0])
    return None


def capture_tasks(model: PreTrainedModel) -> list[tuple[str, OutputRecorder]]:
    """``model``'s ``_can_record_outputs`` as (key, recorder) pairs, as transformers reads them: a bare class
    records output 0 for hidden states and output 1 otherwise; a string names a class by suffix."""
    tasks = []
    for key, specs in (getattr(model, "_can_record_outputs", None) or {}).items():
        for spec in specs if isinstance(specs, list) else [specs]:
            if not isinstance(spec, OutputRecorder):
                index = 0 if "hidden_states" in key else 1
                by_name = isinstance(spec, str)
                spec = OutputRecorder(target_class=None if by_name else spec, index=index,
                                      class_name=spec if by_name else None)
            tasks.append((key, spec))
    return tasks


def is_capture_hook(hook) -> bool:
    return getattr(hook, "__qualname__", "").startswith(f"{_HOOK.__name__}.")


def _matches(spec: OutputRecorder, cls: type[nn.Module], name: str) -> bool:
    if not ((spec.target_class is not None and issubclass(cls, spec.target_class))
            or (spec.class_name is not None and name.endswith(spec.class_name))):
        return False
    return spec.layer_name is None or f".{spec.layer_name.strip('.')}." in f"{name}."


def _install(module: nn.Module, name: str, tasks: list[tuple[str, OutputRecorder]]) -> None:
    if isinstance(module, PreTrainedModel):  # a model (or sub-model) records what it lists
        tasks = capture_tasks(module)
        setattr(module, _INSTALLED, True)
    source = source_class(module)
    if source is None:  # children first, as transformers does
        for child_name, child in module.named_children():
            _install(child, f"{name}.{child_name}", tasks)
    for key, spec in tasks:
        if _matches(spec, source or type(module), name):
            _HOOK(module, key, spec.index, spec.capture_initial_hidden_state)


def reset_capture_hooks(model: nn.Module) -> nn.Module:
    """Drop transformers' capture hooks from ``model`` and let transformers install them anew when asked."""
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if is_capture_hook(hook):
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
        if isinstance(module, PreTrainedModel):
            setattr(module, _INSTALLED, False)
    return model


def install_capture_hooks(model: nn.Module) -> nn.Module:
    """(Re)install transformers' capture hooks on a folded ``model``, wide modules included."""
    _install(reset_capture_hooks(model), "", [])
    return model


def asks_for_capture(kwargs: dict, config) -> bool:
    """Whether a forward with ``kwargs`` records attentions or hidden states (by argument or by config).
    ``output_hidden_states`` may be an index, 0 included."""
    for key in ("output_attentions", "output_hidden_states"):
        value = kwargs.get(key, getattr(config, key, None))
        if value is not None and value is not False:
            return True
    return False
