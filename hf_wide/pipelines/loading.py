"""Loading the members' tokenizer or image processor once, when they share it (an adapter's base's, where it ships
none)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import _CACHED_NO_EXIST, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError


# What a tokenizer's init_kwargs record of where and how it was loaded, not of how it reads text: a member from a
# local folder (is_local=True) and one from the Hub read alike.
LOADED_FROM = frozenset({"name_or_path", "is_local", "local_files_only", "cache_dir", "token", "revision",
                         "_commit_hash", "subfolder", "force_download", "proxies", "trust_remote_code"})


def _fingerprint(obj, kind: str):
    if kind == "tokenizer":
        settings = {k: _content(k, v) for k, v in obj.init_kwargs.items()
                    if isinstance(v, (str, int, float, bool, type(None))) and k not in LOADED_FROM}
        return obj.get_vocab(), settings
    settings = obj.to_dict()
    settings.pop("_processor_class", None)
    return settings


def _content(key: str, value):
    """A setting as it matters: a file's (``vocab_file``, ``merges_file``: a BERT folder's vocab.txt, which
    transformers records by the member's own path) by its bytes, not where it lies."""
    if key.endswith("_file") and isinstance(value, str) and os.path.isfile(value):
        return hashlib.sha256(Path(value).read_bytes()).hexdigest()
    return value


def _refuse_if_empty(tokenizer, vocab: dict, name: str) -> None:
    """A tokenizer with no vocabulary (``vocab``, its ``get_vocab()``) but its special tokens (and T5's '▁', its one
    word then) reads every word as unknown: what transformers 5 makes, silently, of a folder without tokenizer files
    (a checkpoint saved without its tokenizer)."""
    words = set(vocab) - set(tokenizer.all_special_tokens)
    if len(words) <= 1:
        raise ValueError(
            f"The tokenizer of {name} has no vocabulary but its special tokens (the checkpoint has no tokenizer "
            f"files, it seems): it would read every word as {tokenizer.unk_token or 'unknown'}. Pass tokenizer= "
            f"(the one the members were fine-tuned with, their base model's say)."
        )


# The files a saved tokenizer or image processor writes: a repo with none of them has none of its own.
PREPROCESSOR_FILES = {"tokenizer": ("tokenizer_config.json", "tokenizer.json"),
                      "image_processor": ("preprocessor_config.json",)}


# The options of from_pretrained that say where the members' files are, which their preprocessors are read with too
HUB_OPTIONS = ("cache_dir", "local_files_only", "force_download")


def preprocessor_sources(wide, kind: str, token=None, **hub) -> list[tuple[str, str | None, str | None]]:
    """(repo id or folder, revision, subfolder) to load each member's tokenizer or image processor from: the
    member's own, at the commit its weights came from (in its subfolder, where it was given one); for an adapter
    that ships none (PEFT saves the adapter alone), its base's, at the base's commit, which is what it was trained
    with."""
    adapters = getattr(wide, "adapter_sources", None)
    subfolders = wide.member_subfolders or [None] * len(wide.member_ids)
    sources = []
    for i, (source, revision, sub) in enumerate(zip(wide.member_ids, wide.member_revisions, subfolders)):
        inside = f"{sub.strip('/')}/" if sub else ""
        if adapters is not None and adapters.configs[i] is not None and not any(
                _has_file(source, inside + name, revision, token, **hub) is not False for name in PREPROCESSOR_FILES[kind]):
            source, revision, sub = adapters.base_model, adapters.base_revision, None
        sources.append((str(source), revision, sub))
    return sources


def _has_file(source: str, filename: str, revision: str | None, token=None, **hub) -> bool | None:
    """Whether the folder or Hub repo ``source`` holds ``filename`` at ``revision``: from the folder, the local
    cache, or the Hub; None where none of them can tell (offline, and not in the default cache). Asked of the Hub
    by downloading it, so that the client caches the answer either way (the file, or its absence at that commit)
    for offline use."""
    if os.path.isdir(source):
        return os.path.isfile(os.path.join(source, filename))
    cached = try_to_load_from_cache(source, filename, revision=revision, cache_dir=hub.get("cache_dir"))
    if cached is not None:
        return cached is not _CACHED_NO_EXIST
    try:
        hf_hub_download(source, filename, revision=revision, token=token, **hub)
        return True
    except EntryNotFoundError:
        return False
    except Exception:  # offline, or the Hub unreachable: nothing known
        return None


def load_named(source: str | os.PathLike, kind: str, token=None, **hub):
    """The tokenizer (or image processor) ``pipeline(tokenizer="org/name")`` names, as transformers' pipeline loads
    a name: at the repo's main, with the members' token and :data:`HUB_OPTIONS`."""
    from transformers import AutoImageProcessor, AutoTokenizer

    auto = AutoTokenizer if kind == "tokenizer" else AutoImageProcessor
    try:
        loaded = auto.from_pretrained(str(source), token=token, **hub)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Could not load the {kind.replace('_', ' ')} {source}: {exc}") from exc
    if kind == "tokenizer":
        _refuse_if_empty(loaded, loaded.get_vocab(), str(source))
    return loaded


def load_preprocessors(sources: Sequence[str | tuple], kind: str, token=None, **hub):
    """The one tokenizer (``kind="tokenizer"``) or image processor the members share, from ``sources`` (repo ids
    or folders, or (id, revision) pairs, or (id, revision, subfolder) triples); ``hub``: :data:`HUB_OPTIONS` as the
    members were loaded with (a ``cache_dir``: the tokenizer was fetched into the default cache, and offline not
    found). Members whose vocabularies or
    settings differ are refused with a message naming them: pass ``tokenizer=`` (or ``image_processor=``) yourself
    to use one for all. So is a tokenizer with no vocabulary (no tokenizer files)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    auto = AutoTokenizer if kind == "tokenizer" else AutoImageProcessor
    places = [(*source, None, None)[:3] if isinstance(source, tuple) else (source, None, None) for source in sources]
    names = [source + (f"/{sub}" if sub else "") + (f" at {revision}" if revision else "")
             for source, revision, sub in places]
    loaded, once = [], {}  # adapters that ship none all read their base's: loaded once
    for i, (place, name) in enumerate(zip(places, names)):
        source, revision, sub = place
        try:
            if place not in once:
                once[place] = auto.from_pretrained(source, revision=revision, token=token, **hub,
                                                   **({"subfolder": sub} if sub else {}))
            loaded.append(once[place])
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"Could not load {'an' if kind == 'image_processor' else 'a'} {kind} for member {i} ({name}): {exc}. "
                f"Pass {kind}= explicitly."
            ) from exc
    fingerprints = [_fingerprint(obj, kind) for obj in loaded]  # a tokenizer's: (vocabulary, settings)
    for i, (name, obj, fingerprint) in enumerate(zip(names, loaded, fingerprints)):
        if kind == "tokenizer":
            _refuse_if_empty(obj, fingerprint[0], f"member {i} ({name})")
        if fingerprint != fingerprints[0]:
            raise ValueError(
                f"Member {i} ({name}) has a different {kind} from member 0 ({names[0]}): they would "
                f"read the same input differently. Pass {kind}= to use one for all members."
            )
    return loaded[0]
