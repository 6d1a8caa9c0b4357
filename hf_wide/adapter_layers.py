"""The structure of adapter members: views of the one base, and the wrappers that give every member the same
modules (:mod:`hf_wide.adapters` loads the members with these).

Each adapter loads over a view of the base that holds the base's own tensors (:func:`adapter_view`), and is
refused if it writes into them (:func:`base_untouched`). Where adapters target different modules, or save
different modules whole (``modules_to_save``), each member gets the ones it lacks as exact no-ops: a LoRA layer
whose update is zero (:func:`pad_targets`; also on the linears whose biases ``bias="all"`` trains,
:func:`trained_bias_paths`), a saved copy of the base's module (:func:`pad_saved_modules`), which :func:`unpad`
takes out again when a member leaves the wide model. :func:`stack_adapters` moves the members' LoRA
weights into the stacked tensors the wide model keeps.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from .compat import IncompatibleMembersError


def shared_view(model: nn.Module, own: Callable[[str], bool] | None = None) -> nn.Module:
    """A structural copy of ``model`` that holds the very same tensors (nothing is copied), except those whose
    names ``own`` picks: copies of its own."""
    tensors = (*model.named_parameters(), *model.named_buffers())
    return copy.deepcopy(model, {id(t): t for name, t in tensors if own is None or not own(name)})


def adapter_view(base: nn.Module, config: dict) -> nn.Module:
    """The base for one adapter to load over: a :func:`shared_view`, with copies of its own of the base tensors
    the adapter holds values of. PEFT's ``bias="all"`` trains and saves every tensor whose name holds "bias", and
    ``bias="lora_only"`` the biases of the layers it adapts: loaded into the shared tensors, one adapter's biases
    would be every member's."""
    if config.get("bias", "none") == "none":
        return shared_view(base)
    return shared_view(base, own=lambda name: "bias" in name)


@contextlib.contextmanager
def base_untouched(base: nn.Module, name: str) -> Iterator[None]:
    """Refuse an adapter that, as it loads, writes into a tensor of the base its members share (an adapter file
    that holds a base weight, say): it would change every member, so no member would be what was saved."""
    before = {key: _version(t) for key, t in base.state_dict(keep_vars=True).items()}
    yield
    written = [key for key, t in base.state_dict(keep_vars=True).items() if _version(t) != before[key]]
    if written:
        shown = ", ".join(written[:3]) + (f" and {len(written) - 3} more" if len(written) > 3 else "")
        raise IncompatibleMembersError(
            f"{name} holds values of the base's own tensors ({shown}), which its members share. Pass merge=True to "
            "merge each adapter into its own copy of the base (exact, N full weight sets).")


def _version(t: torch.Tensor) -> int | None:
    """How many times ``t`` was written in place (None for inference tensors, which do not count)."""
    try:
        return t._version
    except RuntimeError:
        return None


def lora_paths(model: nn.Module) -> set[str]:
    from peft.tuners.lora import LoraLayer

    return {path for path, m in model.named_modules() if isinstance(m, LoraLayer)}


def trained_bias_paths(model: nn.Module) -> set[str]:
    """The linears (``nn.Linear``, GPT-2's ``Conv1D``) with a bias outside the LoRA layers and the modules saved
    whole: those whose bias PEFT's ``bias="all"`` trains beside the base's weight. Given zero LoRA layers
    (:func:`pad_targets`), each becomes the base's one weight with the members' biases stacked, rather than N
    copies of the weight."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    from transformers.pytorch_utils import Conv1D

    modules = dict(model.named_modules())
    inside = [path for path, m in modules.items() if isinstance(m, (LoraLayer, AuxiliaryTrainingWrapper))]
    return {path for path, m in modules.items() if type(m) in (nn.Linear, Conv1D) and m.bias is not None
            and not any(path.startswith(f"{p}.") for p in inside)}


def pad_targets(model: nn.Module, paths: set[str], dtype: torch.dtype) -> list[str]:
    """Wrap each ``nn.Linear`` (or GPT-2's ``Conv1D``) at ``paths`` (relative to the PEFT model) that has no
    adapter in a LoRA layer whose update is exactly zero (rank 1, ``lora_B = 0``): then every member has the same
    structure; their weights are in ``dtype``, the adapters' (float32 over a half-precision base, as PEFT keeps
    them), so each layer's stacked updates have one dtype. Returns the paths wrapped."""
    import peft
    from peft.tuners.lora import Linear as LoraLinear
    from transformers.pytorch_utils import Conv1D

    wrapped = []
    for path in sorted(paths - lora_paths(model)):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = getattr(parent, child)
        if type(layer) not in (nn.Linear, Conv1D):
            raise IncompatibleMembersError(f"{path} is a {type(layer).__name__}: hf-wide can give it no zero LoRA.")
        conv = type(layer) is Conv1D  # PEFT wraps it with fan_in_fan_out, as its own dispatch does
        config = peft.LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=[], fan_in_fan_out=conv)
        lora = LoraLinear(layer, "default", config=config, r=1, lora_alpha=1, is_target_conv_1d_layer=conv)
        for adapter in (lora.lora_A, lora.lora_B):  # not the base layer inside: it stays the base's tensors
            adapter.to(layer.weight.device, dtype)
        nn.init.zeros_(lora.lora_B["default"].weight)
        lora.requires_grad_(False)
        setattr(parent, child, lora.eval())
        wrapped.append(path)
    _list_targets(model)  # every member's are now the union
    return wrapped


def stack_adapters(models: Sequence[nn.Module]) -> None:
    """Move the members' adapters into the tensors the wide model will hold: for each LoRA layer, every member's
    ``lora_A`` and ``lora_B`` are copied into one ``(N, r, D_in)`` and one ``(N, D_out, r)`` tensor (ranks
    zero-padded to the largest) and theirs become views of them, which ``WideLoraLinear`` then takes as they are.
    Done as the adapters are loaded, before the trace: PEFT's own copies are freed then, rather than staying
    beside the stacked ones until the fused model is built (4 adapters of a 727 MiB BERT: 27 MiB)."""
    from peft.tuners.lora import Linear as LoraLinear

    layers = [dict(m.named_modules()) for m in models]
    for path, first in layers[0].items():
        mods = [modules.get(path) for modules in layers]
        if type(first) is not LoraLinear or any(type(m) is not LoraLinear or list(m.lora_A) != list(first.lora_A)
                                                 or len(m.lora_A) != 1 for m in mods):
            continue
        a = [next(iter(m.lora_A.values())) for m in mods]  # nn.Linear: weight (r_i, D_in)
        b = [next(iter(m.lora_B.values())) for m in mods]  # weight (D_out, r_i)
        if len({(x.weight.dtype, x.weight.device, x.weight.shape[1]) for x in a}) != 1 or len(
                {(x.weight.dtype, x.weight.device, x.weight.shape[0]) for x in b}) != 1:
            continue
        r = max(x.weight.shape[0] for x in a)
        with torch.no_grad():
            stacked_a = a[0].weight.new_zeros(len(mods), r, a[0].weight.shape[1])
            stacked_b = b[0].weight.new_zeros(len(mods), b[0].weight.shape[0], r)
            for i, (la, lb) in enumerate(zip(a, b)):
                rank = la.weight.shape[0]
                stacked_a[i, :rank] = la.weight
                stacked_b[i, :, :rank] = lb.weight
                la.weight = nn.Parameter(stacked_a[i, :rank], requires_grad=la.weight.requires_grad)
                lb.weight = nn.Parameter(stacked_b[i, :, :rank], requires_grad=lb.weight.requires_grad)


def saved_paths(model: nn.Module) -> set[str]:
    """The paths of the modules ``model`` (a PEFT model) trains and saves whole: its ``modules_to_save``."""
    from peft.utils import ModulesToSaveWrapper

    return {path for path, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)}


def pad_saved_modules(model: nn.Module, paths: set[str]) -> list[str]:
    """Wrap each module at ``paths`` (relative to the PEFT model) that ``model`` does not save whole, where other
    members do (their ``modules_to_save`` differ), as PEFT wraps a module to save: its copy, which holds the
    base's values, is what the member computes, and every member has the same structure. Returns the paths."""
    from peft.utils import ModulesToSaveWrapper

    wrapped = []
    for path in sorted(paths - saved_paths(model)):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        wrapper = ModulesToSaveWrapper(getattr(parent, child), "default")
        wrapper.requires_grad_(False)
        setattr(parent, child, wrapper.eval())
        wrapped.append(path)
    return wrapped


def unpad(model: nn.Module, paths: Sequence[str]) -> None:
    """Undo :func:`pad_targets` and :func:`pad_saved_modules` on a member taken out of the wide model: each
    zero-update layer and each module it was given to save becomes the base's module again, so the member is the
    adapter as it was saved."""
    from peft.utils import ModulesToSaveWrapper

    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = getattr(parent, child)
        setattr(parent, child, layer.original_module if isinstance(layer, ModulesToSaveWrapper) else layer.base_layer)
    _list_targets(model)


def _list_targets(model: nn.Module) -> None:
    """PEFT's LoraModel lists the names of the layers it adapted, relative to its model."""
    model.base_model.targeted_module_names = sorted(p.removeprefix("base_model.model.") for p in lora_paths(model))
