"""transformers' output capture (``output_attentions``, ``output_hidden_states``, ``output_router_logits``) on a
folded model.

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

What would be recorded inside a wide module (the attention of a decoder layer run vectorised, the router of a
vectorised mixture of experts) cannot be. Asked for, it is refused (:func:`require_recorded`): the tuple would lack
those layers' entries, and the other layers' would stand at their places.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel
from transformers.utils import output_capturing
from transformers.utils.output_capturing import OutputRecorder

from .blocks import WideBlock
from .primitives import PerMemberFallback, VectorisedFallback, WideModule

_HOOK = output_capturing.install_output_capuring_hook  # (sic): transformers' own name
_INSTALLED = "_output_capturing_hooks_installed"  # the flag transformers checks before installing its hooks


def source_class(module: nn.Module) -> type[nn.Module] | None:
    """The class a wide module stands in for; None for a module that is not wide."""
    if isinstance(module, (WideModule, WideBlock, VectorisedFallback)):
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


def _source_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules of the source a wide module stands in for, which run inside it where no hook of ours reaches;
    less those inside a model of their own (a vectorised ``HubertModel``), which records its outputs itself."""
    source = module.members[0] if isinstance(module, PerMemberFallback) else module.proto
    models = [path for path, sub in source.named_modules() if isinstance(sub, PreTrainedModel)]
    return [(path, sub) for path, sub in source.named_modules()
            if path and not any(m == "" or path.startswith(f"{m}.") for m in models)]


def _install(module: nn.Module, name: str, tasks: list[tuple[str, OutputRecorder]],
             unrecorded: dict[str, tuple[str, str]]) -> None:
    if isinstance(module, PreTrainedModel):  # a model (or sub-model) records what it lists
        tasks = capture_tasks(module)
        setattr(module, _INSTALLED, True)
    source = source_class(module)
    if source is None:  # children first, as transformers does
        for child_name, child in module.named_children():
            _install(child, f"{name}.{child_name}", tasks, unrecorded)
    else:  # what the source would record inside it, the wide module cannot
        for path, sub in _source_modules(module):
            for key, spec in tasks:
                if _matches(spec, type(sub), f"{name}.{path}"):
                    unrecorded.setdefault(key, (f"{name}.{path}".lstrip("."), name.lstrip(".")))
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


def install_capture_hooks(model: nn.Module) -> dict[str, tuple[str, str]]:
    """(Re)install transformers' capture hooks on a folded ``model``, wide modules included. Returns what cannot be
    recorded: output key -> (the module that would record it, the wide module it runs inside)."""
    unrecorded: dict[str, tuple[str, str]] = {}
    _install(reset_capture_hooks(model), "", [], unrecorded)
    return unrecorded


def require_recorded(unrecorded: dict[str, tuple[str, str]], kwargs: dict, config) -> None:
    """Refuse a forward that asks for an output that the hooks cannot record (see :func:`install_capture_hooks`):
    the tuple would lack those layers' entries, and the rest would stand at other layers' places."""
    for key, (path, wide) in unrecorded.items():
        flag = "output_attentions" if key in ("cross_attentions", "mask_decoder_attentions") else f"output_{key}"
        value = kwargs.get(flag, getattr(config, flag, None))
        if value is not None and value is not False:
            raise ValueError(
                f"hf-wide cannot return the {key} of this wide model: {path} records them inside {wide}, which runs "
                f"every member's module in one call (see the plan), where transformers' recording hooks do not reach. "
                f"Call it without {flag} (wide.config.{flag} = False if the config asks for it), or take one member "
                "out with wide.member(i).")


def asks_for_capture(kwargs: dict, config) -> bool:
    """Whether a forward with ``kwargs`` records attentions, hidden states or router logits (by argument or by
    config). ``output_hidden_states`` may be an index, 0 included."""
    for key in ("output_attentions", "output_hidden_states", "output_router_logits"):
        value = kwargs.get(key, getattr(config, key, None))
        if value is not None and value is not False:
            return True
    return False
