"""From the Hub: resolve N member ids (Hub repos or local folders) and load them as one wide model.

Downloads go through the real ``huggingface_hub`` client, in parallel across members under one progress bar;
weights are safetensors unless pickle is explicitly allowed, and remote code never runs unless asked for.
Uploads (``push_to_hub``, ``push_members``) are in :mod:`hf_wide.export`.

:func:`load_wide` picks the way to load what was fetched: a fused repo (:mod:`hf_wide.saving`), PEFT adapters
(:mod:`hf_wide.adapters`), or member checkpoints (:mod:`hf_wide.loading`, which keeps memory low).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from huggingface_hub import list_repo_files, snapshot_download
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import tqdm as hf_tqdm

from .adapter_repos import adapter_folders
from .adapters import adapter_config, load_adapter_members
from .fuse import needs_verifying
from .loading import load_models, load_streaming, resolve_device, resolve_dtype, verified, weights_format
from .saving import load_fused, read_section
from .samples import sample_inputs


class MemberLoadError(OSError):
    """A member could not be fetched or read; the message names the member, and ``__cause__`` holds the
    ``huggingface_hub`` error (``RepositoryNotFoundError``, ``RevisionNotFoundError``, ...)."""


SAFETENSORS_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json"]
# Config, tokenizer, processor and chat-template files: small, and what a pipeline needs besides the weights.
META_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]

class _QuietTqdm(hf_tqdm):
    """snapshot_download's own bars (files, bytes), switched off: all members share one bar."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def per_member(value: str | Sequence[str | None] | None, n: int, what: str = "revision") -> list[str | None]:
    """One ``value`` (a revision, a subfolder) for every member, or one per member."""
    if value is None or isinstance(value, str):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"Got {len(values)} {what}s for {n} members: give one {what}, or one per member.")
    return values


# What download_members hands to huggingface_hub's snapshot_download, besides the revision and patterns.
HUB_KWARGS = frozenset({"token", "cache_dir", "local_files_only", "force_download", "max_workers", "endpoint",
                        "etag_timeout", "headers", "tqdm_class"})


def check_hub_kwargs(hub_kwargs: dict, caller: str = "WideModel.from_pretrained") -> None:
    """A ``TypeError`` naming any keyword argument that is not an option: with local folders nothing else would
    read it, and a misspelt option would be silently ignored."""
    unknown = sorted(set(hub_kwargs) - HUB_KWARGS)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""))


def download_members(
    model_ids: Sequence[str],
    revision: str | Sequence[str | None] | None = None,
    *,
    subfolder: str | Sequence[str | None] | None = None,
    allow_pickle: bool = False,
    max_workers: int = 8,
    **hub_kwargs,
) -> list[Path]:
    """Local folders for every member: existing directories as they are, Hub repos via ``snapshot_download``
    (in parallel, one progress bar). ``subfolder``: where in the repo (or folder) the member is, as transformers'
    ``from_pretrained(..., subfolder=)`` takes it (one for all, or one per member: a training run's
    ``checkpoint-N`` folders, say). ``hub_kwargs``: ``token``, ``cache_dir``, ``local_files_only``,
    ``force_download``."""
    check_hub_kwargs(hub_kwargs)
    revisions = per_member(revision, len(model_ids))
    subfolders = [s.strip("/") or None if s else None for s in per_member(subfolder, len(model_ids), "subfolder")]
    hub_kwargs.setdefault("tqdm_class", _QuietTqdm)
    patterns = META_PATTERNS + SAFETENSORS_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])

    def fetch(item: tuple[int, str, str | None, str | None]) -> Path:
        i, model_id, rev, sub = item
        name = member_name(i, model_id, sub) + (f" at revision {rev!r}" if rev else "")
        if os.path.isdir(model_id):
            return _inside(Path(model_id), sub, name)
        try:
            folder = Path(snapshot_download(model_id, revision=rev, allow_patterns=[
                f"{sub}/{p}" for p in patterns] if sub else patterns, **hub_kwargs))
        except Exception as exc:  # the hub client's errors, offline misses, network failures
            hint = ""
            if isinstance(exc, HFValidationError) and _path_like(model_id):
                raise MemberLoadError(f"{name}: there is no folder {os.path.abspath(model_id)}, and "
                                      f"{model_id!r} is not a Hub repo id ('org/name') either.") from exc
            if isinstance(exc, RepositoryNotFoundError):
                hint = "\nIf the repo is private or gated, pass token= (or log in with `hf auth login`)."
            if "/" in model_id:  # 'models/seed-0' reads as a repo id, and may have been meant as a folder
                hint += f"\nThere is no local folder {os.path.abspath(model_id)} either."
            raise MemberLoadError(f"{name}: {type(exc).__name__}: {exc}{hint}") from exc
        sha, folder = folder.name, _inside(folder, sub, name)
        if not allow_pickle and not any(folder.glob("*.safetensors")):
            _refuse_if_pickle_only(model_id, sha, name, hub_kwargs, sub)
        return folder

    items = list(zip(range(len(model_ids)), model_ids, revisions, subfolders))
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(items)))) as pool:
        bar = hf_tqdm(total=len(items), desc="Fetching members", unit="member", disable=len(items) < 2)
        with bar:
            paths = []
            for path in pool.map(fetch, items):
                paths.append(path)
                bar.update(1)
    return paths


def _path_like(model_id: str) -> bool:
    """Whether an id that is no folder was meant as one: a Hub repo id never starts with '/', '.' or '~', and has
    one '/' at most."""
    return model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1 or (os.sep != "/" and os.sep in model_id)


def member_name(i: int, model_id: str, subfolder: str | None = None) -> str:
    """How errors name member ``i``."""
    return f"member {i} ({model_id}" + (f", subfolder {subfolder!r})" if subfolder else ")")


def _inside(folder: Path, subfolder: str | None, name: str) -> Path:
    """``folder``'s ``subfolder`` (``folder`` itself without one), which must be there."""
    if not subfolder:
        return folder
    inner = folder / subfolder
    if not inner.is_dir():
        raise MemberLoadError(f"{name}: there is no folder {subfolder!r} in it.")
    return inner


def _refuse_if_pickle_only(model_id: str, sha: str, name: str, hub_kwargs: dict, subfolder: str | None) -> None:
    """The download skipped pickle files; ask the repo's file list whether that is all it has."""
    if hub_kwargs.get("local_files_only"):
        return
    files = list_repo_files(model_id, revision=sha, token=hub_kwargs.get("token"))
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    if any(f.endswith(".bin") and f.startswith(prefix) for f in files):
        raise ValueError(
            f"{name} has only pickle weights (*.bin), which can run arbitrary code when loaded. "
            "Pass allow_pickle=True if you trust it."
        )


def commit_sha(folder: Path) -> str | None:
    """The commit a snapshot folder of the Hub cache (or a folder in one: a subfolder) holds, or None for a plain
    folder."""
    return next((p.name for p in (folder, *folder.parents)
                 if re.fullmatch(r"[0-9a-f]{40}", p.name) and p.parent.name == "snapshots"), None)


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
    check_hub_kwargs(hub_kwargs)
    dtype = dtype if dtype is not None else torch_dtype
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
    torch_dtype, device = resolve_dtype(dtype), resolve_device(device, device_map)
    model_kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    folders = download_members(ids, revision, subfolder=subfolder, allow_pickle=allow_pickle, **hub_kwargs)
    subfolders = per_member(subfolder, len(ids), "subfolder")
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
        wide = load_fused(cls, folders[0], name=ids[0], dtype=torch_dtype, device=device, **model_kwargs)
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
    else:
        member_folders, revisions, source_dirs = folders, [commit_sha(folder) for folder in folders], folders
    # (fused with copy_shared=False: our own members, whose base's tensors become the wide model's)
    wide, sources, padded = fuse_adapters(cls, ids, member_folders, adapters, load=load, fuse=fuse)
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
    if all(weights_format(folder, name, load["allow_pickle"]) for folder, name in zip(folders, names)):
        wide = load_streaming(cls, ids, folders, names, load["dtype"], load["device"], load["trust_remote_code"],
                              fuse["allow_label_mismatch"], fuse["share_identical"], load["model_kwargs"])
        if wide is not None and (fuse["verify"] or needs_verifying(wide.plan.trace_method, wide.plan.model_class)):
            wide = verified(wide, fuse["share_identical"])
    validated = wide is None
    if wide is None:
        models = load_models(ids, folders, load["dtype"], load["device"], load["allow_pickle"],
                             load["trust_remote_code"], **load["model_kwargs"])
        wide = cls.from_models(models, member_ids=ids, **fuse)
        wide._source_dirs = folders
    wide.member_revisions = [commit_sha(folder) for folder in folders]
    return wide, validated


def as_ids(model_ids) -> list[str]:
    """One id (a repo id, or a folder as a string or a path, as transformers takes it) or several, as a list of
    strings."""
    if isinstance(model_ids, (str, os.PathLike)):
        return [os.fspath(model_ids)]
    return [os.fspath(i) if isinstance(i, os.PathLike) else i for i in model_ids]


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
    return section["num_members"], lambda members: load_fused(cls, folder, name=ids[0], dtype=dtype, device=device,
                                                              members=members, **implementation)


def load_members(
    model_ids: Sequence[str],
    revision: str | Sequence[str | None] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    **hub_kwargs,
) -> tuple[list[torch.nn.Module], list[str], list[str | None]]:
    """Load every member with its own transformers class, or, where the list holds PEFT adapters, as
    ``from_pretrained`` loads them (``PeftModel`` members over their one base: :mod:`hf_wide.adapters`). Returns the
    models, their ids, and the commit sha each was loaded at (None for local folders)."""
    model_ids = list(model_ids)
    if not model_ids:
        raise ValueError("WideModel.from_pretrained needs at least one model id; got an empty list.")
    folders = download_members(model_ids, revision, allow_pickle=allow_pickle, **hub_kwargs)
    adapters = [adapter_config(folder) for folder in folders]
    if any(adapters):
        models = load_adapter_members(model_ids, folders, adapters, allow_pickle=allow_pickle, device=device,
                                      dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code,
                                      hub_kwargs=hub_kwargs, trace_first=False)[0]  # (its caller traces: no trace ahead)
    else:
        models = load_models(model_ids, folders, resolve_dtype(dtype), device, allow_pickle, trust_remote_code)
    return models, model_ids, [commit_sha(folder) for folder in folders]
