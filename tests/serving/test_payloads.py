"""hf_wide/serving/payloads.py: the request's envelope and the parameter checks (through text classification's
format, and text generation's for the seed), without a server or a model."""

import pytest

from hf_wide.pipelines import Combine
from hf_wide.serving.payloads import MAX_INPUTS, BadRequest, read_json
from hf_wide.serving.tasks import TextClassification, TextGeneration


class Pipe:  # what TextClassification.setup reads of a pipeline
    combine = Combine.MEAN

    def label_order(self):
        return ["neg", "pos", "mixed"], None


@pytest.fixture
def fmt():
    fmt = TextClassification()
    fmt.setup(Pipe())
    return fmt


def test_a_text_and_a_list_of_texts(fmt):
    one = fmt.parse({"inputs": "great movie", "parameters": {"top_k": 2, "function_to_apply": "sigmoid"}})
    assert (one.items, one.single, one.options) == (["great movie"], True, {"top_k": 3, "truncation": False,
                                                             "function_to_apply": "sigmoid"})
    many = fmt.parse({"inputs": ["a", "b"], "options": {"wait_for_model": True}})
    assert (many.items, many.single, many.options) == (["a", "b"], False, {"top_k": 3, "truncation": False})


def test_text_pairs_as_transformers_takes_them(fmt):
    pair = {"text": "a cat sat", "text_pair": "an animal sat"}
    one = fmt.parse({"inputs": pair})
    assert (one.items, one.single) == ([pair], True)
    many = fmt.parse({"inputs": [pair, "just a text"]})
    assert (many.items, many.single) == ([pair, "just a text"], False)
    with pytest.raises(BadRequest, match=f"at most {MAX_INPUTS}"):
        fmt.parse({"inputs": [pair] * (MAX_INPUTS + 1)})


def test_the_answer_ranks_every_label_and_the_best_carries_the_extras(fmt):
    answer = {"label": "pos", "score": 0.6, "top_k": [{"label": "pos", "score": 0.6}, {"label": "neg", "score": 0.3},
                                                      {"label": "mixed", "score": 0.1}],
              "members": [{"label": "pos", "score": 0.7}], "uncertainty": {"agreement": 1.0}}
    request = fmt.parse({"inputs": "x", "parameters": {"top_k": 2}})
    (ranked,) = fmt.respond(request, [answer])
    assert [e["label"] for e in ranked] == ["pos", "neg"]
    assert ranked[0]["members"] == answer["members"] and "members" not in ranked[1]
    assert "members" not in answer["top_k"][0]  # the pipeline's answer is not written into


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not valid JSON"),
    (b'["a list"]', 400, "JSON object"),
    (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),  # was a RecursionError: 500
])
def test_bodies_that_are_not_a_json_object(body, status, says):
    with pytest.raises(BadRequest, match=says) as info:
        read_json(body)
    assert info.value.status == status


@pytest.mark.parametrize("payload, says", [
    ({}, 'no "inputs"'),
    ({"inputs": "x", "stream": True}, "Unknown field.*'stream'"),
    ({"inputs": 3}, "must be a text or a list of texts, got a number"),
    ({"inputs": []}, "got an empty list"),
    ({"inputs": ["ok", 5]}, r"item 1\) must be a text"),
    ({"inputs": "   "}, "empty text"),
    ({"inputs": {"text": "a", "pair": "b"}}, r"A text pair is .*got the keys \['pair', 'text'\]"),
    ({"inputs": {"text": "a", "text_pair": 3}}, '"text_pair" must be a text, got a number'),
    ({"inputs": ["x", {"text": "a", "text_pair": " "}]}, r'"text_pair" \(item 1\) is an empty text'),
    ({"inputs": [{"text": "a", "text_pair": "b"}, 4]}, r"item 1\) must be a text"),
    ({"inputs": "x", "parameters": {"temperature": 2}}, "Unknown parameter.*'temperature'.*known: function_to_apply, top_k"),
    ({"inputs": "x", "parameters": {"top_k": 0}}, "'top_k' must be a positive integer"),
    ({"inputs": "x", "parameters": {"top_k": True}}, "'top_k' must be a positive integer"),
    ({"inputs": "x", "parameters": {"function_to_apply": "relu"}}, "must be one of"),
    ({"inputs": "x", "parameters": [1]}, '"parameters" must be an object'),
    # falsy ones were taken for "no parameters"
    ({"inputs": "x", "parameters": []}, '"parameters" must be an object, got a list'),
    ({"inputs": "x", "parameters": 0}, '"parameters" must be an object, got a number'),
    ({"inputs": "x", "parameters": ""}, '"parameters" must be an object, got a text'),
    ({"inputs": "x", "parameters": False}, '"parameters" must be an object, got a boolean'),
])
def test_bad_requests_say_what_is_wrong(fmt, payload, says):
    with pytest.raises(BadRequest, match=says) as info:
        fmt.parse(payload)
    assert info.value.status == 422


def test_null_parameters_are_none(fmt):
    assert fmt.parse({"inputs": "x", "parameters": None}).options == fmt.parse({"inputs": "x"}).options


@pytest.mark.parametrize("seed, takes", [(0, True), (2**64 - 1, True), (2**64, False), (2**70, False), (-1, False),
                                         (1.5, False), (True, False), ("3", False)])
def test_a_seed_is_one_torch_takes(seed, takes):
    # 2**64 passed, and torch's "Overflow when unpacking long long" came back as the 422, naming no parameter
    payload = {"inputs": "x", "parameters": {"seed": seed, "do_sample": True}}
    if takes:
        assert TextGeneration().parse(payload).options["seed"] == seed
        return
    with pytest.raises(BadRequest, match=r"'seed'.* from 0 to 2\*\*64 - 1") as info:
        TextGeneration().parse(payload)
    assert info.value.status == 422


def test_too_many_texts_in_one_request(fmt):
    with pytest.raises(BadRequest, match=f"at most {MAX_INPUTS}") as info:
        fmt.parse({"inputs": ["x"] * (MAX_INPUTS + 1)})
    assert info.value.status == 413
