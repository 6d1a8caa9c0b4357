"""PEFT adapters as members: ``WideModel.from_pretrained([adapter, ...])`` over one base model.

An adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) names its base in
``base_model_name_or_path``; every adapter must name the same one (or the caller passes ``base_model=``). The
base is downloaded and loaded **once**; each member is a ``PeftModel`` over a structural copy of it whose
tensors are the base's own (no copy), with the adapter's weights injected. Fusing then takes each ``lora.Linear``
as a :class:`~hf_wide.blocks.lora.WideLoraLinear`: one base matmul over all N*B rows plus each member's low-rank
update. Members must share one structure, so where adapters target different modules, a member without an
adapter on a module gets one whose update is exactly zero (``lora_B = 0``); where the list also holds full
checkpoints of the base's architecture (the base itself, say), they are wrapped the same way.

LoRA is fused as such. Any other PEFT type (IA3, LoHa, prompt tuning, ...) or LoRA variant (DoRA, ...) is
refused with the member and the option named, unless ``merge=True``: then each adapter is merged into its own
copy of the base (N full weight sets) and the members are fused as full checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import transformers
from torch import nn

from .adapter_repos import AdapterSources
from .compat import IncompatibleMembersError

ADAPTER_CONFIG = "adapter_config.json"
# PEFT's task types -> the transformers auto class that builds the base for them.
TASK_CLASSES = {
    "CAUSAL_LM": transformers.AutoModelForCausalLM,
    "SEQ_CLS": transformers.AutoModelForSequenceClassification,
    "TOKEN_CLS": transformers.AutoModelForTokenClassification,
    "SEQ_2_SEQ_LM": transformers.AutoModelForSeq2SeqLM,
    "QUESTION_ANS": transformers.AutoModelForQuestionAnswering,
    "FEATURE_EXTRACTION": transformers.AutoModel,
}


def adapter_config(folder: Path) -> dict | None:
    """The folder's ``adapter_config.json`` as a dict, or None if it is not a PEFT adapter."""
    path = Path(folder) / ADAPTER_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def require_peft():
    try:
        import peft
    except ImportError as exc:
        raise ImportError("Loading PEFT adapters as members needs peft: pip install 'hf-wide[lora]' "
                          "(or pip install peft).") from exc
    return peft


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """Wrapping a model, PEFT reads ``model.is_gradient_checkpointing``, which transformers 5 deprecates with a
    FutureWarning, and warns that the config it is given names another base (the adapters' config, which gives a
    full member its zero updates): nobody loading adapters can act on either. Those two are dropped, any other
    shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*base_model_name_or_path` was renamed.*", category=UserWarning)
        yield


# Arguments a PeftModel's forward takes for itself: per-row adapter routing, which a wide model has no use for.
PEFT_FORWARD_ARGS = frozenset({"adapter_names", "alora_offsets", "task_ids"})


def runs_inner_model(model: nn.Module) -> bool:
    """Whether a wide forward may call a ``PeftModel``'s transformers model itself (``model.base_model.model``).

    For LoRA (not prompt learning) PEFT's forward only routes rows to adapters when ``adapter_names`` asks for it
    (refused in a wide model: every member runs on every row) and otherwise calls that model with the same
    arguments. Its wrappers cost ~3% of a small model's forward (the 2-layer BERT of the benchmark, 8 rows of 16
    tokens), on a path the ideal does not take. Nothing is skipped that the layers need: each LoRA layer is a
    ``WideLoraLinear`` (or a member's own ``lora.Linear``, which reads its active adapter itself)."""
    peft = sys.modules.get("peft")
    return (peft is not None and isinstance(model, peft.PeftModel) and isinstance(model.base_model, peft.LoraModel)
            and not model.active_peft_config.is_prompt_learning)


def lora_refusal(config: dict) -> str | None:
    """Why an adapter config cannot be fused as LoRA (None if it can): its PEFT type, or a LoRA variant."""
    if config.get("peft_type") != "LORA":
        return f"is a {config.get('peft_type')} adapter; hf-wide fuses LoRA adapters"
    for option in ("use_dora", "use_bdlora", "lora_bias"):  # fan_in_fan_out: GPT-2's Conv1D, taken (blocks/lora.py)
        if config.get(option):
            return f"uses {option}={config[option]!r}, which hf-wide does not fuse"
    for option in ("alora_invocation_tokens", "arrow_config", "velora_config", "monteclora_config", "kasa_config",
                   "mica"):
        if config.get(option) not in (None, False):
            return f"uses {option}, a LoRA variant hf-wide does not fuse"
    return None


def base_of(configs: Sequence[dict | None], names: Sequence[str], base_model: str | None) -> str:
    """The one base every adapter names (or ``base_model``); raise if two adapters name different bases."""
    if base_model is not None:
        return base_model
    named = [(name, c.get("base_model_name_or_path")) for name, c in zip(names, configs) if c is not None]
    missing = next((name for name, base in named if not base), None)
    if missing is not None:
        raise ValueError(f"{missing} names no base model (base_model_name_or_path); pass base_model=.")
    first_name, first = named[0]
    for name, base in named[1:]:
        if base != first:
            raise IncompatibleMembersError(
                f"{name} is an adapter of {base!r}, but {first_name} is an adapter of {first!r}: all adapters must "
                "share one base (pass base_model= to load them over another).")
    return first


def base_class(configs: Sequence[dict | None], base_config, name: str) -> type:
    """The transformers class to load the base with: the adapters' task type's, else the base's own."""
    from .saving import model_class_for

    tasks = {c.get("task_type") for c in configs if c is not None}
    tasks.discard(None)
    if len(tasks) > 1:
        raise IncompatibleMembersError(f"The adapters are for different tasks: {sorted(tasks)}.")
    if tasks and tasks <= TASK_CLASSES.keys():
        auto = TASK_CLASSES[tasks.pop()]
        return auto._model_mapping[type(base_config)]
    return model_class_for(base_config, name)


def check_adapter_weights(folder: Path, name: str, allow_pickle: bool) -> None:
    if (folder / "adapter_model.safetensors").is_file():
        return
    if (folder / "adapter_model.bin").is_file():
        if not allow_pickle:
            raise ValueError(f"{name} has only pickle weights (adapter_model.bin), which can run arbitrary code when "
                             "loaded. Pass allow_pickle=True if you trust it.")
        return
    raise FileNotFoundError(f"{name} has no adapter weights (adapter_model.safetensors) in {folder}.")


def head_labels(folders: Sequence[Path], configs: Sequence[dict | None]) -> int | None:
    """The number of labels the adapters' saved heads (``modules_to_save``) were trained with, if they hold one."""
    from safetensors import safe_open

    for folder, config in zip(folders, configs):
        if config is None or not config.get("modules_to_save") or config.get("task_type") not in (
                "SEQ_CLS", "TOKEN_CLS", None):
            continue
        path = folder / "adapter_model.safetensors"
        if not path.is_file():
            continue
        with safe_open(path, "pt") as f:
            for key in f.keys():
                head = key.split(".")
                if key.endswith(".weight") and any(m in head for m in config["modules_to_save"]) and (
                        "out_proj" in head or head[-2] in config["modules_to_save"]):
                    return f.get_slice(key).get_shape()[0]
    return None


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


def pad_targets(model: nn.Module, paths: set[str], dtype: torch.dtype) -> list[str]:
    """Wrap each ``nn.Linear`` (or GPT-2's ``Conv1D``) at ``paths`` (relative to the PEFT model) that has no
    adapter in a LoRA layer whose update is exactly zero (rank 1, ``lora_B = 0``): then every member has the same
    structure; their weights are in ``dtype``, the adapters' (float32 over a half-precision base, as PEFT keeps
    them), so each layer's stacked updates have one dtype. Returns the paths wrapped."""
    peft = require_peft()
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


def unpad_targets(model: nn.Module, paths: Sequence[str]) -> None:
    """Undo :func:`pad_targets` on a member taken out of the wide model: each zero-update layer at ``paths``
    becomes its base layer again, so the member is the adapter as it was saved."""
    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, child, getattr(parent, child).base_layer)
    _list_targets(model)


def _list_targets(model: nn.Module) -> None:
    """PEFT's LoraModel lists the names of the layers it adapted, relative to its model."""
    model.base_model.targeted_module_names = sorted(p.removeprefix("base_model.model.") for p in lora_paths(model))


def load_adapter_members(ids, folders, configs, *, base_model=None, base_revision=None, merge=False,
                         allow_pickle=False, dtype=None, device=None, trust_remote_code=False, hub_kwargs=None):
    """The members of a list that holds adapters, where they came from (:class:`AdapterSources`, for saving;
    None after ``merge`` or with full checkpoints other than the base) and each member's zero-update paths
    (:func:`pad_targets`; None after ``merge``). Each adapter is a ``PeftModel`` over a
    view of the one base (or, with ``merge``, merged into its own copy); each full checkpoint is loaded and,
    like the base when it is in the list, given zero LoRA layers."""
    from .hub import MemberLoadError, commit_sha, download_members
    from .loading import load_member, weights_format

    peft = require_peft()
    names = [f"member {i} ({model_id})" for i, model_id in enumerate(ids)]
    for name, folder, config in zip(names, folders, configs):
        if config is None:
            continue
        check_adapter_weights(Path(folder), name, allow_pickle)
        why = lora_refusal(config)
        if why is not None and not merge:
            raise NotImplementedError(f"{name} {why}. Pass merge=True to merge each adapter into its own copy of the "
                                      "base (exact, N full weight sets).")
    base_id = base_of(configs, names, base_model)
    try:
        (base_folder,) = download_members([base_id], base_revision, allow_pickle=allow_pickle, **(hub_kwargs or {}))
    except (MemberLoadError, OSError) as exc:
        raise MemberLoadError(f"The base model {base_id!r} of the adapters could not be loaded: {exc}") from exc
    base_name = f"the base model ({base_id})"
    base_config = transformers.AutoConfig.from_pretrained(base_folder, trust_remote_code=trust_remote_code)
    klass = base_class(configs, base_config, base_name)
    labels = head_labels([Path(f) for f in folders], configs)
    extra = {"num_labels": labels} if labels is not None and labels != base_config.num_labels else {}
    base = load_member(base_folder, base_name, dtype, device=device, klass=klass, trust_remote_code=trust_remote_code,
                       use_safetensors=weights_format(Path(base_folder), base_name, allow_pickle), **extra)

    models = []
    for name, model_id, folder, config in zip(names, ids, folders, configs):
        if config is None:  # a full checkpoint: the base itself, or one of its architecture
            if str(model_id) == str(base_id):
                models.append(shared_view(base))
            else:
                models.append(load_member(folder, name, dtype, device=device, klass=klass,
                                          trust_remote_code=trust_remote_code,
                                          use_safetensors=weights_format(folder, name, allow_pickle)))
            continue
        target = copy.deepcopy(base) if merge else adapter_view(base, config)
        with base_untouched(base, name):
            try:
                with peft_quietly():
                    # Not low_cpu_mem_usage: over a half-precision base it rounds the adapter's weights to the base's
                    # dtype before PEFT upcasts them to float32 (PEFT 0.21), unlike PeftModel.from_pretrained(base,
                    # adapter)
                    member = peft.PeftModel.from_pretrained(target, str(folder), is_trainable=False)
            except Exception as exc:
                raise IncompatibleMembersError(
                    f"{name} does not load over {base_name}: {type(exc).__name__}: {exc}") from exc
        models.append(member.merge_and_unload().eval() if merge else member.eval())
    if merge:
        return models, None, None
    union = set().union(*(lora_paths(m) for m in models if isinstance(m, peft.PeftModel)))
    reference = next(m for m in models if isinstance(m, peft.PeftModel))
    dtype = next(p.dtype for name, p in reference.named_parameters() if ".lora_" in name)
    padded = []
    for i, model in enumerate(models):
        if not isinstance(model, peft.PeftModel):  # a full member: the adapters' structure, with zero updates
            with peft_quietly():
                model = peft.get_peft_model(model, copy.deepcopy(reference.peft_config["default"])).eval()
            for path in lora_paths(model):  # the fresh adapter's own random A: zero B keeps it a no-op
                nn.init.zeros_(model.get_submodule(path).lora_B["default"].weight)
            model.requires_grad_(False)
            models[i] = model
        padded.append(pad_targets(models[i], union, dtype))
    stack_adapters(models)
    full = any(c is None and str(i) != str(base_id) for c, i in zip(configs, ids))  # a full checkpoint, not the base
    sources = None if full else AdapterSources(base_id, base_revision or commit_sha(Path(base_folder)), list(configs),
                                               padded)
    return models, sources, padded
