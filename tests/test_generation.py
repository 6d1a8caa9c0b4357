"""hf_wide/generation.py: WideModel.generate gives each member's own continuation, and transformers' output with
every member's when asked (more cases: tests/test_architectures.py, tests/primitives/, tests/test_routers.py)."""

import pytest
import torch
from conftest import CASES, NUM_MEMBERS
from oracle import TOLERANCE


@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c].causal_lm])
def test_generate_gives_each_members_own_greedy_continuation(fused, case_id):
    members, wide = fused(case_id)
    inputs = CASES[case_id].inputs(2, padded=True)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = wide.generate(**inputs, **settings)
    assert out.shape[:2] == (NUM_MEMBERS, 2)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(**inputs, **settings))


@pytest.mark.parametrize("search", [{}, {"num_beams": 2, "num_return_sequences": 2}])
def test_generate_returns_each_members_scores_and_beams_as_transformers_does(fused, search):
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=True)
    settings = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                    output_scores=True, output_logits=True, **search)
    out = wide.generate(**inputs, **settings)
    rows = 2 * search.get("num_return_sequences", 1)
    assert out.sequences.shape[:2] == (NUM_MEMBERS, rows)
    for i, member in enumerate(members):
        alone = member.generate(**inputs, **settings)
        assert torch.equal(out.sequences[i], alone.sequences)
        for key in ("scores", "logits"):  # a step's: (N, B, V), member i's (B, V)
            assert len(out[key]) == len(alone[key]) == 4
            for step, want in zip(out[key], alone[key]):
                assert (step[i] - want).abs().max().item() <= TOLERANCE
        if search:  # the beams' rows are member i's own, as if it had run alone
            assert torch.equal(out.beam_indices[i], alone.beam_indices)
            assert (out.sequences_scores[i] - alone.sequences_scores).abs().max().item() <= TOLERANCE
