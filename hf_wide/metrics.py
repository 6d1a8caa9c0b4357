"""Ensemble metrics on member probabilities ``(N, B, C)``: combination, uncertainty and calibration.

All functions take and return tensors; nothing here moves data off the device.
"""

from __future__ import annotations

import torch

EPS = 1e-12


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dim: (..., C) -> (...)."""
    return -(probs * probs.clamp_min(EPS).log()).sum(-1)


def member_mean(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(N, ...) -> (...): the members' mean, or with ``weights`` (N,), summing to one, their weighted mean."""
    return x.mean(0) if weights is None else torch.tensordot(weights.to(x), x, dims=1)


def predictive_entropy(member_probs: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the ensemble mean: (N, B, C) -> (B,). Total uncertainty. ``weights``: see :func:`member_mean`."""
    return entropy(member_mean(member_probs, weights))


def expected_entropy(member_probs: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of the members' entropies: (N, B, C) -> (B,). Aleatoric part."""
    return member_mean(entropy(member_probs), weights)


def mutual_information(member_probs: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Predictive minus expected entropy: (N, B, C) -> (B,). Epistemic part: how much members disagree."""
    return (predictive_entropy(member_probs, weights) - expected_entropy(member_probs, weights)).clamp_min(0)


def vote_agreement(member_probs: torch.Tensor, labels: torch.Tensor | None = None,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Share of members (by weight) whose top class equals ``labels`` (default: the ensemble's): (N, B, C) -> (B,)."""
    if labels is None:
        labels = member_mean(member_probs, weights).argmax(-1)
    return member_mean((member_probs.argmax(-1) == labels).float(), weights)


def member_std(values: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(N, ...) -> (...): the members' standard deviation (over the members as they are, not a sample's estimate)."""
    return member_mean((values - member_mean(values, weights)).square(), weights).sqrt()


def uncertainty(member_probs: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The measures of a single-label answer: the members' probabilities (N, B, C) and the class chosen (B,) ->
    (B,) each. ``weights``: the members' in a weighted ensemble, which the measures weigh as its answer does (with
    weights [0, 0, 1], the answer is member 2's, and so is its uncertainty: no disagreement)."""
    mine = member_probs.gather(-1, chosen.view(1, -1, 1).expand(member_probs.shape[0], -1, 1)).squeeze(-1)  # (N, B)
    return {"predictive_entropy": predictive_entropy(member_probs, weights),
            "expected_entropy": expected_entropy(member_probs, weights),
            "mutual_information": mutual_information(member_probs, weights),
            "member_std": member_std(mine, weights),
            "agreement": vote_agreement(member_probs, chosen, weights)}


def nll(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``labels`` (B,) under ``probs`` (B, C)."""
    return -probs.gather(-1, labels[:, None]).clamp_min(EPS).log().mean()


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> torch.Tensor:
    """ECE with equal-width confidence bins: sum over bins of |accuracy - confidence| weighted by size."""
    confidence, predicted = probs.max(-1)
    correct = (predicted == labels).float()
    edges = torch.linspace(0, 1, bins + 1, device=probs.device)
    bin_index = torch.bucketize(confidence, edges[1:-1], right=True)  # (B,) in [0, bins)
    # Per bin, |sum of confidences - number correct| / B equals its size-weighted |confidence - accuracy|.
    conf_sum = torch.zeros(bins, device=probs.device).index_add_(0, bin_index, confidence)
    acc_sum = torch.zeros(bins, device=probs.device).index_add_(0, bin_index, correct)
    return (conf_sum - acc_sum).abs().sum() / probs.shape[0]
