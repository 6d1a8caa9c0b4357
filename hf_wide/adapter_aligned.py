"""Members of a list that holds adapters, brought to the adapters' one structure: a full checkpoint among them wrapped
as they are (:func:`as_adapter`), and PeftModels given to ``WideModel.from_models`` that target, or save whole,
different modules padded as adapters loaded from folders are (:func:`aligned_adapters`, with
:mod:`hf_wide.adapter_layers`' no-ops)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence

from torch import nn

from .adapter_checks import check_layer_replication
from .compat import IncompatibleMembersError
from .adapter_layers import (adapter_structure, dora_paths, lora_paths, pad_saved_modules, pad_targets, saved_paths,
                             zero_update)
from .adapter_views import shared_view


def as_adapter(model: nn.Module, reference: nn.Module) -> nn.Module:
    """A full member among adapters (their base itself, or a model of its architecture): ``model`` wrapped as the
    adapter ``reference`` is (its config), every update an exact no-op (zero B) and frozen, so that all members have
    one structure and this one computes with its own weights alone (``unload()`` gives it back)."""
    import peft

    from .adapters import peft_quietly

    with peft_quietly():
        model = peft.get_peft_model(model, copy.deepcopy(reference.peft_config["default"])).eval()
    for path in lora_paths(model):  # the fresh adapter's own random A: zero B keeps it a no-op
        zero_update(model.get_submodule(path))
    model.requires_grad_(False)
    return model


def aligned_adapters(models: Sequence[nn.Module]) -> tuple[list[nn.Module], list[list[str]] | None, frozenset[int]]:
    """LoRA members given as PeftModels (``WideModel.from_models``) whose adapters target, or save whole, different
    modules, or beside plain models of their base's class: views of them (:func:`shared_view`, their very tensors:
    the models themselves are left as they are), each plain one wrapped as the adapters are (:func:`as_adapter`),
    each padded as adapters loaded from folders are (:func:`pad_saved_modules`, :func:`pad_targets`); the paths each
    was given, for ``member(i)`` to take out (:func:`unpad`), and which members were plain models. Members that agree
    already, or whose PeftModels do not all hold one LoRA adapter named "default" (what the padding gives), come back
    as they are, with None and no plain members."""
    peft = sys.modules.get("peft")  # not imported: no member is a PeftModel
    adapters = [m for m in models if peft is not None and isinstance(m, peft.PeftModel)]
    for i, m in enumerate(models):  # (refused by verification, without saying why)
        if peft is not None and isinstance(m, peft.PeftModel) and m.active_peft_config.is_prompt_learning:
            raise IncompatibleMembersError(
                f"member {i} is a {m.active_peft_config.peft_type.value} PeftModel: prompt learning puts virtual "
                "tokens before the inputs in PeftModel's own forward, which hf-wide does not fuse (it fuses LoRA "
                "adapters). Run each such member alone.")
    full = frozenset(i for i, m in enumerate(models) if adapters and not isinstance(m, peft.PeftModel))
    names = {i: list(m.peft_config) for i, m in enumerate(models) if adapters and i not in full}
    _require_alike(names, lambda a, b: (
        f"member {a} holds the adapters {names[a]} and member {b} {names[b]}: the members' tensors are matched by "
        "name. Give each member the same adapters by name (one each: PeftModel.from_pretrained(base, folder) names "
        "it 'default')."))
    lora = bool(adapters) and all(list(m.peft_config) == ["default"] and m.peft_config["default"].peft_type
                                  == peft.PeftType.LORA for m in adapters)
    if not lora or any(type(models[i]) is not type(adapters[0].get_base_model()) for i in full):
        return list(models), None, frozenset()  # (members of other classes are refused as such)
    biases = {i: m.peft_config["default"].lora_bias for i, m in enumerate(models) if i not in full}
    _require_alike(biases, lambda a, b: (
        f"member {a} uses lora_bias={biases[a]} and member {b} lora_bias={biases[b]}: an adapter's own bias on its "
        "update is fused only where every adapter has one. Fuse the adapters that agree apart."))
    replications = [None if i in full else m.peft_config["default"].layer_replication for i, m in enumerate(models)]
    if any(replications):
        check_layer_replication([r and [list(p) for p in r] for r in replications],
                                [f"member {i}" for i in range(len(models))])
    union, saved, dtype = adapter_structure(models)
    dora = dora_paths(adapters)
    if not full and all(lora_paths(m) == union and saved_paths(m) == saved for m in models):
        return list(models), None, frozenset()
    trainable = [(p, p.requires_grad) for m in models for p in m.parameters()]
    views = [as_adapter(shared_view(m), adapters[0]) if i in full else shared_view(m) for i, m in enumerate(models)]
    padded = [pad_saved_modules(view, saved) + pad_targets(view, union, dtype, f"member {i}", dora)
              for i, view in enumerate(views)]
    for p, flag in trainable:  # the wrappers froze the tensors they wrap, which are the models' own
        p.requires_grad_(flag)
    return views, padded, full


def _require_alike(values: dict[int, object], refusal) -> None:
    """Refuse members (``values``: member -> its value) whose values differ, with ``refusal(first, other)``: else a
    tensor one of them lacks refused them, without saying why."""
    first = min(values, default=None)
    other = next((i for i in values if values[i] != values[first]), None)
    if other is not None:
        raise IncompatibleMembersError(refusal(first, other))
