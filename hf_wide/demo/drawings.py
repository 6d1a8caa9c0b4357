"""Digits as people draw them and as the members see them: a drawing (dark ink on white, any size) made into
the training data's 8x8 form, and held-out digits saved as drawings for the Space's examples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..model import WideModel
from .digits import FRAME, IMAGE_SIZE, STROKE, evaluate, load_digits_split, to_pixel_values

def to_digit_image(image):
    """A drawing, photo or scan of one digit as the training data shows digits: an 8x8 ``L`` image with
    bright ink on black, the digit centred and scaled to fill the height, strokes as thick as the data's.

    ``image``: a PIL image (any mode and size), an array or a path. Dark ink on a light ground (a
    sketchpad, paper) is inverted; which is ink is read from the border. Raises ValueError when blank."""
    from PIL import Image, ImageFilter

    from ..pipelines.inputs import load_image

    gray = np.asarray(load_image(image, 1), dtype=np.float32)  # (H, W), 0..255; transparency on white
    border = np.concatenate([gray[0], gray[-1], gray[:, 0], gray[:, -1]])
    if np.median(border) > 127:  # a light ground: dark ink
        gray, border = 255 - gray, 255 - border
    ink = np.clip(gray - np.median(border), 0, None)
    if ink.max() < 32:
        raise ValueError("The image is blank: draw or upload a digit.")
    mask = ink > 0.1 * ink.max()
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    ink = ink[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]  # cropped to the digit
    scale = FRAME / max(ink.shape)
    size = (max(1, round(ink.shape[1] * scale)), max(1, round(ink.shape[0] * scale)))  # (w, h)
    digit = Image.fromarray(ink * (255 / ink.max())).convert("L").resize(size, Image.BOX)
    # Stroke width from the ink's area and outline (a stroke of width w and length L: area wL, outline 2L).
    on = np.asarray(digit) > 64
    inner = np.asarray(Image.fromarray(on.astype(np.uint8) * 255).filter(ImageFilter.MinFilter(3))) > 0
    width = 2 * on.sum() / max((on & ~inner).sum(), 1)
    grow = round(STROKE * FRAME - width)
    if grow >= 1:
        digit = digit.filter(ImageFilter.MaxFilter(2 * ((grow + 1) // 2) + 1))
    canvas = Image.new("L", (FRAME, FRAME))
    canvas.paste(digit, ((FRAME - size[0]) // 2, (FRAME - size[1]) // 2))
    small = np.asarray(canvas.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BOX), dtype=np.float32)  # block means
    return Image.fromarray(np.round(small * (255 / max(small.max(), 1))).astype(np.uint8), mode="L")


def digit_drawing(image: torch.Tensor, size: int = 160):
    """A dataset digit (8, 8) uint8 as a person would draw it: dark ink on white, ``size`` pixels wide."""
    from PIL import Image

    return Image.fromarray(255 - image.numpy()).resize((size, size), Image.BICUBIC)


def example_digits(wide: WideModel, folder: str | Path, clear: int = 4, ambiguous: int = 4) -> list[tuple[Path, str]]:
    """Held-out digits saved as drawings (PNG) in ``folder``, with a caption each: ``clear`` ones the
    members agree on (distinct labels) and the ``ambiguous`` ones they disagree on most (highest mutual
    information)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _, (x_test, y_test) = load_digits_split()
    drawings = [digit_drawing(x) for x in x_test]
    # Chosen on what the members will see of the drawings, not on the dataset's own pixels.
    seen = torch.tensor(np.stack([np.asarray(to_digit_image(d)) for d in drawings]))  # (B, 8, 8) uint8
    report = evaluate(wide, to_pixel_values(seen), y_test)
    information = report["mutual_information"]
    correct = report["member_probs"].mean(0).argmax(-1) == y_test
    chosen, labels = [], set()
    for i in information.argsort().tolist():  # most certain first
        if correct[i] and y_test[i].item() not in labels and len(labels) < clear:
            labels.add(y_test[i].item())
            chosen.append((i, f"a clear {y_test[i].item()}"))
    for i in information.argsort(descending=True)[:ambiguous].tolist():
        chosen.append((i, f"ambiguous (written as {y_test[i].item()})"))
    examples = []
    for i, caption in chosen:
        path = folder / f"digit-{i}.png"
        drawings[i].save(path)
        examples.append((path, caption))
    return examples
