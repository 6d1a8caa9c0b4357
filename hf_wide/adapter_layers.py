"""The structure of adapter members: the wrappers that give every member the same modules
(:mod:`hf_wide.adapters` loads the members over views of the one base, :mod:`hf_wide.adapter_views`).

Where adapters target different modules, or save different modules whole (``modules_to_save``), each member gets
the ones it lacks as exact no-ops: a LoRA layer whose update is zero (:func:`pad_targets`; also on the linears whose
biases ``bias="all"`` trains, :func:`trained_bias_paths`), a saved copy of the base's module
(:func:`pad_saved_modules`), which :func:`unpad` takes out again when a member leaves the wide model; what cannot be
given so is refused (:func:`adapter_structure`). :func:`stack_adapters` moves the members' LoRA weights into the
stacked tensors the wide model keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .compat import IncompatibleMembersError
from .cpu import release_freed_memory


# The way out of a refusal that follows from the members sharing one base.
MERGE_INSTEAD = ("Merge each adapter into its own copy of the base instead (from_pretrained(..., merge=True), or each "
                 "PeftModel's merge_and_unload()): each checked against its adapter unmerged, N full weight sets.")


def lora_paths(model: nn.Module) -> set[str]:
    from peft.tuners.lora import LoraLayer

    return {path for path, m in model.named_modules() if isinstance(m, LoraLayer)}


def dora_paths(models: Sequence[nn.Module]) -> set[str]:
    """The paths of the LoRA layers that are DoRA (PEFT's ``use_dora``) in any of ``models``, where a member without
    an adapter is given a DoRA no-op (:func:`pad_targets`); a layer that is DoRA in one member and plain LoRA in
    another is refused."""
    from peft.tuners.lora import LoraLayer

    layers = [{path: bool(m.lora_magnitude_vector) for path, m in model.named_modules() if isinstance(m, LoraLayer)}
              for model in models]
    dora = {path for found in layers for path, is_dora in found.items() if is_dora}
    for path in sorted(dora):
        plain = [i for i, found in enumerate(layers) if found.get(path) is False]
        if plain:
            with_dora = next(i for i, found in enumerate(layers) if found.get(path))
            raise IncompatibleMembersError(
                f"Member {with_dora}'s LoRA on {path.removeprefix('base_model.model.')} is DoRA (use_dora=True), "
                f"member {plain[0]}'s is not: hf-wide fuses a layer that is DoRA in every member that adapts it, or "
                f"in none. {MERGE_INSTEAD}")
    return dora


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


def pad_targets(model: nn.Module, paths: set[str], dtype: torch.dtype, name: str = "a member",
                dora: set[str] = frozenset()) -> list[str]:
    """Wrap each ``nn.Linear`` (or GPT-2's ``Conv1D``, an embedding, or a convolution: of the rank its groups, which
    PEFT's must divide) at ``paths`` (relative to the PEFT model) that has no adapter in a LoRA layer whose update is
    exactly zero (rank 1, its B zero; DoRA at the paths in
    ``dora``, :func:`dora_paths`): then every member has the same structure; their weights are in ``dtype``, the
    adapters' (float32 over a half-precision base, as PEFT keeps them), so each layer's stacked updates have one
    dtype. Returns the paths wrapped. Any other module there is refused, ``name`` (the member's) and merging named."""
    import peft
    import peft.tuners.lora.layer
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora import Linear as LoraLinear
    from transformers.pytorch_utils import Conv1D

    wrapped = []
    for path in sorted(paths - lora_paths(model)):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = getattr(parent, child)
        embedding = isinstance(layer, nn.Embedding)  # a scaled one too (Gemma's), as PEFT's own dispatch takes it
        convolution = CONVOLUTIONS.get(type(layer))
        if not (_plain_linear(layer) or embedding or convolution and path not in dora):
            raise IncompatibleMembersError(
                f"Another member has a {'DoRA' if path in dora else 'LoRA'} on {path.removeprefix('base_model.model.')}"
                f", but {name} has a {type(layer).__name__} there, to which hf-wide can give no zero "
                f"{'DoRA' if path in dora else 'LoRA'}. {MERGE_INSTEAD}")
        conv = type(layer) is Conv1D  # PEFT wraps it with fan_in_fan_out, as its own dispatch does
        config = peft.LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=[], fan_in_fan_out=conv,
                                 use_dora=path in dora)
        if embedding:
            lora = LoraEmbedding(layer, "default", config=config, r=1, lora_alpha=1)
            updates = (lora.lora_embedding_A, lora.lora_embedding_B)
        elif convolution:  # (PEFT takes a rank its groups divide)
            lora = getattr(peft.tuners.lora.layer, convolution)(layer, "default", config=config, r=layer.groups,
                                                                lora_alpha=layer.groups)
            updates = (lora.lora_A, lora.lora_B)
        else:
            lora = LoraLinear(layer, "default", config=config, r=1, lora_alpha=1, is_target_conv_1d_layer=conv)
            # (and a DoRA magnitude, made in the base's dtype: in half precision m / n was not exactly 1)
            updates = (lora.lora_A, lora.lora_B, lora.lora_magnitude_vector)
        for adapter in updates:  # not the base layer inside: it stays the base's tensors
            adapter.to(layer.weight.device, dtype)
        zero_update(lora)
        lora.requires_grad_(False)
        setattr(parent, child, lora.eval())
        wrapped.append(path)
    _list_targets(model)  # every member's are now the union
    return wrapped


# torch's convolutions, and the LoRA layer PEFT wraps each in
CONVOLUTIONS = {nn.Conv1d: "Conv1d", nn.Conv2d: "Conv2d", nn.Conv3d: "Conv3d"}


def _plain_linear(layer: nn.Module) -> bool:
    """An ``nn.Linear`` (transformers' subclasses too, Falcon's ``FalconLinear``, as PEFT's dispatch takes them; not
    a quantised one) or GPT-2's ``Conv1D``: what a zero LoRA can wrap."""
    from transformers.pytorch_utils import Conv1D

    return type(layer) is Conv1D or isinstance(layer, nn.Linear) and type(layer).__module__.split(".")[0] in (
        "torch", "transformers")


def zero_update(layer: nn.Module) -> None:
    """Make a LoRA layer (PEFT's ``lora.Linear`` or ``lora.Embedding``) an exact no-op: its B zero, whatever its A
    (PEFT starts A random), and a DoRA magnitude the norms of the base weight's rows, as PEFT's forward computes
    them with a zero update (so that each output is scaled by exactly 1)."""
    from peft.utils.other import transpose

    for table in (layer.lora_B, layer.lora_embedding_B):  # a ModuleDict of linears, a ParameterDict
        for tensor in table.parameters():
            nn.init.zeros_(tensor)
    if not layer.lora_magnitude_vector:  # (a LoRA on a parameter, PEFT's ParamWrapper, has no .weight to read)
        return
    weight = layer.get_base_layer().weight
    with torch.no_grad():
        for name, dora in layer.lora_magnitude_vector.items():
            magnitude = dora.weight
            no_update = torch.zeros_like(transpose(weight, dora.fan_in_fan_out), dtype=magnitude.dtype)
            magnitude.copy_(dora.get_weight_norm(weight.to(magnitude.dtype), no_update, layer.scaling[name]))


def stack_adapters(models: Sequence[nn.Module]) -> None:
    """Move the members' adapters into the tensors the wide model will hold: for each LoRA layer, every member's
    ``lora_A`` and ``lora_B`` are copied into one ``(N, r, D_in)`` and one ``(N, D_out, r)`` tensor (ranks
    zero-padded to the largest) and theirs become views of them, which ``WideLoraLinear`` then takes as they are.
    Done as the adapters are loaded, before the trace: PEFT's own copies are freed then, rather than staying
    beside the stacked ones until the fused model is built (4 adapters of a 727 MiB BERT: 27 MiB), and given back to
    the system layer by layer (16 adapters of a BERT-base: the stacking peaked 58 MiB higher without, in 75 ms less)."""
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
        release_freed_memory()  # the layer's old weights, small blocks the larger stacked ones cannot reuse


def adapter_structure(models: Sequence[nn.Module]) -> tuple[set[str], set[str], torch.dtype]:
    """What every member must hold, read off the PEFT models among ``models``: the paths of every LoRA layer of any
    of them (with the linears whose biases PEFT's ``bias="all"`` trains, where one trains them, but for those a
    member saves whole), the paths of every module any of them saves whole, and the dtype of their adapters' weights
    (for :func:`pad_targets`)."""
    import peft

    adapters = [m for m in models if isinstance(m, peft.PeftModel)]
    _require_alike_tokens(models)
    union, saved = set().union(*map(lora_paths, adapters)), set().union(*map(saved_paths, adapters))
    _require_saved_or_adapted(models, union, saved)
    if any(getattr(config, "bias", "none") == "all" for m in adapters for config in m.peft_config.values()):
        biases = set().union(*map(trained_bias_paths, adapters))  # but in a module saved whole: its bias with it
        union |= {path for path in biases if not any(path == p or path.startswith(f"{p}.") for p in saved)}
    dtype = next(p.dtype for m in adapters for name, p in m.named_parameters() if ".lora_" in name)
    return union, saved, dtype


def trained_tokens(model: nn.Module) -> dict[str, int]:
    """How many rows of each embedding ``model`` (a PEFT model) trains with PEFT's ``trainable_token_indices``, by
    path in its transformers model (a tied output layer's rows are the embedding's)."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    return {path.removeprefix("base_model.model.").removesuffix(".token_adapter"):
            sum(map(len, m.token_indices.values()))
            for path, m in model.named_modules() if isinstance(m, TrainableTokensLayer) and m.tied_adapter is None}


def _require_alike_tokens(models: Sequence[nn.Module]) -> None:
    """Refuse PEFT models that train different numbers of tokens (``trainable_token_indices``), or of different
    embeddings: their layers would differ in shape. (Which tokens may differ; a plain model beside them gets the
    adapters' trainable tokens at their base values, :func:`as_adapter`.)"""
    import peft

    tokens = [(i, trained_tokens(m)) for i, m in enumerate(models) if isinstance(m, peft.PeftModel)]
    first, theirs = tokens[0] if tokens else (None, {})
    for i, ours in tokens[1:]:
        if ours != theirs:
            raise IncompatibleMembersError(
                f"member {i} trains {_tokens(ours)} (PEFT's trainable_token_indices) and member {first} "
                f"{_tokens(theirs)}: hf-wide fuses adapters that train as many tokens of the same embeddings. "
                f"{MERGE_INSTEAD}")


def _require_saved_or_adapted(models: Sequence[nn.Module], adapted: set[str], saved: set[str]) -> None:
    """Refuse members of which one saves a module whole (``modules_to_save``) where another has a LoRA on it or
    inside it (an adapter trained without a task type, PEFT's ``all-linear`` then adapting the head the others save):
    no member can be given the other's structure as an exact no-op."""
    paths = [(saved_paths(m), lora_paths(m)) if hasattr(m, "peft_config") else (set(), set()) for m in models]

    def holder(path: str, k: int) -> str:  # the first member that holds ``path`` saved whole (k=0) or adapted (1)
        return f"member {next(i for i, held in enumerate(paths) if path in held[k])}"

    def inside(outer: str, paths_in: set[str]) -> tuple[str, str] | None:
        return next(((outer, p) for p in sorted(paths_in) if p == outer or p.startswith(f"{outer}.")), None)

    # (a module saved inside another's: wrapped inside its wrapper, or looked for inside it, and the load crashed)
    nested = next(filter(None, (inside(s, saved - {s}) for s in sorted(saved))), None)
    both = next(filter(None, (inside(s, adapted) for s in sorted(saved))), None)
    if nested is not None:
        raise IncompatibleMembersError(
            f"{holder(nested[0], 0)} saves {_short(nested[0])} whole (modules_to_save), and {holder(nested[1], 0)} "
            f"saves {_short(nested[1])} inside it whole: hf-wide lines up the modules adapters save whole where they "
            f"are the same modules. {MERGE_INSTEAD}")
    if both is not None:
        raise IncompatibleMembersError(
            f"{holder(both[0], 0)} saves {_short(both[0])} whole (modules_to_save), but {holder(both[1], 1)} has a "
            f"LoRA on {_short(both[1])}: hf-wide fuses a module that the adapters save whole or adapt, not both. "
            f"{MERGE_INSTEAD}")


def _short(path: str) -> str:
    """A module's path in the PEFT model as its base model names it."""
    return path.removeprefix("base_model.model.")


def _tokens(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} token{'s' * (n != 1)} of {path}" for path, n in sorted(counts.items())) or "no tokens"


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
        wrapper.set_adapter("default", inference_mode=True)  # as PEFT sets it: left ["default"], unload() failed
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
    """PEFT's LoraModel lists the names of the layers it adapted, relative to its model, and of the parameters it
    adapted (a LoRA on a parameter, ``ParamWrapper``: its module's name, the wrappers' ``base_layer`` left out, and the
    parameter's)."""
    from peft.tuners.lora import ParamWrapper

    layers = {path.removeprefix("base_model.model."): m for path in lora_paths(model)
              for m in [model.get_submodule(path)]}
    model.base_model.targeted_module_names = sorted(p for p, m in layers.items() if not isinstance(m, ParamWrapper))
    model.base_model.targeted_parameter_names = sorted(f"{p.replace('.base_layer', '')}.{m.parameter_name}"
                                                       for p, m in layers.items() if isinstance(m, ParamWrapper))
