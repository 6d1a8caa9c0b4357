"""hf_wide/serving: the Ray Serve application on loopback, called with InferenceClient and raw HTTP, against
hf_wide.pipeline run on the same members."""

import concurrent.futures
import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))  # the text members

from text_members import bert_tokenizer, build_members, save_members, sentences

pytest.importorskip("ray.serve")

from huggingface_hub import InferenceClient  # noqa: E402
from huggingface_hub.errors import HfHubHTTPError  # noqa: E402

from hf_wide.pipelines import pipeline  # noqa: E402
from hf_wide.serving import serve  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import ray
    from ray import serve as ray_serve

    root = tmp_path_factory.mktemp("serve")
    paths = save_members(root, build_members("bert-seqcls", 3, id2label={0: "neg", 1: "pos", 2: "mixed"}),
                         bert_tokenizer(root / "tok"))
    port = free_port()
    serve(paths, "text-classification", port=port, blocking=False, max_batch_size=8, batch_wait_ms=20)
    try:
        yield f"http://127.0.0.1:{port}", pipeline("text-classification", model=paths)
    finally:
        ray_serve.shutdown()
        ray.shutdown()


def post(url: str, body: bytes) -> tuple[int, object]:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def expected(pipe, text: str, top_k: int | None = None) -> list[tuple[str, float]]:
    answer = pipe(text, top_k=3)
    return [(e["label"], e["score"]) for e in answer["top_k"][:top_k]]


def test_inference_client_gets_the_ensembles_answer(server):
    url, pipe = server
    client = InferenceClient(base_url=url)
    text = sentences(1, seed=7)[0]
    got = client.text_classification(text)
    assert [(e.label, e.score) for e in got] == [(l, pytest.approx(s, abs=1e-6)) for l, s in expected(pipe, text)]
    assert len(client.text_classification(text, top_k=1)) == 1
    alone = pipe(text)
    assert got[0].members == alone["members"] and got[0].uncertainty == pytest.approx(alone["uncertainty"])


def test_raw_http_health_and_info(server):
    url, pipe = server
    texts = sentences(3, seed=8)
    status, body = post(url + "/", json.dumps({"inputs": texts, "parameters": {"top_k": 1}}).encode())
    assert status == 200 and len(body) == 3
    for text, ranked in zip(texts, body):
        assert [(e["label"], e["score"]) for e in ranked] == [
            (l, pytest.approx(s, abs=1e-6)) for l, s in expected(pipe, text, 1)]
    with urllib.request.urlopen(url + "/health") as response:
        assert json.loads(response.read()) == {"status": "ok"}
    with urllib.request.urlopen(url + "/info") as response:
        info = json.loads(response.read())
    assert info["task"] == "text-classification" and info["num_members"] == 3 and len(info["members"]) == 3


@pytest.mark.parametrize("body, status, says", [
    (b"{oops", 400, "not valid JSON"),
    (b'{"text": "x"}', 422, "Unknown field"),
    (b'{"inputs": 5}', 422, "must be a text"),
    (b'{"inputs": ""}', 422, "empty text"),
    (b'{"inputs": "x", "parameters": {"colour": 1}}', 422, "Unknown parameter"),
    (json.dumps({"inputs": " ".join(["word"] * 3000)}).encode(), 422, "maximum"),
])
def test_bad_input_is_a_4xx_that_says_why_and_the_server_keeps_serving(server, body, status, says):
    url, pipe = server
    code, answer = post(url + "/", body)
    assert code == status and says in answer["error"]
    ok, _ = post(url + "/", b'{"inputs": "still serving"}')
    assert ok == 200


def test_inference_client_raises_with_the_servers_message(server):
    url, _ = server
    with pytest.raises(HfHubHTTPError, match="empty text"):
        InferenceClient(base_url=url).text_classification("   ")


def test_concurrent_requests_are_each_answered_exactly(server):
    url, pipe = server
    texts = sentences(24, seed=9)
    bodies = [json.dumps({"inputs": t}).encode() if i % 5 else b'{"inputs": "  "}' for i, t in enumerate(texts)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda body: post(url + "/", body), bodies))
    for i, (text, (status, body)) in enumerate(zip(texts, results)):
        if i % 5 == 0:  # the bad ones fail alone
            assert status == 422
        else:
            assert status == 200
            assert [(e["label"], e["score"]) for e in body[0]] == [
                (l, pytest.approx(s, abs=1e-6)) for l, s in expected(pipe, text)]


def test_the_example_client(server, capsys):
    import runpy

    url, pipe = server
    main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "serve_client.py"))["main"]
    texts = sentences(2, seed=11)
    answers = main([*texts, "--url", url, "--top-k", "2"])
    for text, ranked in zip(texts, answers):
        assert [(e.label, e.score) for e in ranked] == [
            (l, pytest.approx(s, abs=1e-6)) for l, s in expected(pipe, text, 2)]
    assert "members:" in capsys.readouterr().out
