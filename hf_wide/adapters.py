"""PEFT adapters as members: ``WideModel.from_pretrained([adapter, ...])`` over one base model.

An adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) names its base in
``base_model_name_or_path``; every adapter must name the same one (or the caller passes ``base_model=``), at the
same revision (:mod:`hf_wide.adapter_base`). The base is downloaded and loaded **once**; each member is a
``PeftModel`` over a structural copy of it whose tensors are the base's own (no copy; the biases an adapter trains,
and the embedding tables of a vocabulary it grew, are its own), with the adapter's weights injected. Fusing then
takes each ``lora.Linear`` as a :class:`~hf_wide.blocks.lora.WideLoraLinear`: one base matmul over all N*B rows
plus each member's low-rank update. Members must share one structure, so where adapters
target different modules, a member without an adapter on a module gets one whose update is exactly zero
(``lora_B = 0``), and where they save different modules whole (``modules_to_save``), a member gets a saved copy
of the base's module (:mod:`hf_wide.adapter_layers`); where the list also holds full checkpoints of the base's
architecture (the base itself, say), they are wrapped the same way.

Eight adapters or more that build the same modules are loaded and fused a group at a time, then joined
(:mod:`hf_wide.adapter_groups`): the members' module trees are what a load of many adapters holds beyond the base.

LoRA is fused as such, DoRA (``use_dora``) too (:mod:`hf_wide.blocks.lora_dora`). Any other PEFT type (IA3, LoHa,
prompt tuning, ...) or LoRA variant (``lora_bias``, aLoRA, ...) is refused with the member and the option named,
unless ``merge=True``: then each adapter is merged into its own copy of the base (N full weight sets), checked against
itself unmerged (:func:`~hf_wide.adapter_checks.merged`: a merge into tied embeddings is not the adapter), and the
members are fused as full checkpoints. Prompt learning, which PEFT cannot merge, is refused either way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import transformers
from huggingface_hub.utils import tqdm as hf_tqdm
from torch import nn

from .adapter_aligned import as_adapter
from .adapter_base import (adapter_keys, base_class, base_of, base_revision_of, embedding_tables, grown_tables,
                           head_labels, held_by_every_adapter)
from .adapter_checks import (PER_INPUT, check_adapter_weights, check_layer_replication, lora_refusal, mergeable,
                             merged)
from .adapter_layers import adapter_structure, dora_paths, pad_saved_modules, pad_targets, stack_adapters
from .adapter_repos import AdapterSources
from .adapter_trace import alike_structure, module_structure, trace_ahead
from .adapter_views import adapter_view, base_untouched, held_base_tensors, reshare, shared_view
from .compat import IncompatibleMembersError

ADAPTER_CONFIG = "adapter_config.json"
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


def without_peft_args(kwargs: dict) -> dict:
    """``kwargs`` less PEFT's own forward arguments left at None; a value for one is refused."""
    given = sorted(k for k in PEFT_FORWARD_ARGS & kwargs.keys() if kwargs[k] is not None)
    if given:
        raise TypeError(f"A wide model runs every member on every row: {given[0]}= (PEFT's routing of rows to "
                        "adapters) does not apply. Run wide.member(i) for one adapter alone.")
    return {k: v for k, v in kwargs.items() if k not in PEFT_FORWARD_ARGS}


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


def grow(model: nn.Module, grown: dict[str, int], name: str) -> None:
    """Grow the vocabulary of the base (a view, or a copy to merge into) that one adapter loads over as the adapter's
    was before training (``grown``: :func:`~hf_wide.adapter_base.grown_tables`), as its user would with
    ``resize_token_embeddings`` before ``PeftModel.from_pretrained``: the member's tables are then its own (new ones:
    the base's are left as they are). Every table that grows must be one the adapter holds whole: the new rows of any
    other would be drawn at random."""
    if not grown:
        return
    if len(set(grown.values())) > 1:
        raise IncompatibleMembersError(f"{name} holds embedding tables of different numbers of rows: {grown}.")
    # transformers gives the grown table to the module's parameter (weight.data = ...), and a view's is the base's: a
    # parameter of its own first (``.data``: the base's values, a version counter of its own), tied ones tied still
    own = {}
    for module in embedding_tables(model):
        weight = module.weight
        module.weight = own.setdefault(id(weight), nn.Parameter(weight.data, requires_grad=weight.requires_grad))
    model.resize_token_embeddings(next(iter(grown.values())), mean_resizing=False)
    tables = {id(m.weight) for m in embedding_tables(model)}
    resized = {key for key, t in model.named_parameters() if id(t) in tables}
    if not resized <= grown.keys():
        raise IncompatibleMembersError(
            f"{name} grew the vocabulary but holds only {sorted(grown)} whole, not {sorted(resized - grown.keys())}: "
            "their new rows would be drawn at random.")


def is_base(folder, base_folder, base_id) -> bool:
    """Whether a member of the list is the adapters' base: the very folder the base was loaded from (its id at the
    base's revision, without a subfolder; or its folder under another name: ``base/``, a relative path, where the
    adapters name it by its absolute path), or the base's id itself (a saved ensemble names its base member so). The
    base's id at another revision or in a subfolder is a full checkpoint of its own (it was taken for the base, and
    member 0 came out the base at the adapters' revision: 0.54 off)."""
    if str(folder) == str(base_id):
        return True
    try:
        return os.path.samefile(folder, base_folder)
    except OSError:
        return False


@dataclasses.dataclass
class AdapterBase:
    """The one base a list of adapters loads over (:func:`load_adapter_base`): the model, its id, the revision the
    adapters name (or the caller gave), its folder, how errors name it, and its transformers class."""

    model: nn.Module
    model_id: str
    revision: str | None
    folder: str
    name: str
    klass: type


def load_adapter_base(ids, folders, configs, *, base_model=None, base_revision=None, merge=False, allow_pickle=False,
                      dtype=None, device=None, trust_remote_code=False, hub_kwargs=None,
                      model_kwargs=None) -> AdapterBase:
    """Check every adapter of the list (its weights, and what hf-wide cannot fuse unless merged), then download and
    load the base they name (or ``base_model`` at ``base_revision``), once."""
    from .download import MemberLoadError, download_members
    from .loading import load_member, weights_format

    require_peft()
    names = [f"member {i} ({model_id})" for i, model_id in enumerate(ids)]
    for name, folder, config in zip(names, folders, configs):
        if config is None:
            continue
        check_adapter_weights(Path(folder), name, allow_pickle)
        why = lora_refusal(config)
        if why is not None and not mergeable(config):  # (prompt tuning: merge_and_unload raised an AttributeError)
            cannot = ("it mixes its updates per input, which no merge into its base is" if config.get("peft_type")
                      in PER_INPUT else "PEFT cannot merge it into its base")
            raise NotImplementedError(f"{name} {why}, and {cannot} (merge=True): run it with PEFT alone.")
        if why is not None and not merge:
            raise NotImplementedError(f"{name} {why}. Pass merge=True to merge each adapter into its own copy of the "
                                      "base (checked against the adapter unmerged; N full weight sets).")
    if any(c and c.get("layer_replication") for c in configs):
        check_layer_replication([c.get("layer_replication") if c else None for c in configs], names)
    base_id = base_of(configs, names, base_model)
    base_revision = base_revision_of(configs, names, base_model, base_revision)
    try:
        (base_folder,) = download_members([base_id], base_revision, allow_pickle=allow_pickle,
                                          names=[f"The base model {base_id!r} of the adapters"], **(hub_kwargs or {}))
    except MemberLoadError:  # naming the base (it was "member 0 (...)")
        raise
    except OSError as exc:
        raise MemberLoadError(f"The base model {base_id!r} of the adapters could not be loaded: {exc}") from exc
    base_name = f"the base model ({base_id})"
    base_config = transformers.AutoConfig.from_pretrained(base_folder, trust_remote_code=trust_remote_code)
    klass = base_class(configs, base_config, base_name, base_folder, trust_remote_code)
    labels = head_labels([Path(f) for f in folders], configs, names)
    extra = {}
    if labels is not None and labels != base_config.num_labels:  # the adapters' heads replace the base's
        full = next((n for n, c in zip(names, configs) if c is None), None)
        if full is not None:
            raise IncompatibleMembersError(
                f"The adapters' saved heads have {labels} labels and {base_name}'s has {base_config.num_labels}: "
                f"{full}, a full checkpoint, cannot be a member beside them (over a head of {labels} labels, its own "
                "would be drawn at random).")
        # As PEFT's users load such a base (from_pretrained(base, num_labels=..., ignore_mismatched_sizes=True)): its
        # head drawn anew, and replaced in every member by the one its adapter saves (checked by load_member)
        extra = {"num_labels": labels, "ignore_mismatched_sizes": True}
    base = load_member(base_folder, base_name, dtype, device=device, klass=klass, trust_remote_code=trust_remote_code,
                       use_safetensors=weights_format(Path(base_folder), base_name, allow_pickle),
                       may_miss=held_by_every_adapter(folders, configs), **extra, **(model_kwargs or {}))
    return AdapterBase(base, base_id, base_revision, base_folder, base_name, klass)


def load_adapter_members(ids, folders, configs, *, base_model=None, base_revision=None, merge=False,
                         allow_pickle=False, dtype=None, device=None, trust_remote_code=False, hub_kwargs=None,
                         model_kwargs=None, trace_first=True, base: AdapterBase | None = None, first: int = 0,
                         desc: str = "Loading members"):
    """The members of a list that holds adapters, where they came from (:class:`AdapterSources`, for saving;
    None after ``merge`` or with full checkpoints other than the base), the paths of each member's no-ops
    (:func:`~hf_wide.adapter_layers.pad_targets`, :func:`~hf_wide.adapter_layers.pad_saved_modules`; None after
    ``merge``) and member 0's trace (:func:`~hf_wide.adapter_trace.trace_ahead`, for
    :func:`~hf_wide.fuse.fuse_models`' ``traced``; None where it was not taken, or not asked for: ``trace_first``, or
    member 0 has changed since). Each
    adapter is a ``PeftModel`` over a view of the one base (or, with ``merge``, merged into its own copy); each full
    checkpoint is loaded and, like the base when it is in the list, given zero LoRA layers. ``base``: the base,
    loaded already (:func:`load_adapter_base`, which otherwise runs here); ``first``: the index of ``ids[0]`` in the
    whole list, for names (a group of it: :mod:`hf_wide.adapter_groups`), and ``desc`` its progress bar's."""
    from .download import commit_sha
    from .loading import load_member, weights_format

    peft = require_peft()
    if base is None:
        base = load_adapter_base(ids, folders, configs, base_model=base_model, base_revision=base_revision,
                                 merge=merge, allow_pickle=allow_pickle, dtype=dtype, device=device,
                                 trust_remote_code=trust_remote_code, hub_kwargs=hub_kwargs, model_kwargs=model_kwargs)
    names = [f"member {i} ({model_id})" for i, model_id in enumerate(ids, first)]
    base_id, base_revision, base_folder, base_name, klass = (base.model_id, base.revision, base.folder, base.name,
                                                             base.klass)
    base = base.model
    models, ahead = [], None
    show_bar = len(ids) > 1 and transformers.utils.logging.is_progress_bar_enabled()
    for name, model_id, folder, config in hf_tqdm(list(zip(names, ids, folders, configs)), desc=desc,
                                                  unit="member", disable=not show_bar):
        if config is None:  # a full checkpoint: the base itself, or one of its architecture
            if is_base(folder, base_folder, base_id):
                models.append(shared_view(base))
            else:
                models.append(load_member(folder, name, dtype, device=device, klass=klass,
                                          trust_remote_code=trust_remote_code,
                                          use_safetensors=weights_format(folder, name, allow_pickle),
                                          **(model_kwargs or {})))
            continue
        target, copies = (copy.deepcopy(base), {}) if merge else adapter_view(
            base, config, held_base_tensors(adapter_keys(Path(folder)), base))
        with base_untouched(base, name):
            grow(target, grown_tables(Path(folder), base), name)
            try:
                with peft_quietly():
                    # Not low_cpu_mem_usage: over a half-precision base it rounds the adapter's weights to the base's
                    # dtype before PEFT upcasts them to float32 (PEFT 0.21), unlike PeftModel.from_pretrained(base,
                    # adapter)
                    member = peft.PeftModel.from_pretrained(target, str(folder), is_trainable=False)
            except Exception as exc:
                raise IncompatibleMembersError(
                    f"{name} does not load over {base_name}: {type(exc).__name__}: {exc}") from exc
            reshare(target, copies, name)
        models.append(merged(member, name) if merge else member.eval())
        if trace_first and len(models) == 1 and not merge and alike_structure(configs):
            ahead = trace_ahead(models[0])
    if merge:
        return models, None, None, None
    union, saved, dtype = adapter_structure(models)
    dora = dora_paths([m for m in models if isinstance(m, peft.PeftModel)])
    reference = next(m for m in models if isinstance(m, peft.PeftModel))
    padded = []
    for i, model in enumerate(models):
        if not isinstance(model, peft.PeftModel):  # a full member: the adapters' structure, with zero updates
            models[i] = as_adapter(model, reference)
        padded.append(pad_saved_modules(models[i], saved) + pad_targets(models[i], union, dtype, names[i], dora))
    stack_adapters(models)
    full = any(c is None and not is_base(f, base_folder, base_id) for c, f in zip(configs, folders))  # not the base
    # the commit the base was loaded at (a branch or a tag moves on), or the revision asked for, of a local folder
    sources = None if full else AdapterSources(base_id, commit_sha(Path(base_folder)) or base_revision, list(configs),
                                               padded)
    if ahead is not None and module_structure(models[0]) != ahead[2]:
        ahead = None  # member 0 has changed since (padded): the fusion traces it as it is now
    return models, sources, padded, None if ahead is None else ahead[:2]
