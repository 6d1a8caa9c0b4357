"""The one base of a list of adapters (:mod:`hf_wide.adapters` loads them over it): which model
(:func:`base_of`), at which revision (:func:`base_revision_of`), as which transformers class (:func:`base_class`)
with how many labels (:func:`head_labels`), which tensors its checkpoint may lack (:func:`held_by_every_adapter`),
and which of its embedding tables an adapter grew (:func:`grown_tables`), read from the adapters' files without their
values (:func:`adapter_shapes`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from torch import nn

from .compat import IncompatibleMembersError

# PEFT's task types -> the transformers auto classes that build the base for them, the first that knows its config
# (PEFT's SEQ_CLS classifies audio and images too: a wav2vec2 base, saved for pre-training, as an audio classifier)
TASK_CLASSES = {
    "CAUSAL_LM": (transformers.AutoModelForCausalLM,),
    "SEQ_CLS": (transformers.AutoModelForSequenceClassification, transformers.AutoModelForAudioClassification,
                transformers.AutoModelForImageClassification),
    "TOKEN_CLS": (transformers.AutoModelForTokenClassification, transformers.AutoModelForAudioFrameClassification),
    "SEQ_2_SEQ_LM": (transformers.AutoModelForSeq2SeqLM,),
    "QUESTION_ANS": (transformers.AutoModelForQuestionAnswering,),
    "FEATURE_EXTRACTION": (transformers.AutoModel,),
}


def base_of(configs: Sequence[dict | None], names: Sequence[str], base_model: str | None) -> str:
    """The one base every adapter names (or ``base_model``); raise if two adapters name different bases."""
    if base_model is not None:
        return base_model
    named = [(name, c.get("base_model_name_or_path")) for name, c in zip(names, configs) if c is not None]
    missing = next((name for name, base in named if not base), None)
    if missing is not None:
        raise ValueError(f"{missing} names no base model (base_model_name_or_path); pass base_model=.")
    first_name, first = named[0]
    for name, base in named[1:]:
        if base != first and not _same_folder(base, first):
            raise IncompatibleMembersError(
                f"{name} is an adapter of {base!r}, but {first_name} is an adapter of {first!r}: all adapters must "
                "share one base (pass base_model= to load them over another).")
    return first


def _same_folder(a: str, b: str) -> bool:
    """Whether two bases named are one local folder by other names (``base/``, a link, a relative path): PEFT
    loads the adapters over either."""
    try:
        return os.path.isdir(a) and os.path.samefile(a, b)
    except OSError:
        return False


def base_revision_of(configs: Sequence[dict | None], names: Sequence[str], base_model: str | None,
                     base_revision: str | None) -> str | None:
    """The revision to load the base at: ``base_revision``, else the one the adapters pin (PEFT's ``revision``, the
    base's, which ``AutoPeftModel`` loads it at; none for a base the caller names, ``base_model``). Adapters that pin
    different revisions, or of which some pin one and some do not (the default branch), are of different bases."""
    if base_model is not None or base_revision is not None:
        return base_revision
    pins = [(name, c.get("revision")) for name, c in zip(names, configs) if c is not None]
    other = next(((name, rev) for name, rev in pins if rev != pins[0][1]), None)
    if other is not None:
        def at(rev):
            return f"at revision {rev!r}" if rev else "at no revision (the default branch)"
        raise IncompatibleMembersError(
            f"{other[0]} is an adapter of its base {at(other[1])}, but {pins[0][0]} of it {at(pins[0][1])} (PEFT's "
            "revision): all adapters must share one base (pass base_revision= to load them over one).")
    return pins[0][1] if pins else None


def base_class(configs: Sequence[dict | None], base_config, name: str, folder=None,
               trust_remote_code: bool = False) -> type:
    """The transformers class to load the base with: the adapters' task type's, else the base's own (its own code in
    ``folder``, with ``trust_remote_code``)."""
    from .saving import model_class_for

    tasks = {c.get("task_type") for c in configs if c is not None}
    tasks.discard(None)
    if len(tasks) > 1:
        raise IncompatibleMembersError(f"The adapters are for different tasks: {sorted(tasks)}.")
    if tasks and tasks <= TASK_CLASSES.keys():
        for auto in TASK_CLASSES[tasks.pop()]:
            if type(base_config) in auto._model_mapping:
                return auto._model_mapping[type(base_config)]
    return model_class_for(base_config, name, folder, trust_remote_code)


def adapter_keys(folder: Path) -> list[str]:
    """The names of the tensors in an adapter's weights file (safetensors, or the pickle that
    :func:`hf_wide.adapter_checks.check_adapter_weights` let through, read with ``weights_only``)."""
    return list(adapter_shapes(folder))


def adapter_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors in an adapter's weights file, by name, read without their values."""
    path = folder / "adapter_model.safetensors"
    if path.is_file():
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    tensors = torch.load(folder / "adapter_model.bin", map_location="meta", weights_only=True)
    return {key: tuple(t.shape) for key, t in tensors.items()}


def embedding_tables(model: nn.Module) -> list[nn.Module]:
    """The model's input and output embeddings (transformers' ``get_input_embeddings``, ``get_output_embeddings``),
    those it has: none for a model without a vocabulary (of images, of audio)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):  # transformers raises for a model it finds no table in
            continue
        if module is not None and isinstance(getattr(module, "weight", None), torch.Tensor):
            found.append(module)
    return found


def grown_tables(folder: Path, base: nn.Module) -> dict[str, int]:
    """The base's embedding tables (input, and output where it is a table of its own) of which an adapter's file holds
    more rows than the base has, by name, with the rows: a vocabulary grown with ``resize_token_embeddings`` before
    training (tokens added), whose tables PEFT then saves whole (``save_embedding_layers``)."""
    tables = {id(m.weight) for m in embedding_tables(base)}
    names = {name: t for name, t in base.named_parameters() if id(t) in tables}
    grown = {}
    for key, shape in adapter_shapes(folder).items():
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if name in names and shape and shape[0] != names[name].shape[0]:
            grown[name] = shape[0]
    return grown


def held_by_every_adapter(folders: Sequence[Path], configs: Sequence[dict | None]) -> frozenset[str]:
    """The names in the base of the tensors whose values every member's adapter file holds (the head each saves
    whole, ``modules_to_save``), which the base's checkpoint may lack: a base saved for pre-training, loaded as a
    classifier, has a head drawn at random that no member computes with. None where a member is not an adapter (the
    base itself, or a full checkpoint, computes with its own)."""
    if any(c is None for c in configs):
        return frozenset()
    held = set.intersection(*(set(adapter_keys(Path(f))) for f in folders))
    return frozenset(key.removeprefix("base_model.model.") for key in held)


def head_labels(folders: Sequence[Path], configs: Sequence[dict | None], names: Sequence[str]) -> int | None:
    """The number of labels the adapters' saved heads (``modules_to_save``) were trained with, if they hold one;
    adapters whose heads have different numbers are refused, naming two (only the first adapter's was read, and a
    5-label and a 3-label adapter failed in transformers' load of the base)."""
    found = {}
    for name, folder, config in zip(names, folders, configs):
        labels = _saved_head_labels(Path(folder), config)
        if labels is not None:
            found.setdefault(labels, name)
    if len(found) > 1:
        (a, first), (b, second) = list(found.items())[:2]
        raise IncompatibleMembersError(f"The adapters' saved heads have different numbers of labels: {first} {a}, "
                                       f"{second} {b}. Fuse adapters of one head.")
    return next(iter(found), None)


def _saved_head_labels(folder: Path, config: dict | None) -> int | None:
    from safetensors import safe_open

    if config is None or not config.get("modules_to_save") or config.get("task_type") not in (
            "SEQ_CLS", "TOKEN_CLS", None):
        return None
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        return None
    with safe_open(path, "pt") as f:
        for key in f.keys():
            head = key.split(".")
            if key.endswith(".weight") and any(m in head for m in config["modules_to_save"]) and (
                    "out_proj" in head or head[-2] in config["modules_to_save"]):
                return f.get_slice(key).get_shape()[0]
    return None
