"""Combination rules on hand-made logits, and label realignment by name."""

import pytest
import torch

from hf_wide.pipelines.combine import Combine, check_weights, combine, label_permutations, ranking, realign


def logits_of(probs):
    return torch.tensor(probs).log()  # softmax(log p) == p


PROBS = [[[0.6, 0.3, 0.1]], [[0.2, 0.5, 0.3]], [[0.1, 0.45, 0.45]]]  # (N=3, B=1, C=3)


@pytest.mark.parametrize(
    "rule, expected",
    [
        (Combine.MEAN, [0.3, 0.41666667, 0.28333333]),
        (Combine.MEDIAN, [x / (0.2 + 0.45 + 0.3) for x in (0.2, 0.45, 0.3)]),
        (Combine.VOTE, [1 / 3, 2 / 3, 0.0]),  # member votes: 0, 1, 1 (its tie goes to the first class)
    ],
)
def test_rules(rule, expected):
    got = combine(logits_of(PROBS), rule)[0]
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6)


def test_the_median_of_an_even_number_of_members_is_the_mean_of_the_middle_two():
    # torch's median is the lower middle value: with two members, each class's smaller probability
    got = combine(logits_of(PROBS[:2]), Combine.MEDIAN)[0]
    assert torch.allclose(got, torch.tensor([0.4, 0.4, 0.2]), atol=1e-6)  # the mean of two: (0.4, 0.4, 0.2) sums to 1
    four = PROBS + [[[0.3, 0.3, 0.4]]]
    middle = torch.tensor([(0.2 + 0.3) / 2, (0.3 + 0.45) / 2, (0.3 + 0.4) / 2])
    assert torch.allclose(combine(logits_of(four), Combine.MEDIAN)[0], middle / middle.sum(), atol=1e-6)


def test_logit_mean_is_softmax_of_mean_logits():
    logits = torch.tensor([[[2.0, 0.0]], [[0.0, 1.0]]])
    p = combine(logits, Combine.LOGIT_MEAN)[0]
    expected = torch.tensor([1.0, 0.5]).softmax(-1)
    assert torch.allclose(p, expected)


def test_weighted():
    w = check_weights([1, 0, 3], 3)
    got = combine(logits_of(PROBS), Combine.WEIGHTED, w)[0]
    expected = (0.25 * torch.tensor(PROBS[0][0]) + 0.75 * torch.tensor(PROBS[2][0]))
    assert torch.allclose(got, expected, atol=1e-6)


def test_vote_ties_are_broken_by_mean_probability():
    probs = torch.tensor([[[0.9, 0.1]], [[0.4, 0.6]]])  # one vote each; mean prob favours class 0
    scores = combine(probs.log(), Combine.VOTE)
    assert torch.allclose(scores, torch.tensor([[0.5, 0.5]]))
    assert ranking(scores, probs).argmax(-1).item() == 0


def test_bad_options():
    with pytest.raises(ValueError, match="Unknown combine rule 'avg'.*mean, logit_mean, vote"):
        Combine.parse("avg")
    with pytest.raises(ValueError, match="one number per member: got \\(2,\\) for 3"):
        check_weights([1, 2], 3)
    with pytest.raises(ValueError, match="non-negative"):
        check_weights([1, -1, 1], 3)
    for bad in (float("nan"), float("inf")):  # both passed, and every score came back NaN
        with pytest.raises(ValueError, match="finite"):
            check_weights([bad, 1, 1], 3)


def test_labels_realigned_by_name():
    id2labels = [{0: "neg", 1: "pos"}, {0: "pos", 1: "neg"}]
    permutations = label_permutations(id2labels)
    logits = torch.tensor([[[1.0, 2.0]], [[2.0, 1.0]]])  # both say "pos" is more likely
    aligned = realign(logits, permutations)
    assert torch.equal(aligned[1], torch.tensor([[1.0, 2.0]]))
    assert label_permutations([{0: "a", 1: "b"}] * 2) is None
    with pytest.raises(ValueError, match="Member 1's labels"):
        label_permutations([{0: "a", 1: "b"}, {0: "a", 1: "c"}])


def test_a_label_named_twice_cannot_be_realigned_by_name():
    """Realigned by name, member 1 below lost one class's logit and took another's twice (the same label set)."""
    with pytest.raises(ValueError, match="Member 0 names two classes 'x'"):
        label_permutations([{0: "x", 1: "x", 2: "y"}, {0: "y", 1: "x", 2: "x"}])


def test_vote_ties_are_broken_by_the_mean_probability_in_float32():
    # Three members, three different votes: a third each; the nudge (1e-6 x ~2%) is below float32's resolution there.
    member_probs = torch.tensor([[0.020, 0.021, 0.019], [0.020, 0.021, 0.019], [0.020, 0.021, 0.019]])
    scores = torch.full((3,), 1 / 3, dtype=torch.float32)
    assert ranking(scores, member_probs).argmax().item() == 1
