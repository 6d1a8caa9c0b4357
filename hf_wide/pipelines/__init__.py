"""Pipelines in the transformers style, on a WideModel: ``hf_wide.pipeline(task, model=...)``.

    pipe = pipeline("text-classification", model=["org/a", "org/b", "org/c"])
    pipe("great movie")   # {"label", "score", "members": [...], "uncertainty": {...}}
    calibrate(pipe, held_out_texts, labels)   # fits pipe.temperature by NLL

Tasks: text-classification, image-classification, token-classification, feature-extraction and
text-generation (per-member continuations, or ensemble decoding with ``combine=``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..model import WideModel
from .base import WidePipeline
from .calibration import calibrate
from .classification import ImageClassificationPipeline, TextClassificationPipeline
from .combine import Combine
from .feature_extraction import FeatureExtractionPipeline
from .loading import HUB_OPTIONS, load_named, load_preprocessors, preprocessor_sources
from .text_generation import TextGenerationPipeline
from .token_classification import TokenClassificationPipeline

TASKS: dict[str, type[WidePipeline]] = {
    "text-classification": TextClassificationPipeline,
    "image-classification": ImageClassificationPipeline,
    "token-classification": TokenClassificationPipeline,
    "feature-extraction": FeatureExtractionPipeline,
    "text-generation": TextGenerationPipeline,
}


def pipeline(
    task: str,
    model: WideModel | str | Sequence[str],
    *,
    tokenizer=None,
    image_processor=None,
    revision=None,
    token=None,
    dtype=None,
    torch_dtype=None,
    model_kwargs: dict | None = None,
    **kwargs,
) -> WidePipeline:
    """A pipeline for ``task`` on a WideModel, N member ids/folders, or a fused repo id.

    Options: ``combine`` (mean, logit_mean, vote, weighted, median, none), ``weights``, ``temperature``,
    ``device``, ``batch_size``, ``compile`` (True, or a dict of ``torch.compile`` options such as
    ``{"mode": "max-autotune"}``), ``buckets`` (what batches are padded to: "auto" is each batch's longest
    input, as the compiled wide model has dynamic shapes, and powers of two for static-shape compiles;
    "pow2"; a list of lengths; None), and the task's own (``top_k``, ...). ``model_kwargs`` go to
    :meth:`WideModel.from_pretrained` (``attn_implementation``, ``trust_remote_code``, ...), as in transformers;
    so does ``allow_label_mismatch`` (members whose ``id2label`` differ: the pipeline's answers realign their
    classes by name).
    """
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}: hf-wide has {', '.join(sorted(TASKS))}.")
    if "allow_label_mismatch" in kwargs:
        if isinstance(model, WideModel):
            raise ValueError("allow_label_mismatch applies to members the pipeline loads; this WideModel is fused "
                             "already (pass it to WideModel.from_pretrained instead).")
        model_kwargs = {**(model_kwargs or {}), "allow_label_mismatch": kwargs.pop("allow_label_mismatch")}
    from ..download import as_ids

    sources = None if isinstance(model, WideModel) else as_ids(model)  # ids: a folder may be a pathlib.Path
    wide = model if isinstance(model, WideModel) else WideModel.from_pretrained(
        sources, revision=revision, token=token, dtype=dtype if dtype is not None else torch_dtype,
        **(model_kwargs or {})
    )
    pipeline_class = TASKS[task]
    kind = "tokenizer" if task != "image-classification" else "image_processor"
    hub = {k: v for k, v in (model_kwargs or {}).items() if k in HUB_OPTIONS}
    if isinstance(tokenizer, (str, os.PathLike)):  # a repo id or folder, as transformers' pipeline takes it
        tokenizer = load_named(tokenizer, "tokenizer", token=token, **hub)
    if isinstance(image_processor, (str, os.PathLike)):
        image_processor = load_named(image_processor, "image_processor", token=token, **hub)
    if (tokenizer if kind == "tokenizer" else image_processor) is None:
        # a fused repo by its id: its own files; else each member's own (an adapter's base's, where it has none)
        subfolder = (model_kwargs or {}).get("subfolder")  # (a fused repo in a folder of its repo)
        found = load_preprocessors([(sources[0], revision, subfolder if isinstance(subfolder, str) else None)]
                                   if isinstance(model, (str, os.PathLike)) else
                                   preprocessor_sources(wide, kind, token=token, **hub), kind, token=token, **hub)
        tokenizer, image_processor = (found, None) if kind == "tokenizer" else (None, found)
    return pipeline_class(wide, tokenizer=tokenizer, image_processor=image_processor, **kwargs)


__all__ = ["Combine", "TASKS", "WidePipeline", "calibrate", "pipeline"]
