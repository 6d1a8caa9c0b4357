"""Loading the members' tokenizer or image processor once, when they share it."""

from __future__ import annotations

from collections.abc import Sequence


# What a tokenizer's init_kwargs record of where and how it was loaded, not of how it reads text: a member from a
# local folder (is_local=True) and one from the Hub read alike.
LOADED_FROM = frozenset({"name_or_path", "is_local", "local_files_only", "cache_dir", "token", "revision",
                         "_commit_hash", "subfolder", "force_download", "proxies", "trust_remote_code"})


def _fingerprint(obj, kind: str):
    if kind == "tokenizer":
        settings = {k: v for k, v in obj.init_kwargs.items()
                    if isinstance(v, (str, int, float, bool, type(None))) and k not in LOADED_FROM}
        return obj.get_vocab(), settings
    settings = obj.to_dict()
    settings.pop("_processor_class", None)
    return settings


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


def load_preprocessors(sources: Sequence[str], kind: str, token=None):
    """The one tokenizer (``kind="tokenizer"``) or image processor the members share. Members whose
    vocabularies or settings differ are refused with a message naming them: pass ``tokenizer=`` (or
    ``image_processor=``) yourself to use one for all. So is a tokenizer with no vocabulary (no tokenizer files)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    auto = AutoTokenizer if kind == "tokenizer" else AutoImageProcessor
    loaded = []
    for i, source in enumerate(sources):
        try:
            loaded.append(auto.from_pretrained(source, token=token))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"Could not load {'an' if kind == 'image_processor' else 'a'} {kind} for member {i} ({source}): {exc}. "
                f"Pass {kind}= explicitly."
            ) from exc
    fingerprints = [_fingerprint(obj, kind) for obj in loaded]  # a tokenizer's: (vocabulary, settings)
    for i, (source, obj, fingerprint) in enumerate(zip(sources, loaded, fingerprints)):
        if kind == "tokenizer":
            _refuse_if_empty(obj, fingerprint[0], f"member {i} ({source})")
        if fingerprint != fingerprints[0]:
            raise ValueError(
                f"Member {i} ({source}) has a different {kind} from member 0 ({sources[0]}): they would "
                f"read the same input differently. Pass {kind}= to use one for all members."
            )
    return loaded[0]
