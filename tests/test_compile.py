"""torch.compile: no graph breaks for the BERT, DeBERTa and Llama families, outputs equal to eager, and one
graph for every batch size > 1 and sequence length."""

import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, main_output
from torch._dynamo.testing import CompileCounter

from hf_wide import WideModel


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case_id", [
    "bert-seqcls", "roberta-tokcls", "deberta-v2-seqcls", "llama-causallm", "qwen2-causallm",
])
def test_no_graph_breaks(fused, case_id):
    _, wide = fused(case_id)
    inputs = CASES[case_id].inputs(2, padded=True)
    with torch.no_grad():
        explanation = torch._dynamo.explain(wide)(**inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("case_id", ["bert-seqcls", "llama-causallm"])
def test_lengths_and_batch_sizes_share_one_graph(case_id):
    case = CASES[case_id]
    members = [case.build(seed) for seed in range(2)]
    counter = CompileCounter()
    wide = WideModel.from_models(members).compile(backend=counter)
    with torch.no_grad():
        for batch, length in [(2, 5), (3, 9), (2, 16), (4, 11)]:
            ids = torch.randint(2, 100, (batch, length))
            out = main_output(wide(input_ids=ids, attention_mask=torch.ones_like(ids)))
            alone = main_output(members[1](input_ids=ids, attention_mask=torch.ones_like(ids)))
            assert (out[1] - alone).abs().max() <= TOLERANCE
    assert counter.frame_count == 1


def test_inductor_output_equals_eager():
    case = CASES["bert-seqcls"]
    members = [case.build(seed) for seed in range(3)]
    wide = WideModel.from_models(members)
    inputs = case.inputs(3, padded=True)
    with torch.no_grad():
        eager = wide(**inputs).logits
        compiled = wide.compile()(**inputs).logits
    assert (compiled - eager).abs().max() <= TOLERANCE
