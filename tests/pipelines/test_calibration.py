"""calibrate(pipe, texts, labels): the fitted temperature minimises the held-out NLL computed by hand from
the members run alone, is set on the pipeline, and scales its probabilities."""

import math

import pytest
import torch
from text_members import bert_tokenizer, build_members, sentences

from hf_wide import WideModel
from hf_wide.pipelines import calibrate, pipeline

TEXTS = sentences(30, seed=21)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = bert_tokenizer(tmp_path_factory.mktemp("tok"))
    members = build_members("bert-seqcls", 3)
    with torch.no_grad():
        logits = torch.stack([torch.cat([m(**tokenizer(t, return_tensors="pt")).logits for t in TEXTS])
                              for m in members])  # (N, B, C), each member alone
    # Labels the ensemble mostly gets right: a finite best temperature.
    labels = logits.softmax(-1).mean(0).argmax(-1)
    labels[::4] = (labels[::4] + 1) % 3
    return tokenizer, WideModel.from_models(members), logits, labels.tolist()


def nll(logits, labels, temperature):
    probs = (logits / temperature).softmax(-1).mean(0)  # the mean rule
    return float(-probs[torch.arange(len(labels)), torch.tensor(labels)].log().mean())


def test_the_fitted_temperature_minimises_the_held_out_nll(setup):
    tokenizer, wide, logits, labels = setup
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer)
    temperature = calibrate(pipe, TEXTS, labels, batch_size=7)
    assert pipe.temperature == temperature
    grid = [math.exp(x / 20) for x in range(-60, 61)]  # 0.05 .. 20
    best = min(grid, key=lambda t: nll(logits, labels, t))
    assert nll(logits, labels, temperature) <= nll(logits, labels, best) + 1e-6
    assert temperature == pytest.approx(best, rel=0.06)


def test_the_pipeline_then_scales_the_members_logits(setup):
    tokenizer, wide, logits, labels = setup
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer)
    temperature = calibrate(pipe, TEXTS, labels)
    result = pipe(TEXTS[0])
    expected = (logits[:, 0] / temperature).softmax(-1)
    assert result["score"] == pytest.approx(float(expected.mean(0).max()), abs=1e-5)
    assert [m["score"] for m in result["members"]] == pytest.approx(expected.max(-1).values.tolist(), abs=1e-5)


def test_label_names_and_indices_give_the_same_temperature(setup):
    tokenizer, wide, _, labels = setup
    names = [wide.config.id2label[i] for i in labels]
    by_index = calibrate(pipeline("text-classification", model=wide, tokenizer=tokenizer), TEXTS, labels)
    by_name = calibrate(pipeline("text-classification", model=wide, tokenizer=tokenizer), TEXTS, names)
    assert by_index == pytest.approx(by_name)


@pytest.mark.parametrize("options, labels, error, match", [
    ({"combine": "vote"}, None, ValueError, "no probabilities"),
    ({}, [0, 1], ValueError, "one label per input"),
    ({}, ["LABEL_0"] * 29 + ["happy"], ValueError, "Unknown label 'happy'"),
    ({}, [0] * 29 + [3], ValueError, "out of range"),
])
def test_bad_calls_are_refused_clearly(setup, options, labels, error, match):
    tokenizer, wide, _, default = setup
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer, **options)
    with pytest.raises(error, match=match):
        calibrate(pipe, TEXTS, default if labels is None else labels)


def test_regressors_are_not_calibrated(setup):
    # a regressor's values have no probabilities: a temperature was fitted (the grid's edge) and never used
    import transformers

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=1,
                                     problem_type="regression")
    members = [transformers.BertForSequenceClassification(config).eval() for _ in range(2)]
    pipe = pipeline("text-classification", model=WideModel.from_models(members), tokenizer=setup[0])
    with pytest.raises(ValueError, match="these members are regressors"):
        calibrate(pipe, TEXTS[:3], [0, 0, 0])
    assert pipe.temperature == 1.0


def test_only_classification_pipelines_are_calibrated(setup):
    tokenizer, _, _, labels = setup
    pipe = pipeline("feature-extraction", model=WideModel.from_models(build_members("bert-base", 2)),
                    tokenizer=tokenizer)
    with pytest.raises(TypeError, match="classification pipelines"):
        calibrate(pipe, TEXTS, labels)


def test_a_sigmoid_pipeline_is_refused_as_multi_label_members_are(setup):
    """``function_to_apply="sigmoid"`` (or ``multi_label=True``) on single-label members: calibrate fitted a softmax
    temperature (19.9) that squashed every sigmoid answer to 0.5."""
    tokenizer, wide, _, labels = setup
    for option in ({"function_to_apply": "sigmoid"}, {"multi_label": True}):
        pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer, **option)
        with pytest.raises(ValueError, match="multi-label"):
            calibrate(pipe, TEXTS, labels)
        assert pipe.temperature == 1.0


def test_labels_that_are_no_whole_index_are_refused(setup):
    tokenizer, wide, _, labels = setup
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="whole label indices, got 1.9"):  # it was read as 1
        calibrate(pipe, TEXTS[:2], [1.9, 0])
