"""hf_wide/serving/tasks.py: every task's payloads, run in process through run_requests (what a server batch
runs) on tiny members, answered as the pipeline answers each input alone; bad input refused with what is wrong."""

import base64
import io
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))  # the text members
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shared helpers

from answers import close  # noqa: E402
from text_members import CASES, bert_tokenizer, build_members, decoder_tokenizer, sentences  # noqa: E402

from hf_wide import WideModel  # noqa: E402
from hf_wide.pipelines import pipeline  # noqa: E402
from hf_wide.pipelines.requests import run_requests  # noqa: E402
from hf_wide.serving.payloads import BadRequest  # noqa: E402
from hf_wide.serving.tasks import FORMATS, decode_image, task_format  # noqa: E402

TAGS = {0: "O", 1: "B-ENT", 2: "I-ENT"}


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    tok = bert_tokenizer(tmp_path_factory.mktemp("tok"))
    processor = transformers.ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                                  image_std=[0.5] * 3)

    def wide(case_id, labels=None):
        return WideModel.from_models(build_members(case_id, 3, labels))

    return {
        "text-classification": pipeline("text-classification", model=wide("bert-seqcls"), tokenizer=tok),
        "token-classification": pipeline("token-classification", model=wide("bert-tokcls", TAGS), tokenizer=tok),
        "feature-extraction": pipeline("feature-extraction", model=wide("bert-base"), tokenizer=tok),
        "image-classification": pipeline("image-classification", model=WideModel.from_models(
            [CASES["vit-imgcls"].build(seed) for seed in range(3)]), image_processor=processor),
        "text-generation": pipeline("text-generation", model=wide("llama-causallm"),
                                    tokenizer=decoder_tokenizer(tmp_path_factory.mktemp("dec"))),
    }


def serve_in_process(pipe, bodies: list, content_type: str = "application/json") -> list:
    """What a server's batch does with these request bodies: parse each, run them together, respond to each."""
    fmt = task_format(pipe.task, pipe)
    requests = [fmt.parse_body(body if isinstance(body, bytes) else json.dumps(body).encode(), content_type)
                for body in bodies]
    answers = run_requests(pipe, [(r.items, r.options) for r in requests])
    for answer in answers:
        if isinstance(answer, Exception):
            raise answer
    return [json.loads(json.dumps(fmt.respond(r, a))) for r, a in zip(requests, answers)]  # through JSON


def png(seed: int, mode: str = "RGB") -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(20, 24, 3, generator=generator) * 255).byte().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_inference_api_task_is_served():
    assert sorted(FORMATS) == ["feature-extraction", "image-classification", "text-classification",
                               "text-generation", "token-classification"]


def test_token_classification_entities_as_the_pipeline_alone(pipes):
    pipe = pipes["token-classification"]
    texts = sentences(3, seed=3, min_words=4)
    got = serve_in_process(pipe, [{"inputs": texts[0]}, {"inputs": texts[1:], "parameters": {
        "aggregation_strategy": "first", "ignore_labels": [], "return_members": True}}])
    assert close(got[0], pipe(texts[0], aggregation_strategy="simple")["entities"])  # the API's default
    for text, answer in zip(texts[1:], got[1]):
        alone = pipe(text, aggregation_strategy="first", ignore_labels=[])
        assert close(answer, {"entities": alone["entities"], "members": alone["members"]})
    assert got[0] and all("uncertainty" in e and "entity_group" in e for e in got[0])


def test_feature_extraction_embeddings_as_the_pipeline_alone(pipes):
    pipe = pipes["feature-extraction"]
    texts = sentences(3, seed=4)
    one, many, tokens = serve_in_process(pipe, [
        {"inputs": texts[0], "normalize": True},  # top level, as InferenceClient sends it
        {"inputs": texts, "parameters": {"return_members": True}},
        {"inputs": texts[1], "pooling": "none"}])
    assert one == [pytest.approx(pipe(texts[0], normalize=True)["embedding"], abs=1e-6)]
    for text, embedding, members in zip(texts, many["embeddings"], many["members"]):
        alone = pipe(text)
        assert embedding == pytest.approx(alone["embedding"], abs=1e-6)
        assert torch.tensor(members) == pytest.approx(torch.tensor(alone["members"]), abs=1e-6)
    assert torch.tensor(tokens[0]) == pytest.approx(torch.tensor(pipe(texts[1], pooling="none")["embedding"]),
                                                    abs=1e-6)


def test_image_classification_from_bytes_and_base64_as_the_pipeline_alone(pipes):
    pipe = pipes["image-classification"]
    raw, grey = png(0), png(1, "L")
    (from_bytes,) = serve_in_process(pipe, [raw], content_type="image/png")
    (from_json,) = serve_in_process(pipe, [{"inputs": base64.b64encode(grey).decode(),
                                            "parameters": {"top_k": 1}}])
    for answer, data, k in ((from_bytes, raw, None), (from_json, grey, 1)):
        alone = pipe(Image.open(io.BytesIO(data)), top_k=3)
        assert [(e["label"], e["score"]) for e in answer] == [
            (e["label"], pytest.approx(e["score"], abs=1e-6)) for e in alone["top_k"][:k]]
        assert close(answer[0]["members"], alone["members"])


def test_text_generation_as_the_pipeline_alone(pipes):
    pipe = pipes["text-generation"]
    prompts = sentences(3, seed=5)
    got = serve_in_process(pipe, [
        {"inputs": prompts[0], "parameters": {"max_new_tokens": 5}, "stream": False},
        {"inputs": prompts[1], "parameters": {"max_new_tokens": 5, "return_members": True, "return_full_text": True}},
        {"inputs": prompts[2], "parameters": {"max_new_tokens": 4, "do_sample": True, "seed": 3, "top_k": 5}},
        {"inputs": prompts[0], "parameters": {"max_new_tokens": 4, "do_sample": True, "seed": 3, "top_k": 5}}])
    expected = [pipe(prompts[0], max_new_tokens=5, return_full_text=False),
                pipe(prompts[1], max_new_tokens=5, return_members=True),
                pipe(prompts[2], max_new_tokens=4, do_sample=True, seed=3, top_k=5, return_full_text=False),
                pipe(prompts[0], max_new_tokens=4, do_sample=True, seed=3, top_k=5, return_full_text=False)]
    for (answer,), alone in zip(got, expected):
        assert answer["generated_text"] == alone["generated_text"]
        assert answer["uncertainty"] == pytest.approx(alone["uncertainty"], abs=1e-6)
        assert answer.get("members") == alone.get("members")
    assert got[1][0]["generated_text"].startswith(prompts[1]) and not got[0][0]["generated_text"].startswith(prompts[0])


def test_sampled_requests_do_not_share_a_forward(pipes):
    pipe = pipes["text-generation"]
    sampled = {"max_new_tokens": 3, "do_sample": True, "seed": 1}
    assert not pipe.batch_invariant(pipe.call_options(sampled)[1]) and pipe.batch_invariant({})


def test_regressors_values_as_they_are_with_function_to_apply_none(pipes):
    # transformers' own default for regressors (problem_type='regression'), which the pipeline takes for them: the
    # server refused it for every model, with a message about probabilities
    config = CASES["bert-seqcls"].make_config()
    config.num_labels, config.problem_type = 1, "regression"
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(transformers.BertForSequenceClassification(config).eval())
    pipe = pipeline("text-classification", model=WideModel.from_models(members),
                    tokenizer=pipes["text-classification"].tokenizer)
    text = sentences(1, seed=6)[0]
    (ranked,), = serve_in_process(pipe, [{"inputs": text, "parameters": {"function_to_apply": "none"}}])
    alone = pipe(text, function_to_apply="none")
    assert (ranked[0]["label"], ranked[0]["score"]) == (alone["label"], pytest.approx(alone["score"], abs=1e-6))
    assert close(ranked[0]["members"], alone["members"])


def test_raw_logits_of_classifiers_are_refused_by_the_pipeline(pipes):
    pipe = pipes["text-classification"]
    request = task_format(pipe.task, pipe).parse({"inputs": "a", "parameters": {"function_to_apply": "none"}})
    (answer,) = run_requests(pipe, [(request.items, request.options)])
    assert isinstance(answer, ValueError) and "no meaning for an ensemble" in str(answer)  # the server's 422


@pytest.mark.parametrize("task, body, status, says", [
    ("token-classification", {"inputs": "a", "parameters": {"stride": 8}}, 422, "'stride' is not supported"),
    ("token-classification", {"inputs": "a", "parameters": {"aggregation_strategy": "best"}}, 422, "must be one of"),
    ("token-classification", {"inputs": "a", "parameters": {"ignore_labels": "O"}}, 422, "list of texts"),
    ("feature-extraction", {"inputs": "a", "prompt_name": "query"}, 422, "no prompts"),
    ("feature-extraction", {"inputs": "a", "truncation_direction": "Left"}, 422, "cut at their end"),
    ("feature-extraction", {"inputs": "a", "dimensions": 8}, 422, "not shortened"),
    ("feature-extraction", {"inputs": "a", "normalize": "yes"}, 422, "true or false"),
    ("image-classification", {"inputs": "https://example.com/cat.png"}, 422, "does not fetch images"),
    ("image-classification", {"inputs": "not base64!"}, 400, "not an image in base64"),
    ("image-classification", {"inputs": 3}, 422, "base64"),
    ("text-generation", {"inputs": "a", "stream": True}, 400, r"model_kwargs` are not used by the model: \['stream'\]"),
    ("text-generation", {"inputs": "a", "parameters": {"details": True, "stop": ["x"]}}, 400,
     r"not used by the model: \['details', 'stop'\]"),
    ("text-generation", {"inputs": "a", "parameters": {"top_p": 1.5}}, 422, r"in \(0, 1\]"),
    ("text-generation", {"inputs": "a", "parameters": {"temperature": 0}}, 422, "positive number"),
])
def test_bad_requests_say_what_is_wrong(pipes, task, body, status, says):
    with pytest.raises(BadRequest, match=says) as info:
        task_format(task, pipes[task]).parse_body(json.dumps(body).encode())
    assert info.value.status == status


def test_tgi_parameters_that_ask_for_nothing_are_accepted(pipes):
    fmt = task_format("text-generation", pipes["text-generation"])
    request = fmt.parse({"inputs": "a", "parameters": {"details": False, "watermark": False}, "stream": False})
    assert request.options == {"truncation": False, "return_full_text": False}


@pytest.mark.parametrize("data, status, says", [
    (b"", 400, "no image"),
    (b"\x89PNG\r\n\x1a\n but not really", 400, "does not decode"),
])
def test_images_that_do_not_decode(data, status, says):
    with pytest.raises(BadRequest, match=says) as info:
        decode_image(data)
    assert info.value.status == status


def test_over_long_inputs_are_refused_by_the_pipeline(pipes):
    pipe = pipes["token-classification"]
    fmt = task_format(pipe.task, pipe)
    request = fmt.parse({"inputs": " ".join(["cat"] * 3000)})
    (answer,) = run_requests(pipe, [(request.items, request.options)])
    assert isinstance(answer, ValueError) and "maximum" in str(answer)
    # the pipeline's hint names its own option, which this task's requests do not take
    assert "truncation=True" in str(answer) and "truncation=True" not in fmt.refusal(str(answer))
    assert "shorten it" in fmt.refusal(str(answer))
    features = task_format("feature-extraction", pipes["feature-extraction"])
    assert "pass truncate=true to cut it" in features.refusal(str(answer))


def test_combine_none_is_refused_at_setup(pipes):
    pipe = pipeline("feature-extraction", model=pipes["feature-extraction"].model,
                    tokenizer=pipes["feature-extraction"].tokenizer, combine="none")
    with pytest.raises(ValueError, match="combine='none' has none"):
        task_format("feature-extraction", pipe)
