"""Fetching the members: N ids (Hub repos or local folders) as N local folders.

Downloads go through the real ``huggingface_hub`` client (``snapshot_download``), in parallel across members
under one progress bar, each member's folder of its repo alone where it was given a subfolder; weights are
safetensors unless pickle is explicitly allowed. Errors name the member, and say what it may have been meant as.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from huggingface_hub import HfApi, is_offline_mode, snapshot_download
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import tqdm as hf_tqdm


class MemberLoadError(OSError):
    """A member could not be fetched or read; the message names the member, and ``__cause__`` holds the
    ``huggingface_hub`` error (``RepositoryNotFoundError``, ``RevisionNotFoundError``, ...)."""


def cache_home() -> Path:
    """hf-wide's own cache folder (the demo's members, the plans of member lists): ``$HF_WIDE_CACHE``, else
    ``~/.cache/hf-wide``."""
    return Path(os.environ.get("HF_WIDE_CACHE") or Path.home() / ".cache" / "hf-wide")


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


# transformers' from_pretrained options that hf-wide cannot honour, and why (rather than "an unexpected keyword").
_ONE_DEVICE = ("hf-wide keeps the wide model on one device (every layer holds all members): use device='cuda', "
               "device_map='auto' or {'': device}, or member_parallel=True to split the members across ranks.")
REFUSED_OPTIONS = {
    "max_memory": "max_memory= places layers across devices within budgets; " + _ONE_DEVICE,
    "offload_folder": "offload_folder= offloads layers to disk; " + _ONE_DEVICE,
    "offload_buffers": "offload_buffers= offloads buffers off the device; " + _ONE_DEVICE,
    "tp_plan": "tp_plan= splits each layer across ranks; " + _ONE_DEVICE,
    "device_mesh": "device_mesh= splits each layer across ranks; " + _ONE_DEVICE,
    "quantization_config": "quantized members are not supported: load them in float32, float16 or bfloat16 (dtype=).",
    "load_in_8bit": "quantized members are not supported: load them in float32, float16 or bfloat16 (dtype=).",
    "load_in_4bit": "quantized members are not supported: load them in float32, float16 or bfloat16 (dtype=).",
    "variant": "hf-wide reads a checkpoint's model.safetensors (or its shards), not a variant's "
               "(model.<variant>.safetensors): load the members with transformers (variant=) and fuse them with "
               "WideModel.from_models.",
}
# Options transformers 5 takes and no longer uses: taken here alike (hf-wide's loading always holds little memory).
IGNORED_OPTIONS = frozenset({"low_cpu_mem_usage", "_fast_init", "offload_state_dict", "mirror"})


def check_hub_kwargs(hub_kwargs: dict, caller: str = "WideModel.from_pretrained") -> dict:
    """``hub_kwargs`` without the options transformers ignores. A ``TypeError`` naming any keyword argument that is
    not an option (with local folders nothing else would read it, and a misspelt option would be silently ignored),
    and a ``ValueError`` saying why for transformers' options that hf-wide cannot honour."""
    for name, why in REFUSED_OPTIONS.items():
        if hub_kwargs.get(name) not in (None, False):
            raise ValueError(f"{caller}(): {why}")
    if hub_kwargs.get("use_safetensors") is False:
        raise ValueError(f"{caller}(): use_safetensors=False: hf-wide reads a checkpoint's safetensors where it has "
                         "them; pass allow_pickle=True to read checkpoints that only have pickled weights.")
    options = {k: v for k, v in hub_kwargs.items()
               if k not in IGNORED_OPTIONS and not (k in REFUSED_OPTIONS or k == "use_safetensors")}
    unknown = sorted(set(options) - HUB_KWARGS)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""))
    return options


def download_members(
    model_ids: Sequence[str],
    revision: str | Sequence[str | None] | None = None,
    *,
    subfolder: str | Sequence[str | None] | None = None,
    allow_pickle: bool = False,
    max_workers: int = 8,
    names: Sequence[str] | None = None,
    **hub_kwargs,
) -> list[Path]:
    """Local folders for every member: existing directories as they are, Hub repos via ``snapshot_download``
    (in parallel, one progress bar). ``subfolder``: where in the repo (or folder) the member is, as transformers'
    ``from_pretrained(..., subfolder=)`` takes it (one for all, or one per member: a training run's
    ``checkpoint-N`` folders, say). ``names``: how errors name them (``member i (id)`` by default).
    ``hub_kwargs``: ``token``, ``cache_dir``, ``local_files_only``,
    ``force_download``."""
    hub_kwargs = check_hub_kwargs(hub_kwargs)
    revisions = per_member(revision, len(model_ids))
    subfolders = subfolders_of(subfolder, len(model_ids))
    hub_kwargs.setdefault("tqdm_class", _QuietTqdm)
    patterns = META_PATTERNS + SAFETENSORS_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])

    def fetch(item: tuple[int, str, str | None, str | None]) -> Path:
        i, model_id, rev, sub = item
        name = (names[i] if names else member_name(i, model_id, sub)) + (f" at revision {rev!r}" if rev else "")
        if os.path.isdir(model_id):
            return _inside(Path(model_id), sub, name)
        try:
            allowed = _member_files(model_id, rev, sub, patterns, hub_kwargs) or (
                [f"{sub}/{p}" for p in patterns] if sub else patterns)
            folder = Path(snapshot_download(model_id, revision=rev, allow_patterns=allowed, **hub_kwargs))
        except Exception as exc:  # the hub client's errors, offline misses, network failures
            hint = ""
            if isinstance(exc, HFValidationError) and _path_like(model_id):
                raise MemberLoadError(f"{name}: there is no folder {os.path.abspath(model_id)}, and "
                                      f"{model_id!r} is not a Hub repo id ('org/name') either.") from exc
            if isinstance(exc, RepositoryNotFoundError):
                hint = "\nIf the repo is private or gated, pass token= (or log in with `hf auth login`)."
            if isinstance(exc, RepositoryNotFoundError) and "/" in model_id:  # 'models/seed-0' reads as a repo id, and
                hint += f"\nThere is no local folder {os.path.abspath(model_id)} either."  # may be meant as a folder
            raise MemberLoadError(f"{name}: {type(exc).__name__}: {exc}{hint}") from exc
        sha, folder = folder.name, _inside(folder, sub, name)
        if not allow_pickle and not any(folder.rglob("*.safetensors")):  # (a fused LoRA ensemble's: members/)
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


def _member_files(model_id: str, revision: str | None, subfolder: str | None, patterns: Sequence[str],
                  hub_kwargs: dict) -> list[str]:
    """The files of the member at ``subfolder`` of the repo (its root by default) that match ``patterns``, by name:
    those in its own folder, and the adapter folders of a fused ensemble of adapters in it. huggingface_hub's ``*``
    crosses folders, so a member at the root downloaded every ``checkpoint-N/`` folder's weights too. None offline,
    or where the repo's files cannot be listed (its download then says why)."""
    if hub_kwargs.get("local_files_only") or is_offline_mode():
        return []
    from .adapter_repos import MEMBERS_DIR

    try:
        files = HfApi(token=hub_kwargs.get("token")).list_repo_files(model_id, revision=revision)
    except Exception:  # (gated, missing, unreachable: snapshot_download raises it, named)
        return []
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    own = [f for f in files if f.startswith(prefix) and ("/" not in f[len(prefix):]
                                                         or f.startswith(f"{prefix}{MEMBERS_DIR}/member-"))]
    return [f for f in own if any(fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], p) for p in patterns)]


def _path_like(model_id: str) -> bool:
    """Whether an id that is no folder was meant as one: a Hub repo id never starts with '/', '.' or '~', and has
    one '/' at most."""
    return model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1 or (os.sep != "/" and os.sep in model_id)


def subfolders_of(subfolder: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    """Each member's subfolder (:func:`per_member`), without the slashes around it (None for none)."""
    return [s.strip("/") or None if s else None for s in per_member(subfolder, n, "subfolder")]


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
    """The download skipped pickle files; ask the repo's file list whether that is all it has. Offline, the cache
    holds the commit without its weights (its config fetched alone since, say): that is said, not that the repo has
    none."""
    if hub_kwargs.get("local_files_only") or is_offline_mode():
        raise MemberLoadError(
            f"{name}: the local cache holds commit {sha} without its safetensors weights, and the Hub is not asked "
            "(offline, or local_files_only=True): load it once online, or at a revision whose weights are cached "
            "(allow_pickle=True, if its weights are pickles).")
    api = HfApi(endpoint=hub_kwargs.get("endpoint"), token=hub_kwargs.get("token"), headers=hub_kwargs.get("headers"))
    files = api.list_repo_files(model_id, revision=sha)  # (of the endpoint it was downloaded from)
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


def as_ids(model_ids) -> list[str]:
    """One id (a repo id, or a folder as a string or a path, as transformers takes it) or several, as a list of
    strings."""
    if isinstance(model_ids, (str, os.PathLike)):
        return [os.fspath(model_ids)]
    return [os.fspath(i) if isinstance(i, os.PathLike) else i for i in model_ids]
