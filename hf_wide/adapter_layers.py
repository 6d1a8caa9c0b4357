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
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from .compat import IncompatibleMembersError
from .cpu import release_freed_memory
from .primitives.base import same_value


def shared_view(model: nn.Module, own: Callable[[str], bool] | None = None,
                memo: dict[int, object] | None = None) -> nn.Module:
    """A structural copy of ``model`` that holds the very same tensors (nothing is copied), except those whose
    names ``own`` picks: copies of its own (a tensor tied under several names is copied where ``own`` picks any of
    them, and stays tied). ``memo`` (filled in): the ``copy.deepcopy`` memo, each copied tensor's copy by ``id``."""
    tensors = _named_tensors(model)
    copied = set() if own is None else {id(t) for name, t in tensors if own(name)}
    memo = {} if memo is None else memo
    memo.update({id(t): t for name, t in tensors if id(t) not in copied})
    return copy.deepcopy(model, memo)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` under each of its names (tied ones under every name)."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def held_base_tensors(keys: Iterable[str], base: nn.Module) -> set[str]:
    """The names in ``base`` of its own tensors whose values an adapter file holds (``keys``, the file's names, as
    PEFT writes them): the base layers of the embeddings a LoRA adapts, which PEFT saves whole
    (``save_embedding_layers``), as ``...embed_tokens.base_layer.weight``. Not the modules it saves whole
    (``modules_to_save``): those load into copies of their own, and their names (``classifier.weight``) say nothing
    of it; a file that does write into the base is refused as it loads (:func:`base_untouched`)."""
    names = {name for name, _ in _named_tensors(base)}
    layers = (key.removeprefix("base_model.model.").replace(".base_layer.", ".") for key in keys
              if ".base_layer." in key)
    return {name for name in layers if name in names}


def adapter_view(base: nn.Module, config: dict, held: set[str] = frozenset()
                 ) -> tuple[nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The base for one adapter to load over: a :func:`shared_view`, with copies of its own of the base tensors
    the adapter holds values of. PEFT's ``bias="all"`` trains and saves every tensor whose name holds "bias", and
    ``bias="lora_only"`` the biases of the layers it adapts: loaded into the shared tensors, one adapter's biases
    would be every member's. ``held`` (:func:`held_base_tensors`): the other base tensors its file holds, each
    copied too, and returned by name as (the base's, the copy) for :func:`reshare` once the adapter has loaded."""
    trains_biases = config.get("bias", "none") != "none"
    held = {name for name in held if not (trains_biases and "bias" in name)}  # trained: each member's own
    memo: dict[int, object] = {}
    view = shared_view(base, lambda name: name in held or (trains_biases and "bias" in name), memo)
    tensors = dict(_named_tensors(base))
    return view, {name: (tensors[name], memo[id(tensors[name])]) for name in sorted(held)}


def reshare(view: nn.Module, copies: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str) -> None:
    """Once an adapter has loaded over ``view`` (:func:`adapter_view`): each base tensor its file held values of
    becomes the base's own again where the values are the base's (PEFT saves an embedding layer it adapts whole,
    unchanged unless the vocabulary grew), held once; the adapter is refused where they differ."""
    differ = [key for key, (ours, loaded) in copies.items() if not same_value(ours, loaded)]
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise IncompatibleMembersError(
            f"{name} holds values of the base's own tensors ({shown}) that differ from the base's, which its members "
            "share. Pass merge=True to merge each adapter into its own copy of the base (exact, N full weight sets).")
    base_of_copy = {id(loaded): ours for ours, loaded in copies.values()}
    for module in view.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None and id(t) in base_of_copy:
                    table[key] = base_of_copy[id(t)]


@contextlib.contextmanager
def base_untouched(base: nn.Module, name: str) -> Iterator[None]:
    """Refuse an adapter that, as it loads, writes into a tensor of the base its members share (one the
    adapter's file was not seen to hold, see :func:`held_base_tensors`), in place or by giving it new data
    (``weight.data = ...``, which PEFT's PiSSA does and no version counter sees): it would change every member, so no
    member would be what was saved."""
    tensors = base.state_dict(keep_vars=True)
    before = {key: _written(t) for key, t in tensors.items()}
    # Loading a state dict without BatchNorm's num_batches_tracked copies the module's own count into it: written,
    # by its version, with its own value. One-element tensors are compared by value too.
    scalars = {key: t.detach().clone() for key, t in tensors.items() if t.numel() == 1}
    yield
    written = [key for key, t in base.state_dict(keep_vars=True).items() if _written(t) != before[key] and not (
        key in scalars and _written(t)[1:] == before[key][1:] and torch.equal(t.detach(), scalars[key]))]
    if written:
        shown = ", ".join(written[:3]) + (f" and {len(written) - 3} more" if len(written) > 3 else "")
        raise IncompatibleMembersError(
            f"{name} writes into the base's own tensors as it loads ({shown}), which its members share. Pass "
            "merge=True to merge each adapter into its own copy of the base (exact, N full weight sets).")


def _written(t: torch.Tensor) -> tuple:
    """What changes when ``t`` is written: its version (in place) and its data (``t.data = ...``)."""
    return _version(t), t.data_ptr(), t.shape, t.dtype, t.device


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
    """Wrap each ``nn.Linear`` (or GPT-2's ``Conv1D``, or an embedding) at ``paths`` (relative to the PEFT
    model) that has no adapter in a LoRA layer whose update is exactly zero (rank 1, its B zero): then every member
    has the same structure; their weights are in ``dtype``, the adapters' (float32 over a half-precision base, as
    PEFT keeps them), so each layer's stacked updates have one dtype. Returns the paths wrapped."""
    import peft
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora import Linear as LoraLinear
    from transformers.pytorch_utils import Conv1D

    wrapped = []
    for path in sorted(paths - lora_paths(model)):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = getattr(parent, child)
        embedding = isinstance(layer, nn.Embedding)  # a scaled one too (Gemma's), as PEFT's own dispatch takes it
        if type(layer) not in (nn.Linear, Conv1D) and not embedding:
            raise IncompatibleMembersError(f"{path} is a {type(layer).__name__}: hf-wide can give it no zero LoRA.")
        conv = type(layer) is Conv1D  # PEFT wraps it with fan_in_fan_out, as its own dispatch does
        config = peft.LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=[], fan_in_fan_out=conv)
        if embedding:
            lora = LoraEmbedding(layer, "default", config=config, r=1, lora_alpha=1)
            updates = (lora.lora_embedding_A, lora.lora_embedding_B)
        else:
            lora = LoraLinear(layer, "default", config=config, r=1, lora_alpha=1, is_target_conv_1d_layer=conv)
            updates = (lora.lora_A, lora.lora_B)
        for adapter in updates:  # not the base layer inside: it stays the base's tensors
            adapter.to(layer.weight.device, dtype)
        zero_update(lora)
        lora.requires_grad_(False)
        setattr(parent, child, lora.eval())
        wrapped.append(path)
    _list_targets(model)  # every member's are now the union
    return wrapped


def zero_update(layer: nn.Module) -> None:
    """Make a LoRA layer (PEFT's ``lora.Linear`` or ``lora.Embedding``) an exact no-op: its B zero, whatever its A
    (PEFT starts A random)."""
    for table in (layer.lora_B, layer.lora_embedding_B):  # a ModuleDict of linears, a ParameterDict
        for tensor in table.parameters():
            nn.init.zeros_(tensor)


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
                f"{_tokens(theirs)}: hf-wide fuses adapters that train as many tokens of the same embeddings. Merge "
                "each adapter into its own copy of the base instead (from_pretrained(..., merge=True), or each "
                "PeftModel's merge_and_unload()): exact, N full weight sets.")


def _tokens(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} token{'s' * (n != 1)} of {path}" for path, n in sorted(counts.items())) or "no tokens"


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
    full = frozenset(i for i, m in enumerate(models) if adapters and not isinstance(m, peft.PeftModel))
    lora = bool(adapters) and all(list(m.peft_config) == ["default"] and m.peft_config["default"].peft_type
                                  == peft.PeftType.LORA for m in adapters)
    if not lora or any(type(models[i]) is not type(adapters[0].get_base_model()) for i in full):
        return list(models), None, frozenset()  # (members of other classes are refused as such)
    union, saved, dtype = adapter_structure(models)
    if not full and all(lora_paths(m) == union and saved_paths(m) == saved for m in models):
        return list(models), None, frozenset()
    trainable = [(p, p.requires_grad) for m in models for p in m.parameters()]
    views = [as_adapter(shared_view(m), adapters[0]) if i in full else shared_view(m) for i, m in enumerate(models)]
    padded = [pad_saved_modules(view, saved) + pad_targets(view, union, dtype) for view in views]
    for p, flag in trainable:  # the wrappers froze the tensors they wrap, which are the models' own
        p.requires_grad_(flag)
    return views, padded, full


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
