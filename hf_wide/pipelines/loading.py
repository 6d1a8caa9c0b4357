"""Loading the members' tokenizer or image processor once, when they share it."""

from __future__ import annotations

from collections.abc import Sequence


def _fingerprint(obj, kind: str):
    if kind == "tokenizer":
        settings = {k: v for k, v in obj.init_kwargs.items() if isinstance(v, (str, int, float, bool, type(None)))}
        settings.pop("name_or_path", None)
        return obj.get_vocab(), settings
    settings = obj.to_dict()
    settings.pop("_processor_class", None)
    return settings


def load_preprocessors(sources: Sequence[str], kind: str, token=None):
    """The one tokenizer (``kind="tokenizer"``) or image processor the members share. Members whose
    vocabularies or settings differ are refused with a message naming them: pass ``tokenizer=`` (or
    ``image_processor=``) yourself to use one for all."""
    from transformers import AutoImageProcessor, AutoTokenizer

    auto = AutoTokenizer if kind == "tokenizer" else AutoImageProcessor
    loaded = []
    for i, source in enumerate(sources):
        try:
            loaded.append(auto.from_pretrained(source, token=token))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"Could not load a {kind} for member {i} ({source}): {exc}. Pass {kind}= explicitly."
            ) from exc
    reference = _fingerprint(loaded[0], kind)
    for i, (source, obj) in enumerate(zip(sources, loaded)):
        if _fingerprint(obj, kind) != reference:
            raise ValueError(
                f"Member {i} ({source}) has a different {kind} from member 0 ({sources[0]}): they would "
                f"read the same input differently. Pass {kind}= to use one for all members."
            )
    return loaded[0]
