"""Property tests of the central oracle (hypothesis): for any N (1-9), batch (1-5), length, padding side, shared
or per-member inputs and float32 or bfloat16, member i of the wide model equals member i run alone. Three
families: a fused encoder (BERT), a fused decoder (Llama) and one that runs vectorised (the T5 encoder)."""

import functools

import torch
from conftest import CASES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import main_output

from hf_wide import PerMember, WideModel

FAMILIES = ["bert-seqcls", "llama-causallm", "t5-encoder"]
VOCAB = 100


@functools.lru_cache(maxsize=None)
def fused(case_id: str, n: int, dtype: torch.dtype):
    members = [CASES[case_id].build(seed).to(dtype) for seed in range(n)]
    return members, WideModel.from_models(members)


@st.composite
def calls(draw):
    case_id = draw(st.sampled_from(FAMILIES))
    n, batch, length = draw(st.integers(1, 9)), draw(st.integers(1, 5)), draw(st.integers(1, 12))
    per_member = draw(st.booleans())
    left = draw(st.booleans())
    ids = torch.tensor(draw(st.lists(st.integers(2, VOCAB - 1), min_size=n * batch * length,
                                     max_size=n * batch * length))).view(n, batch, length)
    real = draw(st.lists(st.integers(1, length), min_size=batch, max_size=batch))  # tokens kept per row
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row, count in enumerate(real):
        (mask[row, length - count:] if left else mask[row, :count]).fill_(1)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return case_id, n, ids if per_member else ids[:1].expand(n, -1, -1), per_member, mask, dtype


def tolerance(reference: torch.Tensor, dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-5
    return 2e-2 * max(1.0, reference.abs().max().item())  # bfloat16 keeps 8 bits of mantissa


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_member_i_equals_checkpoint_i(call):
    case_id, n, ids, per_member, mask, dtype = call
    members, wide = fused(case_id, n, dtype)
    shared = {"attention_mask": mask}
    inputs = {"input_ids": PerMember(ids) if per_member else ids[0], **shared}
    with torch.no_grad():
        out = main_output(wide(**inputs))  # (N, B, ...)
        for i, member in enumerate(members):
            alone = main_output(member(input_ids=ids[i], **shared))
            real = mask.bool() if alone.dim() == 3 else torch.ones(alone.shape[0], dtype=torch.bool)
            got, expected = out[i][real].float(), alone[real].float()
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() <= tolerance(expected, dtype), (case_id, i)
