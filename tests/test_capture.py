"""``output_attentions`` and ``output_hidden_states`` of a folded model: member i's equal member i's alone,
whether the module that records them was fused, kept, or fell back per member."""

import pytest
import torch
from conftest import CASES, NUM_MEMBERS
from families import fall_back_attention_
from oracle import TOLERANCE
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention

from hf_wide import WideModel
from hf_wide.capture import is_capture_hook, asks_for_capture

CAPTURING = ["bert-seqcls", "roberta-seqcls", "distilbert-seqcls", "albert-seqcls", "electra-seqcls",
             "gpt2-causallm", "llama-causallm", "mistral-causallm", "qwen2-causallm", "phi3-causallm", "vit-imgcls"]
ASK = {"output_attentions": True, "output_hidden_states": True}


def eager_members(case_id: str) -> list[nn.Module]:
    members = [CASES[case_id].build(seed) for seed in range(NUM_MEMBERS)]
    for member in members:
        member.set_attn_implementation("eager")  # sdpa returns no attention weights
    return members


def capture_hooks(model: nn.Module) -> int:
    return sum(is_capture_hook(hook) for module in model.modules() for hook in module._forward_hooks.values())


@torch.no_grad()
def assert_outputs_equal_members(wide, members, inputs):
    got = wide(**inputs, **ASK)
    for i, member in enumerate(members):
        alone = member(**inputs, **ASK)
        for key in ("attentions", "hidden_states"):
            assert len(getattr(got, key)) == len(getattr(alone, key)) > 0, key
            for layer, (wide_t, member_t) in enumerate(zip(getattr(got, key), getattr(alone, key))):
                assert wide_t.shape[0] == len(members), (key, layer)
                assert (wide_t[i] - member_t).abs().max().item() <= TOLERANCE, (key, layer, i)


@pytest.mark.parametrize("case_id", CAPTURING)
def test_attentions_and_hidden_states_of_every_member(case_id):
    members = eager_members(case_id)
    wide = WideModel.from_models(members)
    assert_outputs_equal_members(wide, members, CASES[case_id].inputs(2, padded=True))


def test_members_that_recorded_before_fusion_and_the_members_copied_out():
    members = eager_members("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=True)
    with torch.no_grad():
        members[0](**inputs, **ASK)  # transformers hooks member 0's modules; fusion copies them
    wide = WideModel.from_models(members)
    assert capture_hooks(wide) == 0  # dropped: copies of them would sit inside the fused attentions
    assert_outputs_equal_members(wide, members, inputs)
    assert_outputs_equal_members(wide, [wide.member(i) for i in range(NUM_MEMBERS)], inputs)


def test_a_fallback_records_once_for_all_members():
    members = eager_members("llama-causallm")
    fall_back_attention_(members, 0, LlamaAttention)
    wide = WideModel.from_models(members)
    assert [e.fqn for e in wide.plan.fallbacks] == ["model.layers.0.self_attn"]
    assert_outputs_equal_members(wide, members, CASES["llama-causallm"].inputs(2, padded=True))


def test_hooks_only_once_asked():
    members = eager_members("bert-seqcls")
    wide = WideModel.from_models(members)
    inputs = CASES["bert-seqcls"].inputs(2, padded=True)
    with torch.no_grad():
        wide(**inputs)
        assert capture_hooks(wide) == 0  # a hooked module is slower to call
        wide(**inputs, output_attentions=True)
    assert capture_hooks(wide) > 0


def test_what_asks_for_capture():
    config = CASES["bert-seqcls"].make_config()
    assert not asks_for_capture({}, config)
    assert not asks_for_capture({"output_attentions": False, "output_hidden_states": None}, config)
    assert asks_for_capture({"output_hidden_states": 0}, config)  # an index, not a flag
    assert asks_for_capture({"output_attentions": True}, config)
    config.output_hidden_states = True
    assert asks_for_capture({}, config)
    assert not asks_for_capture({"output_hidden_states": False}, config)  # the argument wins
