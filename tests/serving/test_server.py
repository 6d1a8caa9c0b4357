"""hf_wide/serving: the Ray Serve application on loopback, every task called with InferenceClient and raw HTTP,
against hf_wide.pipeline run on the same members. Text classification loads its members from the test Hub and
runs two replicas; the other tasks load local folders (text generation: LoRA adapters of one base). One Ray instance holds them all, each task an
application under its own route prefix."""

import base64
import concurrent.futures
import io
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))  # the text members
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test Hub

from answers import close  # noqa: E402
from hub_server import running_hub  # noqa: E402
from lora_members import adapted  # noqa: E402
from ports import free_port  # noqa: E402
from text_members import CASES, bert_tokenizer, build_members, decoder_tokenizer, save_members, sentences  # noqa: E402

pytest.importorskip("ray.serve")

from huggingface_hub import InferenceClient  # noqa: E402
from huggingface_hub.errors import HfHubHTTPError  # noqa: E402

from hf_wide.pipelines import pipeline  # noqa: E402
from hf_wide.serving import build_app, serve  # noqa: E402
from hf_wide.serving.app import app_builder  # noqa: E402

TAGS = {0: "O", 1: "B-ENT", 2: "I-ENT"}
SMALL = 0.25  # CPUs Ray reserves per replica: six replicas on a 2-core machine


def members_of(root: Path, task: str) -> list[str]:
    """Local member folders for ``task``, each with its tokenizer or image processor."""
    folder = root / task
    if task == "image-classification":
        processor = transformers.ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                                      image_std=[0.5] * 3)
        return save_members(folder, [CASES["vit-imgcls"].build(seed) for seed in range(3)], processor)
    if task == "text-generation":  # LoRA adapters of one base as the members (hf_wide/blocks/lora.py)
        tokenizer = decoder_tokenizer(folder / "tok")
        build_members("llama-causallm", 1)[0].save_pretrained(folder / "base")
        base = CASES["llama-causallm"].model_class.from_pretrained(folder / "base")  # the adapters name its folder
        paths = []
        for seed, rank in enumerate((4, 8, 8)):
            adapter = folder / f"adapter-{seed}"
            adapted(base, seed, scale=0.2, r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                    task_type="CAUSAL_LM").save_pretrained(adapter)
            tokenizer.save_pretrained(adapter)
            paths.append(str(adapter))
        return paths
    case, labels = {"token-classification": ("bert-tokcls", TAGS), "feature-extraction": ("bert-base", None)}[task]
    return save_members(folder, build_members(case, 3, labels), bert_tokenizer(folder / "tok"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """task -> (base URL, the pipeline on the same members in this process)."""
    import ray
    from ray import serve as ray_serve

    root = tmp_path_factory.mktemp("serve")
    with running_hub(root / "hub") as hub:  # before Ray starts: its workers inherit the Hub's environment
        ids = []
        folders = save_members(root / "tc", build_members("bert-seqcls", 3, id2label={0: "neg", 1: "pos", 2: "mixed"}),
                               bert_tokenizer(root / "tc" / "tok"))
        for i, folder in enumerate(folders):
            hub.publish(f"alice/tc-{i}", folder)
            ids.append(f"alice/tc-{i}")
        port = free_port()
        serve(ids, "text-classification", port=port, blocking=False, replicas=2, num_cpus=SMALL,
              max_batch_size=8, batch_wait_ms=20)
        try:
            url = f"http://127.0.0.1:{port}"
            found = {"text-classification": (url, pipeline("text-classification", model=ids))}
            apps = []  # deployed at once: their replicas start side by side
            for task in ("token-classification", "feature-extraction", "image-classification", "text-generation"):
                paths = members_of(root, task)
                if task == "feature-extraction":  # as `serve run hf_wide.serving.app:app_builder models=...` builds
                    # it, the members named as subfolders of one folder (a training run's checkpoints, say)
                    folder = str(Path(paths[0]).parent)
                    app = app_builder({"models": ",".join([folder] * len(paths)), "task": task,
                                       "subfolder": ",".join(Path(p).name for p in paths),
                                       "num_cpus": str(SMALL), "batch_wait_ms": "20"})
                else:
                    app = build_app(paths, task, num_cpus=SMALL, batch_wait_ms=20)
                apps.append(ray_serve.RunTarget(app, name=task, route_prefix=f"/{task}"))
                found[task] = (f"{url}/{task}", pipeline(task, model=paths))
            ray_serve.run_many(apps)
            yield found
        finally:
            ray_serve.shutdown()
            ray.shutdown()


def post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, object]:
    request = urllib.request.Request(url, data=body, headers={"content-type": content_type})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post_json(url: str, payload) -> tuple[int, object]:
    return post(url, json.dumps(payload).encode())


def ranked(pipe, item, top_k: int | None = None) -> list[tuple[str, float]]:
    answer = pipe(item, top_k=3)
    return [(e["label"], pytest.approx(e["score"], abs=1e-5)) for e in answer["top_k"][:top_k]]


def png(seed: int) -> bytes:
    pixels = (torch.rand(20, 24, 3, generator=torch.Generator().manual_seed(seed)) * 255).byte().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------- text classification (test Hub, two replicas)

def test_text_classification_inference_client_gets_the_ensembles_answer(servers):
    url, pipe = servers["text-classification"]
    client = InferenceClient(base_url=url)
    text = sentences(1, seed=7)[0]
    got = client.text_classification(text)
    assert [(e.label, e.score) for e in got] == ranked(pipe, text)
    assert len(client.text_classification(text, top_k=1)) == 1
    alone = pipe(text)
    # floats within 1e-5, as everywhere here: the replica's one torch thread sums in another order than this process
    assert close(got[0].members, alone["members"], 1e-5) and close(got[0].uncertainty, alone["uncertainty"], 1e-5)


def test_text_classification_raw_http_health_and_info(servers):
    url, pipe = servers["text-classification"]
    texts = sentences(3, seed=8)
    status, body = post_json(url + "/", {"inputs": texts, "parameters": {"top_k": 1}})
    assert status == 200 and len(body) == 3
    for text, answer in zip(texts, body):
        assert [(e["label"], e["score"]) for e in answer] == ranked(pipe, text, 1)
    with urllib.request.urlopen(url + "/health") as response:
        assert json.loads(response.read()) == {"status": "ok"}
    with urllib.request.urlopen(url + "/info") as response:
        info = json.loads(response.read())
    assert info["task"] == "text-classification" and info["members"] == [f"alice/tc-{i}" for i in range(3)]
    assert len(info["revisions"]) == 3 and all(len(r) == 40 for r in info["revisions"])  # commits on the test Hub


def test_routes_prefix_unknown_path_and_wrong_method(servers):
    url, pipe = servers["text-classification"]
    text = sentences(1, seed=9)[0]
    status, body = post_json(url, {"inputs": text})  # the route prefix itself, no slash (curl's way)
    assert status == 200 and [(e["label"], e["score"]) for e in body[0]] == ranked(pipe, text)
    status, body = post_json(url + "/nowhere", {"inputs": text})
    assert status == 404 and "GET /health" in body["error"]
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url + "/")  # a GET where a POST is wanted
    assert caught.value.code == 405 and caught.value.headers["Allow"] == "POST"
    assert json.loads(caught.value.read()) == {"error": "/ takes POST, not GET."}
    status, body = post_json(url + "/health", {})
    assert status == 405 and body == {"error": "/health takes GET, not POST."}


def test_text_pairs_over_raw_http(servers):
    url, pipe = servers["text-classification"]
    premise, hypothesis, text = sentences(3, seed=10)
    pair = {"text": premise, "text_pair": hypothesis}
    status, body = post_json(url + "/", {"inputs": pair})
    assert status == 200 and [(e["label"], e["score"]) for e in body[0]] == ranked(pipe, pair)
    status, body = post_json(url + "/", {"inputs": [text, pair], "parameters": {"top_k": 2}})  # one batch, both kinds
    assert status == 200 and [[(e["label"], e["score"]) for e in answer] for answer in body] == [
        ranked(pipe, text, 2), ranked(pipe, pair, 2)]
    assert abs(pipe(pair)["score"] - pipe(premise)["score"]) > 1e-4  # the pair was read as a pair


@pytest.mark.parametrize("body, status, says", [
    (b"{oops", 400, "not valid JSON"),
    (b'{"text": "x"}', 422, "Unknown field"),
    (b'{"inputs": 5}', 422, "must be a text"),
    (b'{"inputs": ""}', 422, "empty text"),
    (b'{"inputs": "x", "parameters": {"colour": 1}}', 422, "Unknown parameter"),
    (json.dumps({"inputs": " ".join(["word"] * 3000)}).encode(), 422, "maximum"),
])
def test_bad_input_is_a_4xx_that_says_why_and_the_server_keeps_serving(servers, body, status, says):
    url, _ = servers["text-classification"]
    code, answer = post(url + "/", body)
    assert code == status and says in answer["error"]
    ok, _ = post(url + "/", b'{"inputs": "still serving"}')
    assert ok == 200


def test_inference_client_raises_with_the_servers_message(servers):
    url, _ = servers["text-classification"]
    with pytest.raises(HfHubHTTPError, match="empty text"):
        InferenceClient(base_url=url).text_classification("   ")


def test_concurrent_requests_on_two_replicas_are_each_answered_exactly(servers):
    url, pipe = servers["text-classification"]
    texts = sentences(24, seed=9)
    bodies = [json.dumps({"inputs": t}).encode() if i % 5 else b'{"inputs": "  "}' for i, t in enumerate(texts)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda body: post(url + "/", body), bodies))
    for i, (text, (status, body)) in enumerate(zip(texts, results)):
        if i % 5 == 0:  # the bad ones fail alone
            assert status == 422
        else:
            assert status == 200 and [(e["label"], e["score"]) for e in body[0]] == ranked(pipe, text)


def test_the_example_client(servers, capsys):
    import runpy

    url, pipe = servers["text-classification"]
    main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "serve_client.py"))["main"]
    texts = sentences(2, seed=11)
    answers = main([*texts, "--url", url, "--top-k", "2"])
    for text, answer in zip(texts, answers):
        assert [(e.label, e.score) for e in answer] == ranked(pipe, text, 2)
    assert "members:" in capsys.readouterr().out


# ---------------------------------------------------------------- the other tasks (local folders)

def test_app_builder_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="unknown argument.*colour"):
        app_builder({"models": "a,b", "colour": "red"})
    with pytest.raises(ValueError, match="needs models="):
        app_builder({"task": "text-classification"})
    with pytest.raises(ValueError, match="combine='none' has none"):
        app_builder({"models": "a,b", "combine": "none"})


def test_token_classification(servers):
    url, pipe = servers["token-classification"]
    text, other = sentences(2, seed=12, min_words=5)
    got = InferenceClient(base_url=url).token_classification(text)
    alone = pipe(text, aggregation_strategy="simple")["entities"]
    assert [(e.entity_group, e.word, e.start, e.end) for e in got] == [
        (e["entity_group"], e["word"], e["start"], e["end"]) for e in alone]
    assert [e.score for e in got] == pytest.approx([e["score"] for e in alone], abs=1e-5)
    status, body = post_json(url, {"inputs": [other], "parameters": {"aggregation_strategy": "none",
                                                                     "return_members": True}})
    expected = pipe(other, aggregation_strategy="none")
    assert status == 200 and close(body, [{"entities": expected["entities"], "members": expected["members"]}], 1e-5)
    status, body = post_json(url, {"inputs": text, "parameters": {"stride": 16}})
    assert status == 422 and "'stride' is not supported" in body["error"]


def test_feature_extraction(servers):
    url, pipe = servers["feature-extraction"]
    texts = sentences(2, seed=13)
    got = InferenceClient(base_url=url).feature_extraction(texts[0], normalize=True)
    assert isinstance(got, np.ndarray) and got.shape == (1, pipe.model.config.hidden_size)
    assert got[0] == pytest.approx(np.array(pipe(texts[0], normalize=True)["embedding"]), abs=1e-5)
    status, body = post_json(url, {"inputs": texts, "parameters": {"return_members": True}})
    assert status == 200
    for text, embedding, members in zip(texts, body["embeddings"], body["members"]):
        alone = pipe(text)
        assert close(embedding, alone["embedding"], 1e-5) and close(members, alone["members"], 1e-5)
    status, body = post_json(url, {"inputs": texts[0], "prompt_name": "query"})
    assert status == 422 and "no prompts" in body["error"]


def test_image_classification(servers):
    url, pipe = servers["image-classification"]
    client = InferenceClient(base_url=url)
    image = png(0)
    got = client.image_classification(image)  # the bytes as the body
    alone = pipe(Image.open(io.BytesIO(image)), top_k=3)
    assert [(e.label, e.score) for e in got] == ranked(pipe, Image.open(io.BytesIO(image)))
    assert close(got[0].members, alone["members"], 1e-5)
    assert len(client.image_classification(image, top_k=1)) == 1  # parameters: base64 in JSON
    status, body = post(url, png(1), "image/png")
    assert status == 200 and [(e["label"], e["score"]) for e in body] == ranked(pipe, Image.open(io.BytesIO(png(1))))
    status, body = post(url, b"GIF89a but broken", "image/gif")
    assert status == 400 and "does not decode" in body["error"]
    status, body = post_json(url, {"inputs": base64.b64encode(b"no image").decode()})
    assert status == 400 and "does not decode" in body["error"]


def test_text_generation(servers):
    url, pipe = servers["text-generation"]
    client = InferenceClient(base_url=url)
    prompt, other = sentences(2, seed=14)
    got = client.text_generation(prompt, max_new_tokens=5)
    assert got == pipe(prompt, max_new_tokens=5, return_full_text=False)["generated_text"]
    with pytest.warns(UserWarning, match="not served via TGI"):  # TGI's details: the client drops them and asks again
        again = client.text_generation(prompt, max_new_tokens=5, details=True)
    assert again == got
    status, body = post_json(url, {"inputs": other, "parameters": {"max_new_tokens": 4, "return_members": True}})
    alone = pipe(other, max_new_tokens=4, return_members=True, return_full_text=False)
    assert status == 200 and body[0]["generated_text"] == alone["generated_text"]
    assert body[0]["members"] == alone["members"] and close(body[0]["uncertainty"], alone["uncertainty"], 1e-5)
    status, body = post_json(url, {"inputs": other, "parameters": {"max_new_tokens": 10 ** 6}})
    assert status == 422 and "leaves no room" in body["error"]
