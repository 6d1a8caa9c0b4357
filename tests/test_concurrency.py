"""One wide model (and one pipeline object) called from several threads at once: every output equals the same
call made alone. The rows of a forward are per-call state (``Fold`` keeps them per thread); a wide model that
kept them on itself raised shape errors or mixed the threads' batches."""

import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import CASES
from lora_members import EVERY_LINEAR, adapted
from oracle import main_output

from hf_wide import PerMember, WideModel, pipeline

sys.path.insert(0, str(Path(__file__).parent / "pipelines"))
from text_members import bert_tokenizer, save_members, sentences  # noqa: E402

THREADS, CALLS = 8, 200
N = 3


def calls(case_id: str, count: int = 10):
    """Distinct calls: batch sizes 1-5, padded or not, shared inputs or each member its own."""
    case, rng = CASES[case_id], random.Random(0)
    made = []
    for k in range(count):
        batch, per_member = rng.randint(1, 5), k % 3 == 2
        inputs = case.inputs(batch, padded=k % 2 == 1, seed=k)
        if per_member:  # member i reads rows of its own
            others = [case.inputs(batch, padded=k % 2 == 1, seed=100 * k + i) for i in range(N)]
            inputs = {key: PerMember(torch.stack([o[key] for o in others])) for key in inputs}
        made.append(inputs)
    return made


def hammer(fn, jobs: list, expected: list):
    """THREADS threads, CALLS calls each, every call one of ``jobs`` (by index), checked against ``expected``."""

    def worker(seed: int) -> int:
        rng, bad = random.Random(seed), 0
        for _ in range(CALLS):
            k = rng.randrange(len(jobs))
            bad += not same(fn(jobs[k]), expected[k])
        return bad

    with ThreadPoolExecutor(THREADS) as pool:
        assert sum(pool.map(worker, range(THREADS))) == 0


def same(got, expected) -> bool:
    if isinstance(got, torch.Tensor):
        return got.shape == expected.shape and torch.allclose(got, expected, atol=1e-6, rtol=0)
    if isinstance(got, dict):
        return got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in got)
    if isinstance(got, (list, tuple)):
        return len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected))
    if isinstance(got, float):
        return abs(got - expected) <= 1e-6
    return got == expected


@pytest.mark.parametrize("case_id", ["bert-seqcls", "t5-encoder", "llama-causallm"])
def test_forward_from_threads_equals_each_call_alone(fused, case_id):
    _, wide = fused(case_id)
    jobs = calls(case_id)

    def run(inputs):
        with torch.no_grad():
            return main_output(wide(**inputs))

    hammer(run, jobs, [run(inputs) for inputs in jobs])


def test_generate_from_threads_equals_each_call_alone(fused):
    _, wide = fused("llama-causallm")
    jobs = calls("llama-causallm", count=6)

    def run(inputs):
        return wide.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)

    expected = [run(inputs) for inputs in jobs]
    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(run, [jobs[k % len(jobs)] for k in range(THREADS * 4)]))
    assert all(torch.equal(got, expected[k % len(jobs)]) for k, got in enumerate(results))


def test_one_pipeline_from_threads_equals_each_call_alone(tmp_path):
    tokenizer = bert_tokenizer(tmp_path / "tokenizer")
    models = [CASES["bert-seqcls"].build(seed) for seed in range(N)]
    pipe = pipeline("text-classification", model=WideModel.from_pretrained(save_members(tmp_path, models, tokenizer)))
    texts = sentences(40, seed=3)
    jobs = [texts[k : k + 1 + k % 5] for k in range(0, 40, 4)]  # 1 to 5 texts a call
    hammer(lambda job: pipe(job, batch_size=2), jobs, [pipe(job, batch_size=2) for job in jobs])


def test_lora_members_from_threads_equal_each_call_alone():
    """Adapters of one base (``WideLoraLinear``, ranks padded)."""
    base = CASES["llama-causallm"].build(0)
    wide = WideModel.from_models([adapted(base, seed, r=2 * (seed + 1), target_modules=EVERY_LINEAR)
                                  for seed in range(N)])
    assert any(e.wide_class == "WideLoraLinear" for e in wide.plan.entries.values())
    jobs = calls("llama-causallm")

    def run(inputs):
        with torch.no_grad():
            return main_output(wide(**inputs))

    hammer(run, jobs, [run(inputs) for inputs in jobs])
