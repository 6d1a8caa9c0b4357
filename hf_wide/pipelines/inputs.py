"""Turning one raw input (a text, an image) into model inputs, with clear errors on bad input."""

from __future__ import annotations

import os

import numpy as np
import torch

from .base import _max_length


# Model inputs, plus what a task may ask the tokenizer for (return_offsets_mapping=True, ...) to read its outputs.
TOKENIZER_KEYS = ("input_ids", "attention_mask", "token_type_ids", "offset_mapping", "special_tokens_mask")


def tokenize(tokenizer, model, text, truncation: bool = True, **kwargs) -> dict[str, torch.Tensor]:
    """One text -> ``input_ids`` and ``attention_mask`` of shape (1, T). Over-long texts are truncated to
    the model's maximum length, or refused with ``truncation=False``."""
    return tokenize_many(tokenizer, model, [text], truncation, **kwargs)[0]


def tokenize_many(tokenizer, model, texts, truncation: bool = True, text_pairs=None,
                  **kwargs) -> list[dict[str, torch.Tensor]]:
    """Many texts in one tokenizer call (a fast tokenizer batches them in Rust), each -> (1, T) tensors; with
    ``text_pairs``, each text with its pair (a premise and its hypothesis, say), as the tokenizer joins them."""
    if tokenizer is None:
        raise ValueError("This pipeline needs a tokenizer: pass tokenizer=, or load members that ship one.")
    for text in (*texts, *(text_pairs or ())):
        if not isinstance(text, str):
            raise TypeError(f"Expected a text (str), got {type(text).__name__}.")
        if not text.strip():
            raise ValueError("Got an empty text: there is nothing to classify.")
    limit = _max_length(tokenizer, model)
    pairs = () if text_pairs is None else (list(text_pairs),)
    encoded = tokenizer(list(texts), *pairs, truncation=truncation, max_length=limit if truncation else None, **kwargs)
    keys = [k for k in encoded if k in TOKENIZER_KEYS]
    features = []
    for row in range(len(texts)):
        length = len(encoded["input_ids"][row])
        if length > limit:
            raise ValueError(
                f"The text is {length} tokens long, over the model's maximum of {limit}; pass truncation=True to cut it."
            )
        features.append({k: torch.tensor([encoded[k][row]]) for k in keys})
    return features


def text_and_pair(item) -> tuple[str, str | None]:
    """A text-classification input: a text, or ``{"text": ..., "text_pair": ...}`` as transformers takes a pair."""
    if not isinstance(item, dict):
        return item, None
    unknown = sorted(set(item) - {"text", "text_pair"})
    if unknown or "text" not in item:
        raise TypeError(f"A text pair is a dict with 'text' and 'text_pair'; got the keys {sorted(item)}.")
    return item["text"], item.get("text_pair")


def load_image(image, channels: int):
    """A PIL image in the mode the model expects: ``L`` for 1 channel, ``RGB`` for 3, turned upright by its EXIF
    orientation tag (a phone's photo), as transformers' ``load_image`` turns it."""
    from PIL import Image, ImageOps

    if isinstance(image, (str, os.PathLike)):
        if not os.path.exists(image):
            raise FileNotFoundError(f"No image file at {image!s}.")
        image = Image.open(image)
    elif isinstance(image, np.ndarray):
        if image.ndim not in (2, 3):
            raise ValueError(f"An image array must be (H, W) or (H, W, C), got shape {image.shape}.")
        image = Image.fromarray(image.astype(np.uint8) if image.dtype != np.uint8 else image)
    elif not isinstance(image, Image.Image):
        raise TypeError(f"Expected a PIL image, an array or a path, got {type(image).__name__}.")
    image = ImageOps.exif_transpose(image)
    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise ValueError(f"The model expects {channels} channels; only 1 (L) and 3 (RGB) are supported.")
    if image.mode != mode:
        if image.mode in ("RGBA", "LA", "P") and mode == "L":
            image = image.convert("RGBA")
            background = Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, image)  # transparent strokes on white, as drawn
        image = image.convert(mode)
    return image
