"""A fused repo (:mod:`hf_wide.saving`) loaded back as a wide model, without tracing and without holding N models:
the stored plan is reapplied to one skeleton per member, and each tensor is read into its stacked place
(:func:`hf_wide.checkpoints.assemble`).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from .checkpoints import Checkpoint, assemble, empty_model, skeleton_like, state_tensors
from .planner import tensor_aliases
from .saving import CONFIG_KEY, FusedRepoError, member_config, model_class_for, plan_from_dict, read_section


def load_fused(cls, folder: str | Path, *, name: str, dtype: torch.dtype | str | None = None, device=None,
               members: range | None = None, **model_kwargs):
    """A fused repo folder back as a ``cls`` (WideModel), without tracing: the stored plan is reapplied. With
    ``members`` (a member-parallel rank's slice), only those members, and only their bytes are read."""
    import transformers
    from transformers import GenerationConfig

    folder = Path(folder)
    section = read_section(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    delattr(config, CONFIG_KEY)
    n = section["num_members"]
    members = range(n) if members is None else members
    torch_dtype = config.dtype if dtype in (None, "auto") else dtype
    template = empty_model(model_class_for(config, name), config, torch_dtype, **model_kwargs)
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

        def read(i: int, key: str, dst: torch.Tensor) -> None:
            ckpt.read_into(keys[key], dst, None if keys[key] in shared else members[i])

        plan = dataclasses.replace(plan_from_dict(section["plan"]), num_members=len(members))
        model, fold, aliases = assemble(skeletons, plan, device, read)
    roles = section.get("input_roles", section.get("vectorised_roles", {}))  # (the vectorised modules' alone before
    for path, known in roles.items():  # 2026-11-27; neither before 2026-11-24)
        model.get_submodule(path).input_roles.update(known)
    wide = cls(model, plan, fold, aliases, [section["member_ids"][i] for i in members], configs, generation_configs)
    wide.member_revisions = [section["member_revisions"][i] for i in members]
    if section.get("member_subfolders"):  # (where the members were given by subfolder)
        wide.member_subfolders = [section["member_subfolders"][i] for i in members]
    wide._source_dirs = [folder]
    return wide.eval()


def _check_layout(ckpt: Checkpoint, template: nn.Module, shared: set[str], n: int, name: str) -> dict[str, str]:
    """Map every state-dict name of the template (tied tensors' every name) to its key in the fused file,
    checking the stored shapes."""
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
    return keys
