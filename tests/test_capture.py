"""``output_attentions`` and ``output_hidden_states`` of a folded model: member i's equal member i's alone,
whether the module that records them was fused, kept, or fell back per member; what would be recorded inside a
module run per member is refused."""

import pytest
import torch
import transformers
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


def test_what_runs_inside_a_module_run_per_member_is_refused_not_left_out():
    members = eager_members("llama-causallm")
    for member in members:  # a hook: layer 0 runs as each member's own module, its attention inside it
        member.model.layers[0].register_forward_hook(lambda module, args, output: None)
    wide = WideModel.from_models(members)
    assert [e.fqn for e in wide.plan.fallbacks] == ["model.layers.0"]
    inputs = CASES["llama-causallm"].inputs(2, padded=True)
    with torch.no_grad():
        got = wide(**inputs, output_hidden_states=True)  # recorded by the layers themselves: there
        for i, member in enumerate(members):
            want = member(**inputs, output_hidden_states=True).hidden_states
            assert len(got.hidden_states) == len(want)
            for wide_t, member_t in zip(got.hidden_states, want):
                assert (wide_t[i] - member_t).abs().max().item() <= TOLERANCE
        # layer 0's attentions would be missing, and layer 1's would stand at index 0
        with pytest.raises(ValueError, match=r"attentions .*model\.layers\.0\.self_attn .*inside model\.layers\.0"):
            wide(**inputs, output_attentions=True)
        wide.config.output_attentions = True
        try:
            with pytest.raises(ValueError, match="output_attentions"):
                wide(**inputs)
            assert wide(**inputs, output_attentions=False).logits.shape[0] == NUM_MEMBERS
        finally:
            wide.config.output_attentions = False


def test_hidden_states_of_rows_flattened_from_the_batch_get_a_member_dim():
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)
    members = []
    for seed in range(NUM_MEMBERS):
        torch.manual_seed(seed)
        members.append(transformers.BertForMultipleChoice(config).eval())
    ids = torch.randint(1, 64, (2, 3, 7))  # (B, choices, T): the model's layers see B*3 rows
    wide = WideModel.from_models(members, {"input_ids": ids})
    with torch.no_grad():
        got = wide(input_ids=ids, output_hidden_states=True).hidden_states
        for i, member in enumerate(members):
            for wide_t, member_t in zip(got, member(input_ids=ids, output_hidden_states=True).hidden_states):
                assert wide_t.shape == (NUM_MEMBERS, *member_t.shape)  # (N, B*3, T, D), not (N*B*3, T, D)
                assert (wide_t[i] - member_t).abs().max().item() <= TOLERANCE
