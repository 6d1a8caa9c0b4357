"""compile=True: every task's pipeline runs the wide model under torch.compile and gives the eager results."""

import math

import pytest
import torch
import transformers
from conftest import CASES
from PIL import Image
from text_members import bert_tokenizer, build_members, decoder_tokenizer, sentences

from hf_wide import WideModel, pipeline

TEXTS = [*sentences(4, seed=21), sentences(1, seed=22, min_words=14, max_words=14)[0]]


def assert_same(a, b, path="result"):
    """Equal structure and strings; floats within 1e-5."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, abs_tol=1e-5), (path, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def eager_and_compiled(task, members, call, **options):
    """The task's results from the eager and the compiled pipeline, and the frames dynamo compiled."""
    results = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for compile in (False, True):
        pipe = pipeline(task, model=WideModel.from_models(members), compile=compile, **options)
        results.append(call(pipe))
    return results[0], results[1], torch._dynamo.utils.counters["frames"]["ok"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bert_tokenizer(tmp_path_factory.mktemp("tok"))


# Five texts in batches of 3 and 2, of different lengths: one graph. (A batch of one would compile a second, as torch
# gives size-1 dims a graph of their own: half a minute more of inductor for each task.)
@pytest.mark.parametrize("task, case, call", [
    ("text-classification", "bert-seqcls", lambda pipe: pipe(TEXTS, batch_size=3, top_k=2)),
    ("token-classification", "bert-tokcls", lambda pipe: pipe(TEXTS, batch_size=3)),
    ("feature-extraction", "bert-base", lambda pipe: pipe(TEXTS, batch_size=3)),
])
def test_text_tasks_compiled_equal_eager(tokenizer, task, case, call):
    eager, compiled, frames = eager_and_compiled(task, build_members(case, 3), call, tokenizer=tokenizer)
    assert frames > 0  # the compiled pipeline really ran dynamo's frames
    assert_same(compiled, eager)


def test_image_classification_compiled_equals_eager():
    processor = transformers.ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                                  image_std=[0.5] * 3)
    members = [CASES["vit-imgcls"].build(seed) for seed in range(3)]
    images = [Image.fromarray((torch.rand(20, 24, 3) * 255).byte().numpy()) for _ in range(3)]
    eager, compiled, frames = eager_and_compiled("image-classification", members, lambda pipe: pipe(images),
                                                 image_processor=processor)
    assert frames > 0
    assert_same(compiled, eager)


def test_ensemble_decoding_compiled_equals_eager(tmp_path):
    prompts = [sentences(1, seed=31, min_words=5, max_words=5)[0], sentences(1, seed=32, min_words=2, max_words=2)[0]]
    eager, compiled, frames = eager_and_compiled(
        "text-generation", build_members("llama-causallm", 3),
        lambda pipe: pipe(prompts, max_new_tokens=5, batch_size=2, return_full_text=False),
        tokenizer=decoder_tokenizer(tmp_path))
    assert frames > 0
    assert_same(compiled, eager)
    # The prefill, and one graph for every later step: the cache comes back from each with the same strides
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_one_graph_serves_every_length_and_batch_size(tokenizer):
    texts = [sentences(1, seed=40 + k, min_words=k, max_words=k)[0] for k in range(2, 30, 3)]  # 10 lengths
    pipe = pipeline("text-classification", model=WideModel.from_models(build_members("bert-seqcls", 2)),
                    tokenizer=tokenizer, compile={"backend": "eager"})
    assert pipe.buckets is None  # dynamic shapes: batches are padded to their longest text only
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for batch_size in (2, 4, 5):  # 10 texts: no batch of one (torch gives size-1 dims a graph of their own)
        pipe(texts, batch_size=batch_size)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("compile, buckets, expected", [
    (False, "auto", None),
    ({"backend": "eager"}, "auto", None),
    ({"backend": "eager", "dynamic": False}, "auto", "pow2"),
    (False, "pow2", "pow2"),
    (False, [16, 64], [16, 64]),
])
def test_length_buckets(tokenizer, compile, buckets, expected):
    members = build_members("bert-seqcls", 2)
    pipe = pipeline("text-classification", model=WideModel.from_models(members), tokenizer=tokenizer,
                    compile=compile, buckets=buckets)
    assert pipe.buckets == expected
    key = tuple(expected) if isinstance(expected, list) else expected
    padded = {None: [3, 9, 20, 99], "pow2": [8, 16, 32, 99], (16, 64): [16, 16, 64, 99]}[key]
    assert [pipe.bucket(n) for n in (3, 9, 20, 99)] == padded  # never past the model's 64 positions
    if not compile:  # padding changes no result
        plain = pipeline("text-classification", model=WideModel.from_models(members), tokenizer=tokenizer)
        assert_same(pipe(TEXTS, batch_size=2), plain(TEXTS, batch_size=2))
