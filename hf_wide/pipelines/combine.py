"""Combination rules: N members' scores for one input -> the ensemble's probabilities.

Every rule takes the members' logits ``(N, B, C)`` and returns ensemble probabilities ``(B, C)``, so the
answer, its score and the uncertainty measures are computed the same way whatever the rule. Multi-label
heads use independent sigmoids instead of a softmax (``multi_label=True``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import torch


class Combine(str, enum.Enum):
    MEAN = "mean"  # mean of the members' probabilities (the default)
    LOGIT_MEAN = "logit_mean"  # softmax of the mean logits
    VOTE = "vote"  # share of members voting for each class; ties broken by mean probability
    WEIGHTED = "weighted"  # weighted mean of probabilities, user weights per member
    MEDIAN = "median"  # median probability per class (the middle two's mean for an even N), renormalised
    NONE = "none"  # no ensemble answer: per-member results only

    @classmethod
    def parse(cls, value: "str | Combine") -> "Combine":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(c.value for c in cls)
            raise ValueError(f"Unknown combine rule {value!r}: choose one of {choices}.") from None


def member_probabilities(logits: torch.Tensor, multi_label: bool = False, temperature: float = 1.0) -> torch.Tensor:
    """(N, B, C) logits -> (N, B, C) probabilities (softmax, or sigmoid for multi-label heads)."""
    scaled = logits.float() / temperature
    return scaled.sigmoid() if multi_label else scaled.softmax(-1)


def check_weights(weights: Sequence[float] | torch.Tensor | None, num_members: int) -> torch.Tensor | None:
    if weights is None:
        return None
    w = torch.as_tensor(weights, dtype=torch.float32)
    if w.dim() != 1 or w.numel() != num_members:
        raise ValueError(f"weights must hold one number per member: got {tuple(w.shape)} for {num_members} members.")
    if not torch.isfinite(w).all():  # a NaN passed the checks below, and every score came back NaN
        raise ValueError(f"weights must be finite numbers, got {w.tolist()}.")
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be non-negative and not all zero.")
    return w / w.sum()


def member_median(x: torch.Tensor) -> torch.Tensor:
    """``(N, ...)`` -> ``(...)``: the members' median, for an even N the mean of the middle two (torch's
    ``median`` is the lower one: with two members, each class's smaller probability)."""
    ordered, n = x.sort(0).values, x.shape[0]  # (not quantile: it refuses inputs of over 16M elements)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _weighted_mean(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``(N, B, C)`` -> ``(B, C)``, each member's by its weight (normalised: :func:`check_weights`)."""
    if weights is None:
        raise ValueError("combine='weighted' needs weights=[one per member].")
    return torch.einsum("n,nbc->bc", weights.to(x.device), x)


def combine(
    logits: torch.Tensor,
    rule: Combine = Combine.MEAN,
    weights: torch.Tensor | None = None,
    multi_label: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The ensemble's probabilities ``(B, C)`` from the members' logits ``(N, B, C)``."""
    probs = member_probabilities(logits, multi_label, temperature)  # (N, B, C)
    if rule in (Combine.MEAN, Combine.NONE):
        return probs.mean(0)
    if rule == Combine.WEIGHTED:
        return _weighted_mean(probs, weights)
    if rule == Combine.LOGIT_MEAN:
        return member_probabilities(logits.float().mean(0), multi_label, temperature)
    if rule == Combine.MEDIAN:
        median = member_median(probs)
        return median if multi_label else median / median.sum(-1, keepdim=True)
    if rule == Combine.VOTE:
        if multi_label:  # each label on or off by majority
            return (probs > 0.5).float().mean(0)
        return torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).float().mean(0)  # (B, C) shares
    raise ValueError(f"Unknown combine rule {rule!r}")


def ranking(scores: torch.Tensor, member_probs: torch.Tensor) -> torch.Tensor:
    """Scores to sort classes by: the ensemble's, with ties (equal votes) broken by the mean probability.
    The nudge is far below one vote (1/N), so it never reorders classes whose scores differ; in float64, where
    float32 would round it away (a third of the votes plus 1e-6 x a 2% probability is a third, in float32)."""
    return scores.double() + 1e-6 * member_probs.double().mean(0)


def label_permutations(id2labels: Sequence[Mapping[int, str]]) -> list[torch.Tensor] | None:
    """For members whose ``id2label`` order differs from member 0's, the index map that realigns each
    member's classes onto member 0's by name; None when all agree. Refuses label sets that differ."""
    reference = {int(k): v for k, v in id2labels[0].items()}
    names = [reference[i] for i in range(len(reference))]
    if all({int(k): v for k, v in m.items()} == reference for m in id2labels):
        return None
    permutations = []
    for i, mapping in enumerate(id2labels):
        by_name = {v: int(k) for k, v in mapping.items()}
        if len(by_name) != len(mapping):  # one name twice: which of its classes is which cannot be told
            twice = sorted({v for v in mapping.values() if list(mapping.values()).count(v) > 1})
            raise ValueError(f"Member {i} names two classes {twice[0]!r} (id2label {dict(mapping)}): members whose "
                             "label orders differ are realigned by name, which needs every name once.")
        if set(by_name) != set(names):
            raise ValueError(
                f"Member {i}'s labels {sorted(by_name)} differ from member 0's {sorted(names)}: members must "
                "share one label set to be combined."
            )
        permutations.append(torch.tensor([by_name[name] for name in names]))
    return permutations


def realign(logits: torch.Tensor, permutations: list[torch.Tensor] | None) -> torch.Tensor:
    """(N, B, C) logits with every member's classes in member 0's order."""
    if permutations is None:
        return logits
    return torch.stack([member[:, perm.to(member.device)] for member, perm in zip(logits, permutations)])


def combine_values(values: torch.Tensor, rule: Combine = Combine.MEAN,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """The ensemble's values ``(B, C)`` from regressors' outputs ``(N, B, C)``: their mean (``logit_mean`` alike),
    weighted mean or median (the mean of the middle two for an even N). A vote has no labels to count."""
    values = values.float()
    if rule in (Combine.MEAN, Combine.LOGIT_MEAN, Combine.NONE):
        return values.mean(0)
    if rule == Combine.WEIGHTED:
        return _weighted_mean(values, weights)
    if rule == Combine.MEDIAN:
        return member_median(values)
    raise ValueError(f"combine={rule.value!r} counts the members' labels, and regressors' values have none: use "
                     "'mean', 'weighted' or 'median'.")

