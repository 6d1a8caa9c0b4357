"""A wide model out again: its members as ordinary repos, and the fused model or its members on the Hub.

    wide.save_members("out")                 # out/member-{i}: transformers repos, or PEFT adapter folders
    wide.push_to_hub("user/wide-ensemble")   # one fused repo (hf_wide.saving), uploaded in one commit
    wide.push_members(["user/a", "user/b"])  # member i as an ordinary repo at repo_ids[i]
"""

from __future__ import annotations

import fnmatch
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import transformers
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import tqdm as hf_tqdm

from .checkpoints import WEIGHTS_INDEX_NAME
from .loading import quiet_transformers_bars
from .own_code import save_own_code
from .preprocessor_files import TOKENIZER_PATTERNS, copy_tokenizer_files, tokenizer_folders
from .saving import CONFIG_KEY, refuse_peft_without_sources, save_wide


# ---------------------------------------------------------------- members as ordinary repos
def save_member(wide, i: int, save_directory: str | Path) -> Path:
    """Member i as an ordinary transformers repo (its config, weights and tokenizer files) in ``save_directory``."""
    member = wide.member(i)
    if not hasattr(member, "save_pretrained"):
        raise TypeError(f"Member {i} is a {type(member).__name__}, not a transformers model: use torch.save.")
    directory = Path(save_directory)
    member.save_pretrained(directory)
    save_own_code(type(member), directory)  # (a checkpoint's own code: its config's auto_map names the files)
    sources = tokenizer_folders(wide)  # (a merged adapter's: its base's)
    if sources:
        copy_tokenizer_files([sources[i] if len(sources) > 1 else sources[0]], directory)
    return directory


def save_members(wide, save_directory: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """Every member as an ordinary transformers repo: ``save_directory/member-{i}`` (or ``names[i]``); members loaded
    as PEFT adapters as PEFT adapter folders, and the base among them as the base's own repo."""
    names = list(names) if names is not None else [f"member-{i}" for i in range(wide.num_members)]
    if len(names) != wide.num_members:
        raise ValueError(f"Got {len(names)} names for {wide.num_members} members.")
    refuse_peft_without_sources(wide)
    show_bar = len(names) > 1 and transformers.utils.logging.is_progress_bar_enabled()
    directories = []
    for i, name in enumerate(hf_tqdm(names, desc="Saving members", unit="member", disable=not show_bar)):
        with quiet_transformers_bars():  # the members share one bar, not transformers' own for each
            directories.append(_save_as_loaded(wide, i, Path(save_directory) / name))
    return directories


def _save_as_loaded(wide, i: int, directory: Path) -> Path:
    """Member i as it was loaded: a PEFT adapter folder where it was loaded as an adapter, with the tokenizer files
    it shipped (:func:`~hf_wide.adapter_repos.save_adapter`: its config names the base it was loaded over, which
    PEFT's own save of ``member(i)`` did not after ``base_model=``); else (the base among them too) its own repo."""
    if getattr(wide, "adapter_sources", None) is not None:
        from .adapter_repos import save_adapter

        if save_adapter(wide, i, directory) is not None:
            sources = getattr(wide, "_source_dirs", None) or []
            own = Path(sources[i]) if len(sources) == wide.num_members else None  # (else a saved ensemble's folder)
            if own is not None and (own / "adapter_config.json").is_file():
                copy_tokenizer_files([own], directory)
            return directory
    return save_member(wide, i, directory)


# ---------------------------------------------------------------- to the Hub
def push_wide(wide, repo_id: str, *, private: bool | None = None, token: str | None = None,
              commit_message: str | None = None, create_pr: bool = False, revision: str | None = None,
              overwrite_readme: bool = False, **save_kwargs):
    """Save ``wide`` as a fused repo in a temporary folder and upload it to ``repo_id`` in one commit (the repo is
    created if needed). A README.md already in the repo is kept unless ``overwrite_readme``; weight files of an
    earlier upload that this one does not replace are deleted in the same commit, and so are the tokenizer and
    processor files of an earlier fused repo there (as ``save_pretrained`` over one). Returns the CommitInfo."""
    api = HfApi(token=token)
    group = wide.members_group  # member-parallel: every rank saves (rank 0 writes), rank 0 talks to the Hub

    def on_hub(work, what: str):
        if group is None:
            return work()
        from .parallel import from_rank_zero

        return from_rank_zero(group, work, what)

    repo_id = on_hub(lambda: api.create_repo(repo_id, private=private, exist_ok=True).repo_id, "Creating the repo")
    if revision is not None and not revision.startswith("refs/pr"):  # a branch of its own, from main, as transformers
        on_hub(lambda: _create_branch(api, repo_id, revision, create_pr), f"Creating the branch {revision}")
    with tempfile.TemporaryDirectory(prefix="hf-wide-") as tmp:
        save_wide(wide, tmp, repo_id=repo_id, overwrite_readme=True, **save_kwargs)

        def upload():
            if not overwrite_readme and api.file_exists(repo_id, "README.md", revision=revision):
                (Path(tmp) / "README.md").unlink()
            patterns = ["model*.safetensors", WEIGHTS_INDEX_NAME]
            earlier = _fused_section(api, repo_id, revision)
            if earlier is not None:  # its tokenizer is the earlier members' (as save_pretrained does)
                patterns += [*TOKENIZER_PATTERNS, "generation_config.json"]
            files = _files(api, repo_id, revision)
            stale = _top_level(files, patterns)  # by name: what the repo holds in its folders stays
            if earlier is not None and "adapters" in earlier:  # and so are its adapters, in the folders it wrote
                from .adapter_repos import MEMBERS_DIR

                folders = tuple(f"{MEMBERS_DIR}/member-{i}/" for i in range(earlier.get("num_members", 0)))
                stale += [f for f in files if f.startswith(folders)]
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=tmp,
                commit_message=commit_message or f"Upload a wide model of {wide.num_members} members with hf-wide",
                create_pr=create_pr,
                revision=revision,
                delete_patterns=stale or None,
            )

        return on_hub(upload, f"Uploading to {repo_id}")


def _create_branch(api: HfApi, repo_id: str, branch: str, create_pr: bool) -> None:
    """``branch`` made from main where it is not there yet; as transformers' ``push_to_hub``, a pull request may be
    opened against it without the right to write it (a 403 then)."""
    try:
        api.create_branch(repo_id, branch=branch, exist_ok=True)
    except HfHubHTTPError as exc:
        if not (create_pr and exc.response is not None and exc.response.status_code == 403):
            raise


def _files(api: HfApi, repo_id: str, revision: str | None = None) -> list[str]:
    """The repo's files at ``revision`` (main by default); none where the repo or the branch is new."""
    try:
        return api.list_repo_files(repo_id, revision=revision)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return []


def _top_level(files: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The ``files`` (a repo's) in its top folder that match ``patterns`` (huggingface_hub's ``*`` also crosses
    folders: ``model*.safetensors`` matched ``models/old/model.safetensors``, and a push deleted it)."""
    return [f for f in files if "/" not in f and any(fnmatch.fnmatchcase(f, p) for p in patterns)]


def _fused_section(api: HfApi, repo_id: str, revision: str | None = None) -> dict | None:
    """The ``hf_wide`` section of the fused repo the repo's branch (main by default) holds, or None."""
    if not api.file_exists(repo_id, "config.json", revision=revision):
        return None
    try:
        config = json.loads(Path(api.hf_hub_download(repo_id, "config.json", revision=revision)).read_text())
    except ValueError:  # not JSON: no fused repo's
        return None
    return config.get(CONFIG_KEY) if isinstance(config, dict) else None


# An earlier upload's weights, which a member pushed over them replaces: uploads delete nothing, and transformers reads
# model.safetensors before an index (hf-wide does too), and an adapter's files before a full model's.
MEMBER_WEIGHTS = ["model*.safetensors", WEIGHTS_INDEX_NAME, "pytorch_model*.bin", "pytorch_model.bin.index.json",
                  "adapter_model.*", "adapter_config.json"]


def push_members(wide, repo_ids: Sequence[str], *, private: bool | None = None, token: str | None = None,
                 commit_message: str | None = None) -> list:
    """Upload every member as ``save_members`` saves it (an ordinary transformers repo, or a PEFT adapter folder),
    member i to ``repo_ids[i]`` (one commit each; weights of an earlier upload there are deleted in it,
    :data:`MEMBER_WEIGHTS`)."""
    repo_ids = list(repo_ids)
    if len(repo_ids) != wide.num_members:
        raise ValueError(f"Got {len(repo_ids)} repo ids for {wide.num_members} members.")
    api = HfApi(token=token)
    commits = []
    for i, repo_id in enumerate(repo_ids):
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory(prefix="hf-wide-") as tmp:
            _save_as_loaded(wide, i, Path(tmp))
            message = commit_message or f"Upload member {i} ({wide.member_ids[i]}) of a wide model with hf-wide"
            stale = _top_level(_files(api, repo_id), MEMBER_WEIGHTS) or None  # by name: nothing in its folders
            commits.append(api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=message,
                                             delete_patterns=stale))
    return commits
