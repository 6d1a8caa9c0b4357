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


def test_weighted_measures_are_those_of_the_weighted_mixture():
    """With weights, the measures are the weighted ensemble's (its answer's): weights [0.25, 0.75] mix the members so,
    and a member weighted 0 counts for nothing (it counted as a full member: disagreement where the answer had none)."""
    w = torch.tensor([0.25, 0.75])
    mix = [0.25 * a + 0.75 * b for a, b in zip([0.7, 0.2, 0.1], [0.1, 0.6, 0.3])]
    expected = 0.25 * h([0.7, 0.2, 0.1]) + 0.75 * h([0.1, 0.6, 0.3])
    assert math.isclose(metrics.predictive_entropy(P, w).item(), h(mix), rel_tol=1e-6)
    assert math.isclose(metrics.expected_entropy(P, w).item(), expected, rel_tol=1e-6)
    assert math.isclose(metrics.mutual_information(P, w).item(), h(mix) - expected, rel_tol=1e-5)
    assert math.isclose(metrics.vote_agreement(P, weights=w).item(), 0.75, rel_tol=1e-6)  # the answer: class 1
    only = metrics.uncertainty(P, torch.tensor([1]), torch.tensor([0.0, 1.0]))
    assert only["mutual_information"].item() == 0.0 and only["member_std"].item() == 0.0
    assert only["agreement"].item() == 1.0
    assert math.isclose(only["predictive_entropy"].item(), h([0.1, 0.6, 0.3]), rel_tol=1e-6)
    plain = metrics.uncertainty(P, torch.tensor([0]))
    assert math.isclose(plain["member_std"].item(), 0.3, rel_tol=1e-6)  # 0.7 and 0.1: their spread as they are


def test_nll_and_ece():
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])
    labels = torch.tensor([0, 1, 1])
    assert math.isclose(metrics.nll(probs, labels).item(), -(math.log(0.9) + math.log(0.4) + math.log(0.8)) / 3,
                        rel_tol=1e-6)
    # 2 bins: [0, 0.5) empty; [0.5, 1]: confidences 0.9, 0.6, 0.8 (mean 0.7667), accuracy 2/3.
    ece = metrics.expected_calibration_error(probs, labels, bins=2).item()
    assert math.isclose(ece, abs((0.9 + 0.6 + 0.8) / 3 - 2 / 3), rel_tol=1e-5)
