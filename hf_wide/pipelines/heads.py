"""Which members a task's pipeline runs: refused where transformers knows their class for another task's head."""

from __future__ import annotations

from ..model import WideModel


def head_refusal(model: WideModel, task: str, heads: tuple[str, str] | None) -> str | None:
    """Why ``task`` cannot run the members, whose class transformers knows for another task (a causal LM for text
    classification, say: its outputs would be misread, or fail deep inside); None where it can, or where their class
    is none transformers knows (a model of its own code: its outputs will tell)."""
    module = model.model.get_base_model() if hasattr(model.model, "get_base_model") else model.model  # PEFT's
    return class_refusal(type(module).__name__, task, heads)


def class_refusal(name: str, task: str, heads: tuple[str, str] | None) -> str | None:
    """:func:`head_refusal` for members of the transformers class ``name``."""
    if heads is None:
        return None
    from transformers.models.auto import modeling_auto

    mapping, head = heads
    if name in _class_names(getattr(modeling_auto, mapping)):
        return None
    known = set().union(*(_class_names(m) for key, m in vars(modeling_auto).items()
                          if key.startswith("MODEL_") and key.endswith("_MAPPING_NAMES") and isinstance(m, dict)))
    if name not in known:
        return None
    return f"{task} runs members with {head}; these are {name} models. Load members with such a head for it."


def _class_names(mapping: dict) -> set[str]:
    return {name for value in mapping.values() for name in ((value,) if isinstance(value, str) else value)}
