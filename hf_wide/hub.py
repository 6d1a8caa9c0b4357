"""Hub I/O: resolve N member ids (Hub repos or local folders) and load them as transformers models.

Everything that talks to the Hub lives here, through the real ``huggingface_hub`` client: downloads run
in parallel across members under one progress bar, weights are safetensors unless pickle is explicitly
allowed, and remote code never runs unless asked for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transformers
from huggingface_hub import list_repo_files, snapshot_download
from huggingface_hub.utils import tqdm as hf_tqdm

from .compat import IncompatibleMembersError


class MemberLoadError(OSError):
    """A member could not be fetched or read; the message names the member, and ``__cause__`` holds the
    ``huggingface_hub`` error (``RepositoryNotFoundError``, ``RevisionNotFoundError``, ...)."""

SAFETENSORS_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json"]
# Config, tokenizer and processor files: small, and what a pipeline needs besides the weights.
META_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.py"]

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """``None`` or "auto" (as saved), or one of :data:`DTYPES` given as a name or a ``torch.dtype``."""
    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
    elif dtype in DTYPES.values():
        return dtype
    raise ValueError(f"Unsupported dtype {dtype!r}: use one of {', '.join(DTYPES)}, 'auto' or None.")


def _revisions(revision: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if revision is None or isinstance(revision, str):
        return [revision] * n
    revisions = list(revision)
    if len(revisions) != n:
        raise ValueError(f"Got {len(revisions)} revisions for {n} members: give one revision, or one per member.")
    return revisions


def download_members(
    model_ids: Sequence[str],
    revision: str | Sequence[str | None] | None = None,
    *,
    allow_pickle: bool = False,
    max_workers: int = 8,
    **hub_kwargs,
) -> list[Path]:
    """Local folders for every member: existing directories as they are, Hub repos via ``snapshot_download``
    (in parallel, one progress bar). ``hub_kwargs``: ``token``, ``cache_dir``, ``local_files_only``,
    ``force_download``."""
    revisions = _revisions(revision, len(model_ids))
    patterns = META_PATTERNS + SAFETENSORS_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])

    def fetch(item: tuple[int, str, str | None]) -> Path:
        i, model_id, rev = item
        if os.path.isdir(model_id):
            return Path(model_id)
        name = f"member {i} ({model_id})" + (f" at revision {rev!r}" if rev else "")
        try:
            folder = Path(snapshot_download(model_id, revision=rev, allow_patterns=patterns, **hub_kwargs))
        except Exception as exc:  # the hub client's errors, offline misses, network failures
            raise MemberLoadError(f"{name}: {type(exc).__name__}: {exc}") from exc
        if not allow_pickle and not any(folder.glob("*.safetensors")):
            _refuse_if_pickle_only(model_id, folder.name, name, hub_kwargs)
        return folder

    items = [(i, model_id, rev) for i, (model_id, rev) in enumerate(zip(model_ids, revisions))]
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(items)))) as pool:
        bar = hf_tqdm(total=len(items), desc="Fetching members", unit="member", disable=len(items) < 2)
        with bar:
            paths = []
            for path in pool.map(fetch, items):
                paths.append(path)
                bar.update(1)
    return paths


def _refuse_if_pickle_only(model_id: str, sha: str, name: str, hub_kwargs: dict) -> None:
    """The download skipped pickle files; ask the repo's file list whether that is all it has."""
    if hub_kwargs.get("local_files_only"):
        return
    files = list_repo_files(model_id, revision=sha, token=hub_kwargs.get("token"))
    if any(f.endswith(".bin") for f in files):
        raise ValueError(
            f"{name} has only pickle weights (*.bin), which can run arbitrary code when loaded. "
            "Pass allow_pickle=True if you trust it."
        )


def commit_sha(folder: Path) -> str | None:
    """The commit a snapshot folder of the Hub cache holds (its name), or None for a plain folder."""
    return folder.name if re.fullmatch(r"[0-9a-f]{40}", folder.name) and folder.parent.name == "snapshots" else None


def _weights_format(folder: Path, name: str, allow_pickle: bool) -> bool:
    """True for safetensors; False for pickle (when allowed); raise when there are no usable weights."""
    if any(folder.glob("*.safetensors")):
        return True
    if any(folder.glob("*.bin")):
        if allow_pickle:
            return False
        raise ValueError(
            f"{name} has only pickle weights (*.bin), which can run arbitrary code when loaded. "
            "Pass allow_pickle=True if you trust it."
        )
    raise FileNotFoundError(f"{name} has no model weights (*.safetensors) in {folder}.")


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
    """Load every member with its own transformers class. Returns the models, their ids, and the commit
    sha each was loaded at (None for local folders)."""
    model_ids = list(model_ids)
    if not model_ids:
        raise ValueError("WideModel.from_pretrained needs at least one model id; got an empty list.")
    torch_dtype = resolve_dtype(dtype)
    folders = download_members(model_ids, revision, allow_pickle=allow_pickle, **hub_kwargs)
    models = []
    # One bar for all members instead of transformers' bar per checkpoint.
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        for i, (model_id, folder) in enumerate(hf_tqdm(list(zip(model_ids, folders)), desc="Loading members",
                                                     unit="member", disable=len(model_ids) < 2 or not bars_were_on)):
            models.append(_load_member(model_id, folder, f"member {i} ({model_id})", torch_dtype, device,
                                       allow_pickle, trust_remote_code))
    finally:
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()
    return models, model_ids, [commit_sha(folder) for folder in folders]


def _load_member(model_id, folder, name, torch_dtype, device, allow_pickle, trust_remote_code):
    """One member with its own transformers class, refusing a checkpoint that lacks tensors."""
    use_safetensors = _weights_format(folder, name, allow_pickle)
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model, info = _model_class(config, name).from_pretrained(
        folder,
        dtype=torch_dtype,
        use_safetensors=use_safetensors,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    if info.get("missing_keys"):
        missing = ", ".join(sorted(info["missing_keys"])[:5])
        raise IncompatibleMembersError(f"{name}: the checkpoint is missing tensor(s) {missing}.")
    if device is not None:
        model.to(device)
    return model.eval()


def _model_class(config, name: str) -> type:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if hasattr(transformers, arch):
            return getattr(transformers, arch)
    raise ValueError(
        f"{name}: config.architectures is {architectures!r}, which names no transformers class; "
        "load the models yourself and use WideModel.from_models."
    )
