"""Checks that N members really share one architecture, with errors that name what differs."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from torch import nn

from .own_code import same_code
from .registry import find_block

# Config fields that describe where a checkpoint came from, not the graph it builds.
METADATA_FIELDS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "dtype",
        "torch_dtype",
        "finetuning_task",
        "id2label",
        "label2id",
        "_attn_implementation_autoset",
        "architectures",  # the model class is compared directly
    }
)


class IncompatibleMembersError(ValueError):
    """The members do not share one architecture; the message names the member, the field and both values."""


def member_names(models: Sequence[nn.Module], ids: Sequence[str] | None = None) -> list[str]:
    if ids is not None:
        return [f"member {i} ({name})" for i, name in enumerate(ids)]
    names = []
    for i, model in enumerate(models):
        path = getattr(getattr(model, "config", None), "_name_or_path", "")
        names.append(f"member {i} ({path})" if path else f"member {i}")
    return names


def _task_types(first: nn.Module, model: nn.Module, first_name: str, name: str) -> str:
    """Where two PEFT models' classes come from their adapters' ``task_type``, a sentence that says so."""
    types = [getattr(getattr(m, "peft_config", {}).get("default"), "task_type", None) for m in (first, model)]
    if types[0] == types[1] or not all(hasattr(m, "peft_config") for m in (first, model)):
        return ""
    return (f" Their adapters' task_type (adapter_config.json) differs: {types[1]} for {name}, {types[0]} for "
            f"{first_name}.")


def refuse_unfused_attention(implementation) -> None:
    """Refuse an attention implementation hf-wide cannot run: flex attention's higher-order op takes no
    ``TorchFunctionMode``, under which the trace and a module run member by member call the members' code (transformers
    runs it alone; the wide model failed in the trace, with advice that did not help)."""
    named = implementation.values() if isinstance(implementation, dict) else [implementation]
    if any(isinstance(n, str) and "flex_attention" in n for n in named):
        raise ValueError(f"attn_implementation={implementation!r}: hf-wide does not run flex attention (its op takes "
                         "no TorchFunctionMode, which hf-wide runs the members' code under). Use 'sdpa' or 'eager'.")


def check_compatible(
    models: Sequence[nn.Module], ids: Sequence[str] | None = None, allow_label_mismatch: bool = False
) -> None:
    """Raise :class:`IncompatibleMembersError` unless every member matches member 0 in class, config
    fields that shape the graph, labels (unless allowed to differ) and state-dict names and shapes."""
    if not models:
        raise ValueError("WideModel needs at least one member; got an empty list.")
    for model in models:
        refuse_unfused_attention(getattr(getattr(model, "config", None), "_attn_implementation", None))
    names = member_names(models, ids)
    _check_devices(models, names)
    first = models[0]
    for name, model in zip(names[1:], models[1:]):
        if type(model) is not type(first) and not same_code(type(model), type(first)):  # (of one code: one class)
            refuse_other_class(type(first), type(model), names[0], name, _task_types(first, model, names[0], name))
        if hasattr(first, "config"):
            check_configs(first.config, model.config, names[0], name, allow_label_mismatch)
        _check_state_dicts(first, model, names[0], name)


def refuse_other_class(first: type, other: type, first_name: str, name: str, more: str = "") -> None:
    """An :class:`IncompatibleMembersError`: member ``name`` is of another class than ``first_name``'s (or of a class
    of the same name from other code: checkpoints' own code, each folder's loaded apart, that differs)."""
    if other.__qualname__ == first.__qualname__:
        raise IncompatibleMembersError(
            f"{name} and {first_name} are each a {other.__name__} of their own code ({other.__module__}, "
            f"{first.__module__}), which differs: all members must be one model class.{more}")
    raise IncompatibleMembersError(f"{name} is a {other.__name__}, but {first_name} is a {first.__name__}: "
                                   f"all members must be the same model class.{more}")


def _check_devices(models: Sequence[nn.Module], names: Sequence[str]) -> None:
    """Refuse a member with tensors on the meta device (no values: torch's own error came from deep in the fusion)
    and members on other devices than member 0's (the wide model stacks their tensors on one)."""
    devices = []
    for model, name in zip(models, names):
        state = model.state_dict()
        empty = next((key for key, t in state.items() if t.is_meta), None)
        if empty is not None:
            raise IncompatibleMembersError(f"{name}'s {empty!r} is on the meta device: it holds no values to fuse. "
                                           "Load the member's weights first.")
        devices.append(sorted({str(t.device) for t in state.values()}))
    for name, found in zip(names[1:], devices[1:]):
        if found != devices[0]:
            raise IncompatibleMembersError(f"{name} is on {', '.join(found)}, but {names[0]} on "
                                           f"{', '.join(devices[0])}: move the members to one device "
                                           "(model.to(device)).")


def check_configs(a, b, name_a: str, name_b: str, allow_label_mismatch: bool) -> None:
    """Raise unless config ``b`` matches ``a`` in every field that shapes the graph (and labels, unless allowed), and in
    the attention implementation the members were built with (the wide model runs member 0's: eager beside sdpa gave
    another member's padded positions other values)."""
    da, db = _graph_fields(a.to_dict()), _graph_fields(b.to_dict())
    for key in sorted(set(da) | set(db)):
        if da.get(key) != db.get(key):
            path, va, vb = _difference(key, da.get(key), db.get(key))  # (in a sub-config: its field, not the whole)
            raise IncompatibleMembersError(
                f"{name_b} has config.{path} = {vb!r}, but {name_a} has {va!r}: members must share "
                "their configs, labels and provenance aside (the wide model runs one config, and any field may change "
                f"what the code computes). {_advice(path)}"
            )
    attention_a, attention_b = getattr(a, "_attn_implementation", None), getattr(b, "_attn_implementation", None)
    if attention_a != attention_b:
        raise IncompatibleMembersError(
            f"{name_b} runs attn_implementation={attention_b!r}, but {name_a} runs {attention_a!r}: the wide model runs "
            "one. Load the members alike (from_pretrained(..., attn_implementation=...)), or switch them with "
            "model.set_attn_implementation(...) before fusing.")
    labels_a, labels_b = getattr(a, "id2label", None), getattr(b, "id2label", None)
    if labels_a != labels_b and not allow_label_mismatch:
        raise IncompatibleMembersError(
            f"{name_b} has id2label = {labels_b!r}, but {name_a} has {labels_a!r}. Pass "
            "allow_label_mismatch=True to fuse members whose labels differ."
        )


# Config fields that size a model's tensors or set their number, by name (a heuristic for the advice alone)
SIZING = frozenset({"d_model", "d_ff", "d_kv", "d_inner", "max_position_embeddings", "max_source_positions",
                    "max_target_positions", "type_vocab_size"})
SIZING_ENDS = ("_size", "_dim", "_dims", "_layers", "_heads", "_channels", "_positions", "_embd", "_ffn_dim")


def _advice(path: str) -> str:
    """What to do about members whose configs differ in ``path``: set it alike, unless that would change numbers or
    cannot be (a field that sizes the members' tensors)."""
    field = path.rsplit(".", 1)[-1]
    if field == "tie_word_embeddings":
        return ("Members that tie their input and output embeddings and members that do not compute differently and "
                "cannot be fused together (PEFT's merge unties them in an adapter that saves or adapts one of them: "
                "fuse such an adapter unmerged, or beside adapters merged alike).")
    if field == "vocab_size":
        return ("Their vocabularies differ, and so do their embedding tables: fuse members of one vocabulary together "
                "(adapters trained over a vocabulary grown with resize_token_embeddings fuse with adapters that grew "
                "it alike, not beside their base or adapters that did not).")
    if field in SIZING or field.startswith(("num_", "n_")) or field.endswith(SIZING_ENDS) and "rotary" not in field:
        return (f"config.{path} sizes the members' tensors (or their number), so they are not one architecture: "
                "fuse members of one architecture together.")
    return f"If config.{path} does not, set it alike on every member before fusing."


def _graph_fields(config: dict) -> dict:
    """A config's ``to_dict()`` less its :data:`METADATA_FIELDS`, in its sub-configs too (CLIP's ``text_config``)."""
    return {k: _graph_fields(v) if isinstance(v, dict) and "model_type" in v else v for k, v in config.items()
            if k not in METADATA_FIELDS}


def _difference(path: str, a, b) -> tuple[str, object, object]:
    """The first field where ``a`` and ``b`` (config values, sub-configs as dicts) differ: its dotted path, both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        key = next(k for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k))
        return _difference(f"{path}.{key}", a.get(key), b.get(key))
    return path, a, b


# The tensors of a PEFT LoRA layer whose shapes hold the adapter's rank, which adapters may differ in.
LORA_RANKED = ("lora_A.", "lora_B.", "lora_embedding_A.", "lora_embedding_B.")


def _may_differ(model: nn.Module) -> Callable[[str], bool]:
    """Whether a state-dict key may differ in shape between members: a tensor that a fused block pads
    (``WideLoraLinear.shapes_may_differ``), or another LoRA layer's tensors that hold its rank (a LoRA on a
    convolution, or on a parameter such as Mixtral's router weight): such a layer's rank ``r`` differs between
    the members, so the plan runs it as each member's own module (:func:`hf_wide.structure.opaque_modules`)."""
    lora = sys.modules.get("peft.tuners.lora")  # not imported: no member holds a LoRA layer
    paths = {}
    for path, module in model.named_modules():
        block = find_block(module)
        if block is not None and hasattr(block, "shapes_may_differ"):
            paths[f"{path}." if path else ""] = block.shapes_may_differ
        elif lora is not None and isinstance(module, lora.LoraLayer):
            paths[f"{path}." if path else ""] = lambda name: name.startswith(LORA_RANKED)
    return lambda key: any(key.startswith(p) and rule(key[len(p):]) for p, rule in paths.items())


def _check_state_dicts(a: nn.Module, b: nn.Module, name_a: str, name_b: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    may_differ = _may_differ(a)
    for key in sa:
        if key not in sb:
            raise IncompatibleMembersError(f"{name_b} has no tensor {key!r}, which {name_a} has.")
        if sa[key].shape != sb[key].shape and not may_differ(key):
            raise IncompatibleMembersError(
                f"{name_b} has {key!r} of shape {tuple(sb[key].shape)}, but {name_a} has {tuple(sa[key].shape)}."
            )
    require_one_dtype([{k: t.dtype for k, t in sa.items()}, {k: t.dtype for k, t in sb.items()}], [name_a, name_b],
                      "Pass dtype= to from_pretrained, or convert the models to one: model.to(dtype)")
    for key in sb:
        if key not in sa:
            raise IncompatibleMembersError(f"{name_b} has a tensor {key!r} that {name_a} does not have.")


def require_one_dtype(dtypes: Sequence[dict], names: Sequence[str], way_out: str) -> None:
    """Refuse members whose floating-point tensors of one name differ in dtype (``dtypes``: each member's, by name):
    the wide model holds one, and would run a member in another dtype than its own, silently (a bfloat16 member
    stacked with float32 ones ran in float32; a float32 checkpoint loaded beside a bfloat16 one, in bfloat16)."""
    for name, theirs in zip(names[1:], dtypes[1:]):
        for key, dtype in dtypes[0].items():
            other = theirs.get(key, dtype)
            if other != dtype and dtype.is_floating_point and other.is_floating_point:
                raise IncompatibleMembersError(
                    f"{name} holds {key!r} in {other}, but {names[0]} in {dtype}: a wide model runs every member in "
                    f"one dtype, and either would not compute as it does alone. {way_out}.")
