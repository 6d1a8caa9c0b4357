"""Feature extraction: members equal transformers' own pipeline, embeddings are mean-pooled over real
tokens only, the ensemble is the members' mean (weighted, median) computed by hand, and bad input is refused."""

import pytest
import torch
import transformers
from text_members import bert_tokenizer, build_members, sentences

from hf_wide import WideModel
from hf_wide.pipelines import pipeline

TEXTS = sentences(3, seed=7)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = bert_tokenizer(tmp_path_factory.mktemp("tok"))
    members = build_members("bert-base", 3)
    return tokenizer, members, WideModel.from_models(members)


def states(member, tokenizer, text):
    """(T, D) last hidden states of one member run on its own."""
    with torch.no_grad():
        out = member(**tokenizer(text, return_tensors="pt"), output_hidden_states=True)
    return out.hidden_states[-1][0]


def test_token_states_equal_each_members_transformers_pipeline(setup):
    tokenizer, members, wide = setup
    result = pipeline("feature-extraction", model=wide, tokenizer=tokenizer, pooling="none")(TEXTS[0])
    for i, member in enumerate(members):
        reference = transformers.pipeline("feature-extraction", model=member, tokenizer=tokenizer)(TEXTS[0])
        assert torch.tensor(result["members"][i]) == pytest.approx(torch.tensor(reference[0]), abs=1e-5)


def test_mean_pooled_embeddings_ignore_padding_and_average_the_members(setup):
    tokenizer, members, wide = setup
    pipe = pipeline("feature-extraction", model=wide, tokenizer=tokenizer)
    batched = pipe(TEXTS, batch_size=3)  # padded to the longest text and its bucket
    for text, result in zip(TEXTS, batched):
        expected = torch.stack([states(m, tokenizer, text).mean(0) for m in members])  # (N, D)
        assert torch.tensor(result["members"]) == pytest.approx(expected, abs=1e-5)
        assert torch.tensor(result["embedding"]) == pytest.approx(expected.mean(0), abs=1e-5)


@pytest.mark.parametrize("rule", ["weighted", "median"])
def test_other_rules_combine_the_members_embeddings(setup, rule):
    tokenizer, members, wide = setup
    weights = [0.6, 0.3, 0.1]
    result = pipeline("feature-extraction", model=wide, tokenizer=tokenizer, combine=rule,
                      weights=weights if rule == "weighted" else None)(TEXTS[1])
    pooled = torch.stack([states(m, tokenizer, TEXTS[1]).mean(0) for m in members])  # (N, D)
    if rule == "median":
        expected = pooled.median(0).values
    else:
        expected = torch.einsum("n,nd->d", torch.tensor(weights), pooled)
    assert torch.tensor(result["embedding"]) == pytest.approx(expected, abs=1e-5)


def test_the_median_of_two_members_is_their_mean(setup):
    tokenizer, members, _ = setup
    wide = WideModel.from_models(members[:2])
    result = pipeline("feature-extraction", model=wide, tokenizer=tokenizer, combine="median")(TEXTS[1])
    pooled = torch.stack([states(m, tokenizer, TEXTS[1]).mean(0) for m in members[:2]])  # (2, D)
    assert torch.tensor(result["embedding"]) == pytest.approx(pooled.mean(0), abs=1e-5)


def test_cls_pooling_and_normalisation(setup):
    tokenizer, members, wide = setup
    result = pipeline("feature-extraction", model=wide, tokenizer=tokenizer)(TEXTS[2], pooling="cls", normalize=True)
    first = torch.nn.functional.normalize(torch.stack([states(m, tokenizer, TEXTS[2])[0] for m in members]), dim=-1)
    assert torch.tensor(result["members"]) == pytest.approx(first, abs=1e-5)
    ensemble = torch.nn.functional.normalize(first.mean(0), dim=0)
    assert torch.tensor(result["embedding"]) == pytest.approx(ensemble, abs=1e-5)


def test_models_with_a_head_give_their_last_hidden_state(setup):
    tokenizer, _, _ = setup
    members = build_members("bert-seqcls", 2)
    result = pipeline("feature-extraction", model=WideModel.from_models(members), tokenizer=tokenizer)(TEXTS[0])
    expected = torch.stack([states(m, tokenizer, TEXTS[0]).mean(0) for m in members])
    assert torch.tensor(result["members"]) == pytest.approx(expected, abs=1e-5)


def test_combine_none_gives_members_only(setup):
    tokenizer, _, wide = setup
    result = pipeline("feature-extraction", model=wide, tokenizer=tokenizer, combine="none")(TEXTS[0])
    assert set(result) == {"members"} and len(result["members"]) == 3


def test_long_texts_are_truncated_or_refused(setup):
    tokenizer, members, wide = setup
    pipe = pipeline("feature-extraction", model=wide, tokenizer=tokenizer, pooling="none")
    text = " ".join(["dog"] * 80)
    assert len(pipe(text)["embedding"]) == 64
    with pytest.raises(ValueError, match="over the model's maximum of 64"):
        pipe(text, truncation=False)


@pytest.mark.parametrize("options, call, error, match", [
    ({}, {"inputs": ""}, ValueError, "empty text"),
    ({}, {"inputs": []}, ValueError, "empty list"),
    ({}, {"inputs": "a cat", "pooling": "max"}, ValueError, "Unknown pooling"),
    ({}, {"inputs": "a cat", "top_k": 2}, TypeError, "unknown options: top_k"),
    ({"combine": "vote"}, None, ValueError, "does not apply to embeddings"),
    ({"combine": "nope"}, None, ValueError, "Unknown combine rule"),
    ({"combine": "weighted", "weights": [1, 1]}, None, ValueError, "one number per member"),
    ({"temperature": 5.0}, None, ValueError, "embeddings have none"),  # (was silently dropped)
    ({"weights": [1, 0, 0]}, None, ValueError, "read by combine='weighted' only"),
])
def test_bad_input_is_refused_clearly(setup, options, call, error, match):
    tokenizer, _, wide = setup
    with pytest.raises(error, match=match):
        pipe = pipeline("feature-extraction", model=wide, tokenizer=tokenizer, **options)
        pipe(**call)
