"""Ensemble metrics on member probabilities ``(N, B, C)``: combination, uncertainty and calibration.

All functions take and return tensors; nothing here moves data off the device.
"""

from __future__ import annotations

import torch

EPS = 1e-12


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dim: (..., C) -> (...)."""
    return -(probs * probs.clamp_min(EPS).log()).sum(-1)


def predictive_entropy(member_probs: torch.Tensor) -> torch.Tensor:
    """Entropy of the ensemble mean: (N, B, C) -> (B,). Total uncertainty."""
    return entropy(member_probs.mean(0))


def expected_entropy(member_probs: torch.Tensor) -> torch.Tensor:
    """Mean of the members' entropies: (N, B, C) -> (B,). Aleatoric part."""
    return entropy(member_probs).mean(0)


def mutual_information(member_probs: torch.Tensor) -> torch.Tensor:
    """Predictive minus expected entropy: (N, B, C) -> (B,). Epistemic part: how much members disagree."""
    return (predictive_entropy(member_probs) - expected_entropy(member_probs)).clamp_min(0)


def vote_agreement(member_probs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Share of members whose top class equals ``labels`` (default: the ensemble's): (N, B, C) -> (B,)."""
    if labels is None:
        labels = member_probs.mean(0).argmax(-1)
    return (member_probs.argmax(-1) == labels).float().mean(0)


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
