"""hf_wide/pipelines/requests.py: many callers' requests in shared forwards, each answered as alone."""

import pytest
import torch
from text_members import bert_tokenizer, build_members, save_members, sentences

from hf_wide.pipelines import pipeline
from hf_wide.pipelines.requests import run_requests


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("requests")
    paths = save_members(root, build_members("bert-seqcls", 3), bert_tokenizer(root / "tok"))
    return pipeline("text-classification", model=paths, batch_size=4)


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == pytest.approx(b, abs=1e-6) if isinstance(a, float) else a == b


def test_each_request_is_answered_as_the_pipeline_answers_it_alone(pipe):
    texts = sentences(9, seed=3)
    requests = [(texts[:1], {}), (texts[1:4], {"top_k": 2}), (texts[4:6], {"multi_label": True}),
                ([texts[6]], {"top_k": 1, "multi_label": False}), (texts[7:], {})]
    answers = run_requests(pipe, requests)
    for (items, options), answer in zip(requests, answers):
        assert same(answer, pipe(items, **options))


def test_a_refused_request_gets_its_error_and_the_others_run(pipe):
    texts = sentences(3, seed=4)
    long_text = " ".join(["word"] * 2000)
    answers = run_requests(pipe, [([texts[0]], {}), (["  "], {}), ([long_text], {"truncation": False}),
                                  ([texts[1]], {"top_k": 0}), ([texts[2]], {"colour": "red"}), (texts[1:], {})])
    assert same(answers[0], pipe(texts[:1])) and same(answers[5], pipe(texts[1:]))
    assert isinstance(answers[1], ValueError) and "empty text" in str(answers[1])
    assert isinstance(answers[2], ValueError) and "maximum" in str(answers[2])
    assert isinstance(answers[3], ValueError) and isinstance(answers[4], TypeError)


def test_a_forward_that_fails_fails_only_the_request_it_came_from(pipe, monkeypatch):
    texts = sentences(4, seed=5)
    poison = pipe.tokenizer(texts[2])["input_ids"][1]  # a token of one request's text only
    assert all(poison not in pipe.tokenizer(t)["input_ids"] for t in texts[:2] + texts[3:])
    forward = pipe._forward

    def failing(batch, **options):
        if (batch["input_ids"] == poison).any():
            raise RuntimeError("the model broke")
        return forward(batch, **options)

    monkeypatch.setattr(pipe, "_forward", failing)
    answers = run_requests(pipe, [(texts[:2], {}), ([texts[2]], {}), (texts[3:], {})])  # one batch of 4
    assert isinstance(answers[1], RuntimeError)
    monkeypatch.setattr(pipe, "_forward", forward)
    assert same(answers[0], pipe(texts[:2])) and same(answers[2], pipe(texts[3:]))
