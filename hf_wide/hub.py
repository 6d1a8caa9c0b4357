"""From the Hub: N member ids (Hub repos or local folders), fetched (:mod:`hf_wide.download`), loaded as one wide
model. Remote code never runs unless asked for. Uploads (``push_to_hub``, ``push_members``) are in
:mod:`hf_wide.export`.

:func:`load_wide` picks the way to load what was fetched: a fused repo (:mod:`hf_wide.saving`), PEFT adapters
(:mod:`hf_wide.adapters`), or member checkpoints (:mod:`hf_wide.loading`, which keeps memory low).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch

from . import plan_cache
from .adapter_repos import adapter_folders
from .adapters import adapter_config, load_adapter_members
from .compat import refuse_unfused_attention
from .download import (MemberLoadError, as_ids, check_hub_kwargs, commit_sha, download_members, member_name,
                       per_member, subfolders_of)
from .fuse import fuse_models, needs_verifying, uses_saved_plan
from .loading import load_models, load_streaming, verified, weights_format
from .placement import resolve_device, resolve_dtype
from .fused_load import load_fused
from .saving import plan_from_dict, read_section, saved_dtype
from .samples import sample_inputs


# ---------------------------------------------------------------- loading a wide model
def load_wide(
    cls,
    model_ids: Sequence[str] | str,
    revision: str | Sequence[str | None] | None = None,
    *,
    subfolder: str | Sequence[str | None] | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
    torch_dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    allow_label_mismatch: bool = False,
    share_identical: bool | None = None,
    validate: bool = False,
    verify: bool = True,
    base_model: str | None = None,
    base_revision: str | None = None,
    merge: bool = False,
    member_parallel: bool = False,
    **hub_kwargs,
):
    """``cls.from_pretrained``: one fused repo (its config.json has an ``hf_wide`` section), or N member
    checkpoints fused here, or PEFT adapters over one base (:mod:`hf_wide.adapters`: ``base_model`` and
    ``base_revision`` override the base the adapters name; ``merge`` merges each into its own copy of the base).
    ``member_parallel``: this rank of a ``torch.distributed`` job loads and fuses only its slice of the members
    (:mod:`hf_wide.parallel`). ``attn_implementation`` ("eager", "sdpa", ...) as in transformers' ``from_pretrained``:
    the members are traced, fused and verified with it. ``torch_dtype``: ``dtype``'s older name, which transformers
    still takes (``dtype`` wins where both are given). See :func:`download_members` for ``subfolder`` and
    ``hub_kwargs``."""
    hub_kwargs = check_hub_kwargs(hub_kwargs)
    dtype = dtype if dtype is not None else torch_dtype
    unshared = share_identical is False  # asked for: a fused repo that shares a module cannot give it
    # A rank cannot see whether other ranks' members hold the same tensor: member-parallel ranks keep each member's
    # own (so that every rank fuses its slice the same way), unless asked to share within the rank.
    share_identical = not member_parallel if share_identical is None else share_identical
    if member_parallel:  # this same loading, of the rank's slice of the members (every option passed on)
        from .parallel import load_member_slice

        options = dict(dtype=dtype, device=device, device_map=device_map, attn_implementation=attn_implementation,
                       allow_pickle=allow_pickle,
                       trust_remote_code=trust_remote_code, allow_label_mismatch=allow_label_mismatch,
                       share_identical=share_identical, validate=validate, verify=verify, base_model=base_model,
                       base_revision=base_revision, merge=merge, **hub_kwargs)
        return load_member_slice(*_slice_loader(cls, model_ids, revision, subfolder, options), allow_label_mismatch)
    ids = as_ids(model_ids)
    if not ids:
        raise ValueError("WideModel.from_pretrained needs at least one model id; got an empty list.")
    refuse_unfused_attention(attn_implementation)  # before anything downloads
    torch_dtype, device = resolve_dtype(dtype), resolve_device(device, device_map)
    model_kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    subfolders = subfolders_of(subfolder, len(ids))
    folders = download_members(ids, revision, subfolder=subfolders, allow_pickle=allow_pickle, **hub_kwargs)
    names = [member_name(i, model_id, sub) for i, (model_id, sub) in enumerate(zip(ids, subfolders))]
    fused = [name for name, folder in zip(names, folders) if read_section(folder) is not None]
    adapters = [adapter_config(folder) for folder in folders]
    saved = read_section(folders[0]) if len(ids) == 1 and fused else None
    fuse = dict(validate=validate, allow_label_mismatch=allow_label_mismatch, share_identical=share_identical,
                verify=verify)
    load = dict(base_model=base_model, base_revision=base_revision, merge=merge, allow_pickle=allow_pickle,
                dtype=torch_dtype, device=device, trust_remote_code=trust_remote_code, hub_kwargs=hub_kwargs,
                model_kwargs=model_kwargs)
    validated = True  # by the fusion (given validate=), against the members loaded as models
    if saved is not None and "adapters" in saved:  # a saved ensemble of adapters: its base, then its adapters
        wide = _fuse_adapter_list(cls, ids, folders, adapters, saved, load, fuse)
    elif fused:
        if len(ids) > 1:
            raise ValueError(f"{fused[0]} is a fused hf-wide repo: load it on its own, not as a member.")
        _refuse_fused_options(ids[0], saved, base_model, base_revision, merge, unshared)
        wide = load_fused(cls, folders[0], name=ids[0], dtype=torch_dtype, device=device,
                          trust_remote_code=trust_remote_code, **model_kwargs)
        validated = False
    elif any(adapters):
        wide = _fuse_adapter_list(cls, ids, folders, adapters, None, load, fuse)
    else:
        if base_model is not None or base_revision is not None or merge:
            raise ValueError("base_model=, base_revision= and merge= apply to PEFT adapters; none of the members is one.")
        wide, validated = _fuse_checkpoints(cls, ids, folders, names, load, fuse)
    if any(subfolders) and not fused:  # (a fused repo's members are its own: it names their subfolders itself)
        wide.member_subfolders = subfolders
    if validate and not validated:
        members = [wide.member(i) for i in range(wide.num_members)]
        wide.validate(members, (), sample_inputs(members[0]))
    return wide


def _refuse_fused_options(name: str, saved: dict, base_model, base_revision, merge: bool, unshared: bool) -> None:
    """Refuse the options a fused repo of full members cannot take (they were dropped)."""
    if base_model is not None or base_revision is not None or merge:
        raise ValueError(f"base_model=, base_revision= and merge= apply to PEFT adapters; {name} is a fused repo of "
                         "full members.")
    # (its modules held once; not its tensors stored once, which a plan of stacked modules has where members agree)
    shared = [fqn for fqn, entry in saved.get("plan", {}).get("entries", {}).items() if entry["kind"] == "shared"]
    if unshared and shared:
        raise ValueError(f"{name} holds {shared[:3]}{'...' if len(shared) > 3 else ''} once for all its members (it "
                         "was fused with share_identical=True), and its plan cannot be made again without the "
                         "members: fuse them with share_identical=False to train each member's own copy.")


def _fuse_adapter_list(cls, ids, folders, adapters, saved: dict | None, load: dict, fuse: dict):
    """The wide model of a list that holds PEFT adapters (:mod:`hf_wide.adapter_groups`; ``load`` and ``fuse``: its
    options), or of the saved ensemble of adapters in ``folders[0]``, whose config section is ``saved``: the base it
    names (unless ``load`` names another), then its adapters."""
    from .adapter_groups import fuse_adapters

    if saved is not None:
        member_folders, adapters = adapter_folders(folders[0], saved)
        sources = saved["adapters"]
        ids, revisions, source_dirs = saved["member_ids"], saved["member_revisions"], [folders[0]]
        load = {**load, "base_model": load["base_model"] or sources["base_model"],
                "base_revision": load["base_revision"] or sources["base_revision"]}
        if load["dtype"] in (None, "auto"):  # as it was saved (a bfloat16 ensemble of a float32 base: float32)
            load["dtype"] = resolve_dtype(saved_dtype(folders[0])) or load["dtype"]
    else:
        member_folders, revisions, source_dirs = folders, [commit_sha(folder) for folder in folders], folders
    # (fused with copy_shared=False: our own members, whose base's tensors become the wide model's)
    plan = plan_from_dict(saved["plan"]) if saved is not None and "plan" in saved else None  # (older saves: none)
    wide, sources, padded = fuse_adapters(cls, ids, member_folders, adapters, load=load, fuse=fuse, saved_plan=plan)
    wide.adapter_sources, wide._source_dirs = sources, source_dirs
    if not load["merge"]:  # (merged, every member is a plain model already)
        wide.full_members = frozenset(i for i, config in enumerate(adapters) if config is None)
        wide.padded_targets = padded
    wide.member_revisions = list(revisions)
    if saved is not None and saved.get("member_subfolders"):
        wide.member_subfolders = saved["member_subfolders"]
    return wide


def _fuse_checkpoints(cls, ids, folders, names, load: dict, fuse: dict):
    """The wide model of N full checkpoints, and whether it was validated against the members: streamed from their
    safetensors files where it can be (:func:`~hf_wide.loading.load_streaming`, then verified), else the members
    loaded as models and fused (pickle weights, or tensor names that transformers converts on load)."""
    wide = None
    for folder, name in zip(folders, names):  # (transformers' "Unrecognized model" named neither)
        if not (Path(folder) / "config.json").is_file():
            raise MemberLoadError(f"{name}: there is no config.json in {folder}: a member is a transformers "
                                  "checkpoint (config.json and its weights) or a PEFT adapter (adapter_config.json).")
    if all(weights_format(folder, name, load["allow_pickle"]) for folder, name in zip(folders, names)):
        wide = load_streaming(cls, ids, folders, names, load["dtype"], load["device"], load["trust_remote_code"],
                              fuse["allow_label_mismatch"], fuse["share_identical"], load["model_kwargs"],
                              cached=fuse["verify"])  # (a plan is never used unchecked)
        key, traced = (None, True) if wide is None else wide.__dict__.pop("_plan_cache")
        if wide is not None and (fuse["verify"] or needs_verifying(wide.plan.trace_method, wide.plan.model_class)):
            streamed, wide = wide, verified(wide, fuse["share_identical"])
            if key is not None and (traced or wide is not streamed):  # kept for the next load: a plan verified
                plan_cache.store_plan(key, wide.plan)
    validated = wide is None
    if wide is None:
        models = load_models(ids, folders, load["dtype"], load["device"], load["allow_pickle"],
                             load["trust_remote_code"], **load["model_kwargs"])
        wide = _fuse_loaded(cls, models, ids, fuse)
        wide._source_dirs = folders
    wide.member_revisions = [commit_sha(folder) for folder in folders]
    return wide, validated


def _fuse_loaded(cls, models: list, ids: list[str], fuse: dict):
    """``cls.from_models(models, ...)`` of members loaded whole, by the plan a load of the same list was fused by
    (:func:`hf_wide.plan_cache.models_key`), verified, where one is cached; else traced, and its plan kept."""
    key = plan_cache.models_key(models, {k: fuse[k] for k in ("share_identical", "allow_label_mismatch")}) if (
        uses_saved_plan(fuse["verify"], fuse["share_identical"]) and plan_cache.enabled()) else None
    known = None if key is None else plan_cache.load_plan(key)
    wide = fuse_models(cls, models, member_ids=ids, saved_plan=known, **fuse)
    if key is not None and wide.plan is not known:  # traced (none was cached, or it was not these members')
        plan_cache.store_plan(key, wide.plan)
    return wide


def _slice_loader(cls, model_ids, revision, subfolder, options: dict):
    """(N, load(members) -> the wide model of those members) for a member-parallel rank: member repos, each
    rank loading its own; or one fused repo, which every rank downloads and reads its members' bytes from."""
    ids = as_ids(model_ids)
    if len(ids) > 1:
        revisions, subfolders = per_member(revision, len(ids)), per_member(subfolder, len(ids), "subfolder")
        return len(ids), lambda members: load_wide(
            cls, ids[members.start:members.stop], revisions[members.start:members.stop],
            subfolder=subfolders[members.start:members.stop], **options)
    hub_kwargs = {k: v for k, v in options.items() if k not in inspect.signature(load_wide).parameters}
    folder = download_members(ids, revision, subfolder=subfolder, allow_pickle=options["allow_pickle"],
                              **hub_kwargs)[0]
    section = read_section(folder)
    if section is None or "adapters" in section:
        what = "a saved ensemble of adapters" if section else "one checkpoint"
        raise ValueError(f"member_parallel=True splits members over the ranks, and {ids[0]} is {what}: pass the "
                         "members' own ids, or a fused repo of full members.")
    dtype, device = resolve_dtype(options["dtype"]), resolve_device(options["device"], options["device_map"])
    implementation = {} if options["attn_implementation"] is None else {
        "attn_implementation": options["attn_implementation"]}
    return section["num_members"], lambda members: load_fused(
        cls, folder, name=ids[0], dtype=dtype, device=device, members=members,
        trust_remote_code=options["trust_remote_code"], **implementation)


def load_members(
    model_ids: Sequence[str],
    revision: str | Sequence[str | None] | None = None,
    *,
    subfolder: str | Sequence[str | None] | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    **hub_kwargs,
) -> tuple[list[torch.nn.Module], list[str], list[str | None]]:
    """Load every member with its own transformers class, or, where the list holds PEFT adapters, as
    ``from_pretrained`` loads them (``PeftModel`` members over their one base: :mod:`hf_wide.adapters`). Returns the
    models, their ids, and the commit sha each was loaded at (None for local folders)."""
    model_ids, hub_kwargs = list(model_ids), check_hub_kwargs(hub_kwargs, "load_members")
    if not model_ids:
        raise ValueError("WideModel.from_pretrained needs at least one model id; got an empty list.")
    folders = download_members(model_ids, revision, subfolder=subfolder, allow_pickle=allow_pickle, **hub_kwargs)
    adapters = [adapter_config(folder) for folder in folders]
    if any(adapters):
        models = load_adapter_members(model_ids, folders, adapters, allow_pickle=allow_pickle, device=device,
                                      dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code,
                                      hub_kwargs=hub_kwargs, trace_first=False)[0]  # (its caller traces: no trace ahead)
    else:
        models = load_models(model_ids, folders, resolve_dtype(dtype), device, allow_pickle, trust_remote_code)
    return models, model_ids, [commit_sha(folder) for folder in folders]
