"""Structural checks: which modules must run as each member's own code, whatever builders are registered.

A wide builder reimplements its source module from the source's tensors and hyper-parameters. It is exact
only when the module is what the builder knows. Four things make a module something else, and each is a
reason for the planner to run it (and its subtree) per member instead:

- **hooks**: a forward hook or pre-hook (other than transformers' output capture, which hf-wide installs
  itself) may change inputs or outputs; a wide module would skip it;
- **parametrizations** (``torch.nn.utils.parametrizations.weight_norm``, ...): the weight is computed from
  other tensors on every call. Where every member's module has the same parametrizations, member 0's code
  computes any member's weight from that member's tensors: the module is vectorised (``vectorisable``), not
  looped; where the members hold its tensors alike too (adapters of one base), it is shared like any identical
  module (:func:`without_alike_parametrized`);
- **state of its own**: a module whose forward keeps tensors in its plain attributes from one call to the next
  (RecurrentGemma's recurrent block: its convolution state, and its RG-LRU's recurrent state). Run as one code for
  every member, each member would read the state another left; each member's own module keeps its own;
- **differing attributes**: a module kept as the template's code (or rebuilt from member 0's hyper-parameters)
  runs with member 0's plain attributes; where a member's differ (PEFT's per-adapter ``scaling``, a norm's
  ``eps``), member 0's would be used for all. So would a module of another class at the same path.

Fused blocks are stricter still (:func:`block_structure_known`): every module inside one must be an exact class
with a registered builder, or a tensor-free module of torch or transformers (dropout, activations). A PEFT
``lora.Linear`` around a block's ``q_proj`` holds an exact ``nn.Linear`` as its ``base_layer``, but it is
neither: the block, which reads ``q_proj.weight``, would drop the adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from torch import nn
from torch.nn.utils import parametrize

from .capture import is_capture_hook
from .primitives.base import same_value
from .registry import find_block, has_exact_builder, transformers_classes

# Configs are checked by hf_wide.compat, and `name_or_path` is where a member came from. PEFT's `peft_config` (on
# the PeftModel and its tuner) is the adapters' recipe: what its layers run with (`scaling`, `r`, dropout) is
# copied onto each layer, and compared there; its tuner's `targeted_module_names` and `targeted_parameter_names` are
# its record of what it adapted, which no forward reads (the layers differ where they do, and are compared there).
IGNORED_ATTRIBUTES = frozenset({"training", "config", "generation_config", "name_or_path", "peft_config",
                                "targeted_module_names", "targeted_parameter_names"})
# Module classes whose forward keeps state in plain attributes (of its own, or of its children): what it keeps.
STATEFUL = dict(zip(transformers_classes("recurrent_gemma.RecurrentGemmaRecurrentBlock"),
                    ["conv1d_state, rg_lru.recurrent_states"]))
# torch's classes whose fast path (in eval, without autograd) reads their children's weights directly, in one kernel
# (torch._transformer_encoder_layer_fwd): wide children's (N, ...) weights would reach it
FAST_PATHS = (nn.TransformerEncoderLayer, nn.TransformerEncoder)
WHOLE = "(the module)"  # what a block's member_attribute is asked for a module it takes whole per member


class Opaque(NamedTuple):
    """Why the members' modules at one path must run as their own code; ``vectorisable`` when member 0's code
    with any member's tensors is that member's module (the same parametrizations), so that vmap may run it."""

    reason: str
    vectorisable: bool = False
    block_may_take: bool = False  # only attributes differ that the module's fused block takes per member (LoRA ranks)


def source_type(module: nn.Module) -> type[nn.Module]:
    """The module's class; for a parametrized module, the class it was before (each parametrized module gets a
    class of its own)."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def hook_reason(module: nn.Module) -> str | None:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    hooks = [h for h in hooks if not is_capture_hook(h)]
    if hooks:
        name = getattr(hooks[0], "__qualname__", type(hooks[0]).__name__)
        return f"has a forward hook ({name}) that a wide module would skip"
    return None


def attribute_reason(mods: Sequence[nn.Module], allowed: Callable[[str], bool] = lambda name: False) -> str | None:
    """Why the members' modules at one path cannot run as member 0's code: another class (unless
    ``allowed(WHOLE)``), or a plain attribute (not a tensor or child) that differs, other than the ``allowed`` ones."""
    first = mods[0]
    for i, mod in enumerate(mods[1:], start=1):
        if (source_type(mod) is not source_type(first) and not allowed(WHOLE)) or (
                parametrize.is_parametrized(mod) != parametrize.is_parametrized(first)):
            return f"member {i}'s module is a {type(mod).__name__}, member 0's a {type(first).__name__}"
        ours, theirs = vars(first), vars(mod)
        for name in sorted(set(ours) | set(theirs)):
            if name.startswith("_") or name in IGNORED_ATTRIBUTES or allowed(name):
                continue
            if name not in ours or name not in theirs or not same_value(ours[name], theirs[name]):
                return f"its attribute {name!r} differs between members 0 and {i}"
    return None


def opaque_reason(mods: Sequence[nn.Module], taken: Callable[[str], bool] = lambda name: False) -> Opaque | None:
    """Why the members' modules at one path must each run as their own code, or None. ``taken``: the attributes
    a fused block around the path (or at it) takes per member, which make the module opaque only if that block
    is not used (``block_may_take``)."""
    if type(mods[0]) in STATEFUL:
        return Opaque(f"{type(mods[0]).__name__} keeps state in its own attributes between calls "
                      f"({STATEFUL[type(mods[0])]})")
    if type(mods[0]) in FAST_PATHS:
        return Opaque(f"{type(mods[0]).__name__}'s fast path reads its layers' weights itself", vectorisable=True)
    for i, mod in enumerate(mods):
        reason = hook_reason(mod)
        if reason is not None:
            return Opaque(f"member {i}'s module {reason}")
    reason = attribute_reason(mods)
    if reason is not None:
        return Opaque(reason, block_may_take=attribute_reason(mods, taken) is None)
    if parametrize.is_parametrized(mods[0]):  # the same in every member, or attribute_reason said otherwise
        names = ", ".join(mods[0].parametrizations.keys())
        return Opaque(f"{type(mods[0]).__name__} is parametrized ({names}): its tensors are computed per call",
                      vectorisable=True)
    return None


def opaque_modules(members: Sequence[nn.Module]) -> dict[str, Opaque]:
    """Every path (module fqn) whose modules must run as each member's own code, with the reason. The
    parametrizations' own modules (``conv.parametrizations.weight.0``) are checked like any other; their
    tensors belong to the parametrized module."""
    per_member = [dict(m.named_modules()) for m in members]
    found = {}
    for fqn in per_member[0]:
        if any(fqn not in modules for modules in per_member[1:]):
            found[fqn] = Opaque(f"{fqn} is not a module of every member")
            continue
        reason = opaque_reason([modules[fqn] for modules in per_member], _taken_by_blocks(fqn, per_member[0]))
        if reason is not None:
            found[fqn] = reason
    return found


def without_alike_parametrized(opaque: dict[str, Opaque],
                               member_modules: Sequence[dict[str, nn.Module]]) -> dict[str, Opaque]:
    """``opaque`` less the parametrized modules whose tensors (their parametrizations' originals included) are the
    same in every member, with nothing opaque inside them: each member's module computes the same weight, so one
    serves every member, as any identical module does (LoRA members of wav2vec2 hold the base's weight-normed
    positional convolution alike; vectorised, it was stacked N times and run per member)."""
    def alike(fqn: str) -> bool:
        mods = [modules[fqn] for modules in member_modules]
        tensors = [dict((*m.named_parameters(), *m.named_buffers())) for m in mods]
        return all(t.keys() == tensors[0].keys() and all(same_value(t[k], tensors[0][k]) for k in t)
                   for t in tensors[1:])

    def inside(fqn: str) -> bool:
        return any(other.startswith(f"{fqn}.") or (not fqn and other) for other in opaque)

    return {fqn: why for fqn, why in opaque.items()
            if not (why.vectorisable and parametrize.is_parametrized(member_modules[0][fqn]) and not inside(fqn)
                    and alike(fqn))}


def _taken_by_blocks(fqn: str, modules: dict[str, nn.Module]) -> Callable[[str], bool]:
    """The attributes of the module at ``fqn`` that a fused block at it or around it takes per member
    (``member_attribute(relative path, name)``: a LoRA layer's rank, and ``out_features`` of its ``lora_A``; the
    name :data:`WHOLE` asks whether it takes each member's module whole, whatever its class: a LoRA dropout)."""
    rules = []
    parts = fqn.split(".") if fqn else []
    for depth in range(len(parts) + 1):
        block = find_block(modules[".".join(parts[:depth])])
        if block is not None and hasattr(block, "member_attribute"):
            rules.append((".".join(parts[depth:]), block.member_attribute))
    whole = any(rule(relative, WHOLE) for relative, rule in rules)
    return lambda name: whole or any(rule(relative, name) for relative, rule in rules)


def block_structure_known(module: nn.Module, inner_blocks: tuple[type, ...] = (),
                          own: tuple[type, ...] = ()) -> str | None:
    """None if every module inside ``module`` (a fused block's source) is one a block may read: an exact class
    with a registered builder, or a module without tensors from torch or transformers, or the source of one of
    ``inner_blocks`` (blocks the outer one builds itself, with all inside them), or of a class in ``own`` (whose
    tensors the block reads itself). Else the first stranger."""
    inner = []  # paths of inner blocks' sources: what is under them is theirs
    for path, sub in module.named_modules():
        if not path or any(path.startswith(f"{p}.") for p in inner):
            continue
        if inner_blocks and find_block(sub) in inner_blocks:
            inner.append(path)
            continue
        owns = any(t is not None for t in (*sub._parameters.values(), *sub._buffers.values()))
        library = type(sub).__module__.split(".")[0] in ("torch", "transformers")
        if type(sub) in own or (has_exact_builder(type(sub)) if owns else library):
            continue
        return f"{path} is a {type(sub).__module__}.{type(sub).__qualname__}, which the block does not know"
    return None


def tied_to_differing(member_modules: Sequence[dict[str, nn.Module]], aliases: dict[str, list[str]],
                      same: Callable[[Sequence], bool]) -> set[str]:
    """The names of tensors tied to a tensor of a module whose own tensors differ between members (BERT's MLM head:
    ``cls.predictions.bias`` is its decoder's bias, and the decoder's weight, the embeddings', differs). Such a
    tensor is stacked with that module, so it must not be shared even where the members hold it alike: shared
    beside a stacked copy, the tie broke, and a checkpoint read by name filled one of the two. Only the modules
    that hold a tied tensor are compared (the planner compares every module's tensors after)."""
    found = set()
    owners = {name.rpartition(".")[0] for name, names in aliases.items() if len(names) > 1}
    for fqn in sorted(owners):
        module = member_modules[0].get(fqn)
        if module is None:
            continue
        tensors = [k for k, v in (*module._parameters.items(), *module._buffers.items()) if v is not None]
        if any(not same([getattr(mods[fqn], name) for mods in member_modules]) for name in tensors):
            for name in tensors:
                full = f"{fqn}.{name}" if fqn else name
                found.update(aliases.get(full, [full]))
    return {name for name in found if len(aliases.get(name, [name])) > 1}


def partly_frozen(mods: Sequence[nn.Module]) -> str | None:
    """Why a fused block cannot take these modules (None if it can): parameters of one name (the weights of q, k
    and v, their biases) some of which train and some not, in one member. A block holds them as one parameter
    (q, k and v's weights; gate and up's), which trains or does not: a frozen one it trained. Weights frozen beside
    biases that train (PEFT's ``bias="all"``) are two parameters; PEFT's adapter weights are its own blocks'
    business; and what differs between members is one stacked tensor wherever it runs, trained as member 0's
    (``WideModel.train`` says so)."""
    for i, mod in enumerate(mods):
        flags: dict[str, dict[bool, str]] = {}
        for name, param in mod.named_parameters():
            if "lora_" not in name:
                flags.setdefault(name.rpartition(".")[2], {}).setdefault(param.requires_grad, name)
        mixed = next((seen for seen in flags.values() if len(seen) == 2), None)
        if mixed is not None:
            return (f"member {i} trains {mixed[True]} and not {mixed[False]}: one fused parameter would train both "
                    "or neither; planned by its parts")
    return None
