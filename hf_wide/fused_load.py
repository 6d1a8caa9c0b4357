"""A fused repo (:mod:`hf_wide.saving`) loaded back as a wide model, without tracing and without holding N models:
the stored plan is reapplied to one skeleton per member, and each tensor is read into its stacked place
(:func:`hf_wide.checkpoints.assemble`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from .checkpoints import Checkpoint, assemble, empty_model, skeleton_like, state_tensors
from .planner import batch_statistics, tensor_aliases
from .saving import CONFIG_KEY, FusedRepoError, member_config, model_class_for, plan_from_dict, read_section

logger = logging.getLogger(__name__)
# the section's lists of one entry per member (the last two only where they were written)
PER_MEMBER = ("member_ids", "labels", "member_config_overrides", "member_revisions", "member_generation_overrides",
              "member_subfolders")


def load_fused(cls, folder: str | Path, *, name: str, dtype: torch.dtype | str | None = None, device=None,
               members: range | None = None, trust_remote_code: bool = False, **model_kwargs):
    """A fused repo folder back as a ``cls`` (WideModel), without tracing: the stored plan is reapplied. With
    ``members`` (a member-parallel rank's slice), only those members, and only their bytes are read."""
    import transformers
    from transformers import GenerationConfig

    folder = Path(folder)
    section = read_section(folder)
    _check_section(section, name)
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    delattr(config, CONFIG_KEY)
    n = section["num_members"]
    members = range(n) if members is None else members
    torch_dtype = config.dtype if dtype in (None, "auto") else dtype
    klass = model_class_for(config, name, folder, trust_remote_code)
    template = empty_model(klass, config, torch_dtype, **model_kwargs)
    generation_config = getattr(template, "generation_config", None)
    if generation_config is not None and (folder / "generation_config.json").exists():
        generation_config = GenerationConfig.from_pretrained(folder)
    configs = []
    for i in members:
        labels = {int(k): v for k, v in section["labels"][i].items()}
        configs.append(member_config(template.config, {**section["member_config_overrides"][i], "id2label": labels,
                                                       "label2id": {v: k for k, v in labels.items()},
                                                       "_name_or_path": section["member_ids"][i]}))
    overrides = section.get("member_generation_overrides") or [{}] * n  # (absent before 2026-11-27)
    generation_configs = [None if generation_config is None else member_config(generation_config, overrides[i])
                          for i in members]
    skeletons = [skeleton_like(template, c, copy.deepcopy(g)) for c, g in zip(configs, generation_configs)]
    shared = set(section["shared"])
    with Checkpoint(folder) as ckpt:
        keys = _check_layout(ckpt, template, shared, n, name)
        read_for: dict[str, set[int]] = {}  # stored key -> the members whose slice of it was read

        def read(i: int, key: str, dst: torch.Tensor) -> None:
            read_for.setdefault(keys[key], set()).add(i)
            ckpt.read_into(keys[key], dst, None if keys[key] in shared else members[i])

        try:
            plan = _unshare_batch_statistics(plan_from_dict(section["plan"]), template)
            plan = dataclasses.replace(plan, num_members=len(members))
            model, fold, aliases = assemble(skeletons, plan, device, read)
        except (KeyError, AttributeError) as exc:  # a module the plan names that the model lacks
            raise FusedRepoError(f"{name}: the fused repo's plan does not fit {type(template).__name__} "
                                 f"({type(exc).__name__}: {exc}): its config.json was edited, or is another "
                                 "model's.") from exc
        # Each member's slice of every stacked tensor is read into its place; a module the plan holds once (an entry
        # edited out of it) read member 0's alone, and ran it for every member
        unread = sorted(k for k in set(keys.values()) - shared if len(read_for.get(k, ())) < len(members))
        if unread:
            raise FusedRepoError(f"{name}: the fused repo stores {unread[:3]}{'...' if len(unread) > 3 else ''} for "
                                 "each member, but its plan holds them once: its config.json does not match its "
                                 "weights.")
    roles = section.get("input_roles", section.get("vectorised_roles", {}))  # (the vectorised modules' alone before
    for path, known in roles.items():  # 2026-11-27; neither before 2026-11-24)
        model.get_submodule(path).input_roles.update(known)
    wide = cls(model, plan, fold, aliases, [section["member_ids"][i] for i in members], configs, generation_configs)
    wide.member_revisions = [section["member_revisions"][i] for i in members]
    if section.get("member_subfolders"):  # (where the members were given by subfolder)
        wide.member_subfolders = [section["member_subfolders"][i] for i in members]
    wide._source_dirs = [folder]
    return wide.eval()


def _unshare_batch_statistics(plan, template: nn.Module):
    """``plan`` with each BatchNorm it holds once (saved before 2026-11-30) made each member's own, as the planner
    makes it now (:func:`hf_wide.planner.batch_statistics`): in training, held once, it read every member's rows. Its
    tensors, stored once, are read into every member's place."""
    from .plan import Kind
    from .registry import find_wide

    entries = dict(plan.entries)
    for fqn, entry in plan.entries.items():
        module = template.get_submodule(fqn) if entry.kind == Kind.SHARED else None
        wide_class = None if module is None or not batch_statistics(module) else find_wide(type(module))
        if wide_class is not None:
            entries[fqn] = dataclasses.replace(entry, kind=Kind.PRIMITIVE, wide_class=wide_class.__name__, reason="")
    return dataclasses.replace(plan, entries=entries)


def _check_section(section: dict, name: str) -> None:
    """Refuse an ``hf_wide`` section with a field missing, or a list of another length than the members."""
    missing = [k for k in ("num_members", "plan", "shared", *PER_MEMBER[:4]) if k not in section]
    if missing:
        raise FusedRepoError(f"{name}: config.json's hf_wide section has no {', '.join(missing)}: it was edited, or "
                             "was not written by hf-wide.")
    n = section["num_members"]
    for key in PER_MEMBER:
        if section.get(key) is not None and len(section[key]) != n:
            raise FusedRepoError(f"{name}: config.json's hf_wide section holds {len(section[key])} {key} for its "
                                 f"{n} members: it was edited.")


def _check_layout(ckpt: Checkpoint, template: nn.Module, shared: set[str], n: int, name: str) -> dict[str, str]:
    """Map every state-dict name of the template (tied tensors' every name) to its key in the fused file,
    checking the stored shapes; a stored tensor the template has no place for is logged, as transformers logs
    unexpected keys."""
    aliases = tensor_aliases(template)
    keys = {}
    for key, t in state_tensors(template).items():
        found = next((a for a in aliases.get(key, [key]) if a in ckpt), None)
        if found is None:
            raise FusedRepoError(f"{name}: the fused repo has no tensor {key!r}, which {type(template).__name__} has.")
        expected = tuple(t.shape) if found in shared else (n, *t.shape)
        if ckpt.shape(found) != expected:
            raise FusedRepoError(f"{name}: the fused repo stores {found!r} with shape {ckpt.shape(found)}, but "
                                 f"{n} members of {type(template).__name__} need {expected}.")
        keys.update(dict.fromkeys(aliases.get(key, [key]), found))  # every name of a tied tensor
    unexpected = sorted(set(ckpt.entries) - set(keys.values()))
    if unexpected:
        logger.warning("%s: the fused repo stores tensors %s that %s has no place for; they are not loaded.", name,
                       unexpected[:5], type(template).__name__)
    return keys
