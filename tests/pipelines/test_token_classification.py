"""Token classification: members equal transformers' own pipeline, the ensemble equals the combination
computed by hand from the members run alone, and bad input gives a clear error."""

import numpy as np
import pytest
import torch
import transformers
from text_members import bert_tokenizer, build_members, sentences

from hf_wide import WideModel
from hf_wide.pipelines import pipeline

LABELS = {0: "O", 1: "B-ENT", 2: "I-ENT"}
STRATEGIES = ["none", "simple", "first", "average", "max"]
TEXTS = sentences(4, seed=3) + ["alice flewing to parisly"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = bert_tokenizer(tmp_path_factory.mktemp("tok"))
    members = build_members("bert-tokcls", 3, LABELS)
    return tokenizer, members, WideModel.from_models(members)


def alone(member, tokenizer, text):
    """(T, C) probabilities of one member run on its own."""
    with torch.no_grad():
        return member(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)


def entropy(p):
    return -(p * np.log(np.clip(p, 1e-12, None))).sum(-1)


def assert_same_entities(ours, theirs):
    assert len(ours) == len(theirs), (ours, theirs)
    for a, b in zip(ours, theirs):
        assert set(a) - {"uncertainty"} == set(b)
        for key, value in b.items():
            assert a[key] == pytest.approx(float(value), abs=1e-5) if key == "score" else a[key] == value, key


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_members_equal_their_own_transformers_pipeline(setup, strategy):
    tokenizer, members, wide = setup
    results = pipeline("token-classification", model=wide, tokenizer=tokenizer, aggregation_strategy=strategy)(TEXTS)
    for i, member in enumerate(members):
        reference = transformers.pipeline("token-classification", model=member, tokenizer=tokenizer,
                                          aggregation_strategy=strategy)
        for text, result in zip(TEXTS, results):
            assert_same_entities(result["members"][i], reference(text))


def test_ensemble_tokens_are_the_members_mean_with_hand_computed_uncertainty(setup):
    tokenizer, members, wide = setup
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, ignore_labels=[])
    for text, result in zip(TEXTS, pipe(TEXTS, batch_size=2)):
        probs = np.stack([alone(m, tokenizer, text).numpy() for m in members])  # (N, T, C)
        mean = probs.mean(0)
        tokens = result["entities"]
        assert [t["index"] for t in tokens] == list(range(1, probs.shape[1] - 1))  # all but [CLS], [SEP]
        for token in tokens:
            p, m = probs[:, token["index"]], mean[token["index"]]
            chosen = int(m.argmax())
            assert token["entity"] == LABELS[chosen] and token["score"] == pytest.approx(m[chosen], abs=1e-6)
            u = token["uncertainty"]
            assert u["predictive_entropy"] == pytest.approx(entropy(m), abs=1e-5)
            assert u["expected_entropy"] == pytest.approx(entropy(p).mean(), abs=1e-5)
            assert u["mutual_information"] == pytest.approx(entropy(m) - entropy(p).mean(), abs=1e-5)
            assert u["member_std"] == pytest.approx(p[:, chosen].std(), abs=1e-6)
            assert u["agreement"] == pytest.approx((p.argmax(-1) == chosen).mean())


@pytest.mark.parametrize("rule", ["logit_mean", "vote", "weighted", "median"])
def test_combination_rules_apply_per_token(setup, rule):
    tokenizer, members, wide = setup
    weights = [0.5, 0.3, 0.2]
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, combine=rule,
                    weights=weights if rule == "weighted" else None, ignore_labels=[])
    text = TEXTS[0]
    with torch.no_grad():
        logits = torch.stack([m(**tokenizer(text, return_tensors="pt")).logits[0] for m in members])  # (N, T, C)
    probs = logits.softmax(-1)
    expected = {
        "logit_mean": logits.mean(0).softmax(-1),
        "vote": torch.nn.functional.one_hot(probs.argmax(-1), 3).float().mean(0),
        "weighted": torch.einsum("n,ntc->tc", torch.tensor(weights), probs),
        "median": probs.median(0).values / probs.median(0).values.sum(-1, keepdim=True),
    }[rule]
    ranked = expected.double() + 1e-6 * probs.double().mean(0)  # votes tie-broken by the mean probability
    for token in pipe(text)["entities"]:
        chosen = int(ranked[token["index"]].argmax())
        assert token["entity"] == LABELS[chosen]
        assert token["score"] == pytest.approx(float(expected[token["index"], chosen]), abs=1e-6)


def test_tied_votes_go_to_the_label_of_the_highest_mean_probability(setup):
    # Three members voting for three labels: a tie, which the mean probability breaks. Ranked in float32, the nudge
    # that breaks it rounded away and the first label won.
    tokenizer, members, wide = setup
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, combine="vote", ignore_labels=[])
    broken = 0
    for text, result in zip(TEXTS, pipe(TEXTS)):
        probs = np.stack([alone(m, tokenizer, text).numpy() for m in members])  # (N, T, C)
        for token in result["entities"]:
            p = probs[:, token["index"]]
            votes = np.bincount(p.argmax(-1), minlength=3)
            tied = np.flatnonzero(votes == votes.max())
            chosen = tied[p.mean(0)[tied].argmax()]
            assert token["entity"] == LABELS[chosen]
            assert token["uncertainty"]["member_std"] == pytest.approx(p[:, chosen].std(), abs=1e-6)
            broken += len(tied) > 1 and chosen != tied[0]
    assert broken  # the texts hold ties that the first label would lose


def test_a_word_takes_its_first_tokens_label_and_uncertainty(setup):
    tokenizer, _, wide = setup
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, ignore_labels=[])
    text = "alice flewing to parisly"  # flew ##ing, paris ##ly: words of two tokens
    tokens = {t["start"]: t for t in pipe(text)["entities"]}
    words = pipe(text, aggregation_strategy="first")["entities"]
    assert "".join(e["word"].replace(" ", "") for e in words) == text.replace(" ", "")
    # Every entity's uncertainty is the mean over its words, each its first token's.
    starts = [0, 6, 14, 17]  # the words' first characters
    for entity in words:
        inside = [tokens[s]["uncertainty"] for s in starts if entity["start"] <= s < entity["end"]]
        for key, value in entity["uncertainty"].items():
            assert value == pytest.approx(np.mean([u[key] for u in inside]), abs=1e-6)


@pytest.mark.parametrize("strategy", ["simple", "max"])
def test_bioes_labels_are_grouped_and_named_as_transformers_does(setup, strategy):
    # transformers names a group by its first label after the first "-", whatever the prefix (E-PER: PER), and groups
    # only B-/I- labels across tags: hf-wide named E-PER and S-LOC groups whole, and so kept them past
    # ignore_labels=["LOC"].
    tokenizer = setup[0]
    bioes = {0: "O", 1: "B-PER", 2: "E-PER", 3: "S-LOC", 4: "I-LOC"}
    members = build_members("bert-tokcls", 2, bioes)
    wide = WideModel.from_models(members)
    for ignore in (None, ["O", "LOC"]):
        options = {} if ignore is None else {"ignore_labels": ignore}
        results = pipeline("token-classification", model=wide, tokenizer=tokenizer, aggregation_strategy=strategy,
                           **options)(TEXTS)
        named = {e["entity_group"] for result in results for e in result["entities"]}
        assert named and not named & {"E-PER", "S-LOC"}
        for i, member in enumerate(members):
            reference = transformers.pipeline("token-classification", model=member, tokenizer=tokenizer,
                                              aggregation_strategy=strategy, **options)
            for text, result in zip(TEXTS, results):
                assert_same_entities(result["members"][i], reference(text))
    # one label given alone is that label (its characters were ignored instead, so every "O" entity stayed)
    one = pipeline("token-classification", model=wide, tokenizer=tokenizer, aggregation_strategy=strategy,
                   ignore_labels="O")
    assert one(TEXTS) == pipeline("token-classification", model=wide, tokenizer=tokenizer,
                                  aggregation_strategy=strategy, ignore_labels=["O"])(TEXTS)


def test_members_with_reordered_labels_are_realigned_by_name(setup, tmp_path):
    tokenizer, members, wide = setup
    swapped = build_members("bert-tokcls", 3, LABELS)
    order = [2, 0, 1]  # member 1 lists its labels in another order, with its head's rows to match
    with torch.no_grad():
        swapped[1].classifier.weight.copy_(swapped[1].classifier.weight[order])
        swapped[1].classifier.bias.copy_(swapped[1].classifier.bias[order])
    swapped[1].config.id2label = {i: LABELS[j] for i, j in enumerate(order)}
    swapped[1].config.label2id = {v: k for k, v in swapped[1].config.id2label.items()}
    realigned = WideModel.from_models(swapped, allow_label_mismatch=True)
    ours = pipeline("token-classification", model=realigned, tokenizer=tokenizer, ignore_labels=[])(TEXTS[0])
    plain = pipeline("token-classification", model=wide, tokenizer=tokenizer, ignore_labels=[])(TEXTS[0])
    assert [e["entity"] for e in ours["entities"]] == [e["entity"] for e in plain["entities"]]
    assert [e["score"] for e in ours["entities"]] == pytest.approx([e["score"] for e in plain["entities"]], abs=1e-6)


def test_combine_none_gives_each_members_entities_only(setup):
    tokenizer, _, wide = setup
    result = pipeline("token-classification", model=wide, tokenizer=tokenizer, combine="none")(TEXTS[0])
    assert set(result) == {"members"} and len(result["members"]) == 3


def test_long_texts_are_truncated_or_refused(setup):
    tokenizer, _, wide = setup
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, ignore_labels=[])
    text = " ".join(["cat"] * 100)  # 102 tokens with [CLS] and [SEP], over the 64 positions
    tokens = pipe(text)["entities"]
    assert len(tokens) == 62 and tokens[-1]["index"] == 62
    with pytest.raises(ValueError, match="over the model's maximum of 64"):
        pipe(text, truncation=False)


@pytest.mark.parametrize("inputs, options, error, match", [
    ("", {}, ValueError, "empty text"),
    ([], {}, ValueError, "empty list"),
    ("the cat", {"aggregation_strategy": "longest"}, ValueError, "Unknown aggregation_strategy"),
    ("the cat", {"colour": "red"}, TypeError, "unknown options: colour"),
])
def test_bad_input_is_refused_clearly(setup, inputs, options, error, match):
    tokenizer, _, wide = setup
    with pytest.raises(error, match=match):
        pipeline("token-classification", model=wide, tokenizer=tokenizer)(inputs, **options)


@pytest.mark.parametrize("options, match", [
    ({"combine": "average"}, "Unknown combine rule"),
    ({"combine": "weighted", "weights": [1.0, 2.0]}, "one number per member"),
])
def test_bad_options_are_refused_clearly(setup, options, match):
    tokenizer, _, wide = setup
    with pytest.raises(ValueError, match=match):
        pipeline("token-classification", model=wide, tokenizer=tokenizer, **options)
