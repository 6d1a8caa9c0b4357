"""Uncertainty and calibration measures against values computed by hand."""

import math

import torch

from hf_wide import metrics

# Two members, one input, three classes.
P = torch.tensor([[[0.7, 0.2, 0.1]], [[0.1, 0.6, 0.3]]])  # (N=2, B=1, C=3)


def h(ps):
    return -sum(p * math.log(p) for p in ps if p > 0)


def test_entropies_and_mutual_information():
    mean = [0.4, 0.4, 0.2]
    assert math.isclose(metrics.predictive_entropy(P).item(), h(mean), rel_tol=1e-6)
    expected = (h([0.7, 0.2, 0.1]) + h([0.1, 0.6, 0.3])) / 2
    assert math.isclose(metrics.expected_entropy(P).item(), expected, rel_tol=1e-6)
    assert math.isclose(metrics.mutual_information(P).item(), h(mean) - expected, rel_tol=1e-5)


def test_members_that_agree_have_no_mutual_information():
    same = torch.tensor([[[0.5, 0.5]], [[0.5, 0.5]]])
    assert metrics.mutual_information(same).item() == 0.0
    assert math.isclose(metrics.predictive_entropy(same).item(), math.log(2), rel_tol=1e-6)


def test_vote_agreement():
    votes = torch.tensor([[[0.9, 0.1]], [[0.8, 0.2]], [[0.3, 0.7]]])
    assert math.isclose(metrics.vote_agreement(votes).item(), 2 / 3, rel_tol=1e-6)
    assert math.isclose(metrics.vote_agreement(votes, torch.tensor([1])).item(), 1 / 3, rel_tol=1e-6)


def test_nll_and_ece():
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])
    labels = torch.tensor([0, 1, 1])
    assert math.isclose(metrics.nll(probs, labels).item(), -(math.log(0.9) + math.log(0.4) + math.log(0.8)) / 3,
                        rel_tol=1e-6)
    # 2 bins: [0, 0.5) empty; [0.5, 1]: confidences 0.9, 0.6, 0.8 (mean 0.7667), accuracy 2/3.
    ece = metrics.expected_calibration_error(probs, labels, bins=2).item()
    assert math.isclose(ece, abs((0.9 + 0.6 + 0.8) / 3 - 2 / 3), rel_tol=1e-5)
