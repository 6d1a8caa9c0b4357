"""Fused repos on disk, and building a wide model from checkpoint files without holding N models.

A fused repo is one folder (or Hub repo) that ``WideModel.from_pretrained`` loads back as it was:

    config.json          the base model config plus an ``hf_wide`` section (see :func:`wide_config_section`)
    model.safetensors    every member's state dict, stacked: ``bert.encoder.layer.0.attention.self.query.weight``
                         of shape (N, D, D) holds member i's tensor at [i]. A tensor identical in all members is
                         stored once, without the member dim, and listed in ``hf_wide.shared``. Above
                         ``max_shard_size``: ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``.
    generation_config.json, tokenizer / processor files, README.md (the model card, :mod:`hf_wide.card`)

Tensors are keyed by the members' own (transformers) names, not by our wide layout, so the file does not depend
on which blocks or primitives hf-wide has: the plan is stored beside it and reapplied as it was.

Loading, in :mod:`hf_wide.fused_load` for fused repos and in :mod:`hf_wide.hub` for member repos, never
materialises N models (see :mod:`hf_wide.checkpoints`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Sequence
from itertools import chain
from pathlib import Path

import torch

from .checkpoints import WEIGHTS_INDEX_NAME, state_tensors
from .own_code import own_class, save_own_code
from .plan import Kind, ModulePlan, WidePlan
from .preprocessor_files import save_preprocessors
from .primitives import PerMemberFallback, VectorisedFallback

FORMAT_VERSION = 1
CONFIG_KEY = "hf_wide"
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Config fields kept out of a fused repo's per-member overrides: where a checkpoint came from (not carried
# over), and the labels (stored in ``hf_wide.labels``).
NOT_OVERRIDDEN = {"_name_or_path", "_commit_hash", "transformers_version", "id2label", "label2id"}


class FusedRepoError(ValueError):
    """A fused repo whose files do not agree with its ``hf_wide`` config section."""


# ---------------------------------------------------------------- the plan and config as data
def plan_to_dict(plan: WidePlan) -> dict:
    data = dataclasses.asdict(plan)
    for entry in data["entries"].values():
        entry["kind"] = Kind(entry["kind"]).value
    return data


def plan_from_dict(data: dict) -> WidePlan:
    entries = {fqn: ModulePlan(**{**e, "kind": Kind(e["kind"])}) for fqn, e in data["entries"].items()}
    return WidePlan(**{**data, "entries": entries})


def member_config(base, overrides: dict):
    """``base`` with a member's own fields (labels, provenance) set on a copy."""
    config = copy.deepcopy(base)
    for key, value in overrides.items():
        setattr(config, key, copy.deepcopy(value))
    return config


def config_differences(config, base) -> dict:
    """The attributes of a member's config that differ from member 0's, ``base`` (labels, provenance): what
    :func:`member_config` sets."""
    ours, theirs = vars(config), vars(base)
    return {k: v for k, v in ours.items() if k not in theirs or theirs[k] != v}


def config_overrides(config, base) -> dict:
    """The fields of ``config`` that differ from ``base``, leaving out labels and provenance."""
    a, b = config.to_dict(), base.to_dict()
    return {k: v for k, v in a.items() if k not in NOT_OVERRIDDEN and b.get(k) != v}


def generation_overrides(configs: Sequence | None) -> list[dict] | None:
    """The settings of each member's generation config that differ from member 0's (None without configs)."""
    if not configs or any(c is None for c in configs):
        return None
    base = configs[0].to_dict()
    return [{k: v for k, v in c.to_dict().items() if base.get(k) != v} for c in configs]


def wide_config_section(wide, shared: Sequence[str]) -> dict:
    """The ``hf_wide`` section of a fused repo's config.json."""
    configs = wide.member_configs or [wide.config] * wide.num_members
    return {
        "format_version": FORMAT_VERSION,
        "num_members": wide.num_members,
        "member_ids": list(wide.member_ids),
        "member_revisions": list(wide.member_revisions),
        **({"member_subfolders": list(wide.member_subfolders)} if wide.member_subfolders else {}),
        "labels": [{str(k): v for k, v in (c.id2label or {}).items()} for c in configs],
        "member_config_overrides": [config_overrides(c, configs[0]) for c in configs],
        # generation_config.json is member 0's; each member's own settings beside it (its max_new_tokens, say)
        "member_generation_overrides": generation_overrides(wide.member_generation_configs),
        "shared": sorted(shared),
        "plan": plan_to_dict(dataclasses.replace(wide.plan, num_members=wide.num_members)),
        # What the fallbacks' trace and first calls (fusion's verification) taught them about their inputs: loaded
        # back, a module called first at other sizes than the sample's still tells a table from the folded rows.
        "input_roles": {path: dict(m.input_roles) for path, m in wide.model.named_modules()
                        if isinstance(m, (VectorisedFallback, PerMemberFallback)) and m.input_roles},
    }


def read_section(folder: str | Path) -> dict | None:
    """The ``hf_wide`` section of ``folder/config.json``: a dict for a fused repo, else None."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return None
    section = json.loads(path.read_text()).get(CONFIG_KEY)
    if section is not None and section.get("format_version", 0) > FORMAT_VERSION:
        raise FusedRepoError(f"{folder} was saved by a newer hf-wide (format {section['format_version']}, this "
                             f"one reads up to {FORMAT_VERSION}): upgrade hf-wide.")
    return section


def saved_dtype(folder: str | Path) -> str | None:
    """The dtype ``folder/config.json`` was saved in (transformers' ``dtype``, or ``torch_dtype`` before it)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return config.get("dtype", config.get("torch_dtype"))


def model_class_for(config, name: str, folder: str | Path | None = None, trust_remote_code: bool = False,
                    like: type | None = None) -> type:
    """The transformers class a config names in ``architectures``; or, with ``trust_remote_code``, the checkpoint's
    own class in ``folder`` (:func:`hf_wide.own_code.own_class`; ``like``: another member's class, taken where this one
    is the same code)."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if hasattr(transformers, arch):
            return getattr(transformers, arch)
    klass = own_class(config, name, folder, trust_remote_code, like)
    if klass is not None:
        return klass
    remote = " (its own code, by the config's auto_map, which names no class of these architectures)" if getattr(
        config, "auto_map", None) else ""
    raise ValueError(
        f"{name}: config.architectures is {architectures!r}, which names no transformers class{remote}; "
        "load the models yourself and use WideModel.from_models."
    )


# ---------------------------------------------------------------- saving a fused repo
def save_wide(wide, save_directory: str | Path, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
              tokenizer=None, processor=None, repo_id: str | None = None, overwrite_readme: bool = False) -> Path:
    """Write ``wide`` as one fused repo in ``save_directory`` (see the module docstring). An existing README.md
    there is kept unless ``overwrite_readme``. Returns the folder."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from .card import model_card

    if wide.config is None:
        raise TypeError("Only transformers models (with a config) can be saved as a fused repo; "
                        "save plain modules with torch.save(wide.state_dict()).")
    refuse_peft_without_sources(wide)
    if wide.members_group is not None and getattr(wide, "adapter_sources", None) is not None:
        raise NotImplementedError("Saving adapters loaded member-parallel is not supported: save the adapters "
                                  "themselves (each rank's PeftModel members), or load them in one process.")
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    earlier = read_section(directory)  # a fused repo saved here before (its section): this one replaces it
    if getattr(wide, "adapter_sources", None) is not None:  # adapters of one base: the base referenced
        from .adapter_repos import save_adapter_ensemble

        section = {k: v for k, v in wide_config_section(wide, []).items() if k in (
            "format_version", "num_members", "member_ids", "member_revisions", "member_subfolders", "plan")}
        if earlier is not None:
            _clear_earlier(directory, earlier)
        save_adapter_ensemble(wide, directory, section, repo_id, overwrite_readme)
        save_preprocessors(wide, directory, tokenizer, processor, earlier is not None)
        return directory
    group = wide.members_group  # member-parallel: every rank stacks its members, rank 0 writes (hf_wide.parallel)
    local = range(wide.num_members) if group is None else group.local
    states = [state_tensors(wide.member(i, share=True)) for i in local]  # views, no copies
    shared = [k for k, t in states[0].items() if all(_identical(t, s[k]) for s in states[1:])]
    if group is not None:
        from .parallel import agree_to_save

        shared = agree_to_save(group, wide.plan, states[0], shared)
    writes = group is None or group.rank == 0
    # Plan the shards on meta tensors of the stored shapes, then stack one shard at a time.
    stored = {k: torch.empty(t.shape if k in shared else (wide.num_members, *t.shape), dtype=t.dtype, device="meta")
              for k, t in states[0].items()}
    split = split_torch_state_dict_into_shards(stored, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    if writes and earlier is not None:
        _clear_earlier(directory, earlier)
    elif writes:
        for old in chain(directory.glob("model*.safetensors"), directory.glob(WEIGHTS_INDEX_NAME)):
            old.unlink()
    for filename, keys in split.filename_to_tensors.items():
        tensors = {}
        for k in keys:  # (every rank takes part in each gather; only the writer keeps the shard)
            value = states[0][k].detach().clone() if k in shared else _stacked(group, [s[k] for s in states])
            if writes:
                tensors[k] = value
        if group is None:
            save_file(tensors, str(directory / filename), metadata={"format": "pt"})
        else:  # a failure to write on rank 0 raises on every rank, rather than leave them in the next gather
            from .parallel import on_every_rank

            on_every_rank(group, lambda: save_file(tensors, str(directory / filename), metadata={"format": "pt"})
                              if writes else None, f"Writing {filename}")
        tensors.clear()  # this shard's stacked tensors freed before the next is stacked
    if not writes:
        return directory
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    _save_config(wide, directory, shared)
    save_own_code(_member_class(wide.model), directory)
    generation_config = (wide.member_generation_configs or [None])[0]
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    save_preprocessors(wide, directory, tokenizer, processor, earlier is not None)
    readme = directory / "README.md"
    if overwrite_readme or not readme.exists():
        readme.write_text(model_card(wide, repo_id))
    return directory


def _clear_earlier(directory: Path, section: dict) -> None:
    """The files of the earlier fused repo in ``directory`` (its config's ``section``) that the one saved now
    replaces: its weights, its generation config and, where it was an ensemble of adapters, the adapter folders it
    wrote (a fused repo of adapters saved over one of full members kept its model.safetensors beside the adapters, and
    the other way round). Nothing else: a folder of the user's own there (``save_members("./members")``) stays."""
    from .adapter_repos import MEMBERS_DIR

    for old in chain(directory.glob("model*.safetensors"), directory.glob(WEIGHTS_INDEX_NAME),
                     directory.glob("generation_config.json")):
        old.unlink()
    if "adapters" in section:
        for i in range(section.get("num_members", 0)):
            shutil.rmtree(directory / MEMBERS_DIR / f"member-{i}", ignore_errors=True)
        if (directory / MEMBERS_DIR).is_dir() and not any((directory / MEMBERS_DIR).iterdir()):
            (directory / MEMBERS_DIR).rmdir()


def _member_class(root) -> type:
    """The members' class, where the root is a fallback of hf-wide's (whose class is not the members')."""
    if hasattr(root, "proto"):  # a vectorised fallback: the members' code, on the meta device
        return type(root.proto)
    members = getattr(root, "members", None)  # a per-member fallback: the members' own modules
    return type(members[0]) if isinstance(members, torch.nn.ModuleList) else type(root)


def _stacked(group, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``(N, ...)``: the members' tensors stacked; a member-parallel rank's, gathered from every rank."""
    stacked = torch.stack([t.detach() for t in tensors])
    if group is None:
        return stacked
    from .parallel_calls import gather_members

    return gather_members(group, stacked)


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _save_config(wide, directory: Path, shared: Sequence[str]) -> None:
    """config.json: member 0's config (architectures and dtype as stored) plus the ``hf_wide`` section."""
    base = copy.deepcopy((wide.member_configs or [wide.config])[0])
    base.architectures = [wide.plan.model_class]
    floating = [p.dtype for p in wide.parameters() if p.dtype.is_floating_point]
    if floating:
        base.dtype = floating[0]
    base.save_pretrained(directory)
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data[CONFIG_KEY] = wide_config_section(wide, shared)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def peft_without_sources(wide) -> bool:
    """Whether ``wide``'s members are PEFT models not all loaded as adapters of one base (``from_models``, or full
    checkpoints among the adapters), which have no repo layout to save to: neither a transformers class nor an
    adapter each."""
    return getattr(wide.model, "peft_config", None) is not None and getattr(wide, "adapter_sources", None) is None


def refuse_peft_without_sources(wide) -> None:
    """Refuse to save members of :func:`peft_without_sources`."""
    if peft_without_sources(wide):
        raise NotImplementedError(
            "hf-wide cannot save this wide model: its members are PEFT models not all loaded as adapters of one base "
            "(from_models, or full checkpoints among the adapters). Save each member with wide.member(i).")
