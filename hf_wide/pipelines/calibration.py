"""Temperature scaling for the ensemble: one temperature, fitted on held-out data by NLL.

    t = calibrate(pipe, texts, labels)   # also sets pipe.temperature = t
    pipe("great movie")                  # probabilities from logits / t, combined as before

The members' logits are computed once (one wide forward per batch, the pipeline's own preprocessing);
the temperature then minimises the negative log-likelihood of ``labels`` under the ensemble's combined
probabilities (``pipe.combine``, ``pipe.weights``): a search over log-temperature, first on a grid, then
by golden section around the best grid point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import metrics
from .options import whole_number
from .classification import ClassificationPipeline
from .combine import Combine, combine, realign

GRID = torch.linspace(math.log(0.05), math.log(20.0), 41)  # log-temperatures tried first
GOLDEN_STEPS = 40


def calibrate(pipe: ClassificationPipeline, inputs: Sequence, labels: Sequence[int | str], *,
              batch_size: int | None = None) -> float:
    """Fit one temperature for ``pipe`` (text or image classification, single-label) on held-out
    ``inputs`` and their ``labels`` (label names, or indices in member 0's label order); set
    ``pipe.temperature`` to it and return it."""
    if not isinstance(pipe, ClassificationPipeline):
        raise TypeError(f"calibrate fits classification pipelines, got {type(pipe).__name__}.")
    if pipe.combine in (Combine.VOTE, Combine.NONE):
        raise ValueError(f"combine={pipe.combine.value!r} has no probabilities a temperature could scale.")
    if pipe._regressors():
        raise ValueError("calibrate fits a temperature to classifiers' probabilities; these members are regressors "
                         "(problem_type='regression').")
    if pipe._multi_label(pipe._defaults[1].get("multi_label")):  # the members' heads, or the pipeline's option
        raise ValueError("calibrate fits single-label classifiers; this pipeline is multi-label (its members', or "
                         "multi_label=True / function_to_apply='sigmoid'): a softmax temperature would squash its "
                         "sigmoids.")
    inputs, labels = list(inputs), list(labels)
    if not inputs or len(inputs) != len(labels):
        raise ValueError(f"calibrate needs one label per input and at least one input: got {len(inputs)} inputs "
                         f"and {len(labels)} labels.")
    targets = _label_indices(pipe, labels)
    size = pipe.batch_size if batch_size is None else whole_number("batch_size", batch_size)
    logits = _member_logits(pipe, inputs, size)  # (N, B, C)

    def loss(log_t: float) -> float:
        probs = combine(logits, pipe.combine, pipe.weights, False, math.exp(log_t))
        return float(metrics.nll(probs, targets))

    best = min(GRID.tolist(), key=loss)
    step = float(GRID[1] - GRID[0])
    log_t = _golden_section(loss, max(best - step, float(GRID[0])), min(best + step, float(GRID[-1])))
    pipe.temperature = math.exp(log_t)
    return pipe.temperature


def _label_indices(pipe: ClassificationPipeline, labels: list) -> torch.Tensor:
    names, _ = pipe.label_order()
    index = {name: i for i, name in enumerate(names)}
    out = []
    for label in labels:
        if isinstance(label, str):
            if label not in index:
                raise ValueError(f"Unknown label {label!r}: the members' labels are {names}.")
            out.append(index[label])
        elif isinstance(label, bool) or int(label) != label:  # 1.9 was read as 1
            raise ValueError(f"Labels are label names or whole label indices, got {label!r}.")
        elif not 0 <= int(label) < len(names):
            raise ValueError(f"Label index {label} out of range for {len(names)} labels.")
        else:
            out.append(int(label))
    return torch.tensor(out)


@torch.inference_mode()
def _member_logits(pipe: ClassificationPipeline, inputs: list, batch_size: int) -> torch.Tensor:
    """The members' logits ``(N, B, C)``, realigned to member 0's labels, on the CPU in float32."""
    _, permutations = pipe.label_order()
    features = [pipe.preprocess(item) for item in inputs]
    chunks = []
    for start in range(0, len(features), batch_size):
        batch = pipe.collate(features[start : start + batch_size])
        logits = pipe.model(**{k: v.to(pipe.device) for k, v in batch.items()}).logits
        chunks.append(realign(logits, permutations).float().cpu())
    return torch.cat(chunks, 1)


def _golden_section(f, low: float, high: float) -> float:
    """The minimum of a unimodal ``f`` on [low, high]."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = f(a), f(b)
    for _ in range(GOLDEN_STEPS):
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = f(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = f(b)
    return (low + high) / 2
