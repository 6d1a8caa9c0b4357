"""WideLoraLinear (hf_wide/blocks/lora.py): PEFT LoRA members fused with from_models, each member against its
PeftModel run alone."""

import lora_members
import peft
import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error

from hf_wide import Kind, WideModel

LLAMA = CASES["llama-causallm"]
EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted(base, seed: int, **config) -> peft.PeftModel:
    return lora_members.adapted(base, seed, task_type="CAUSAL_LM", **config)


@pytest.fixture(scope="module")
def ranks_and_scalings():
    base = LLAMA.build(0)
    return [adapted(base, 0, r=4, lora_alpha=8, target_modules=EVERY_LINEAR),
            adapted(base, 1, r=8, lora_alpha=16, target_modules=EVERY_LINEAR),
            adapted(base, 2, r=16, lora_alpha=8, use_rslora=True, target_modules=EVERY_LINEAR)]


def test_ranks_alphas_and_rslora_that_differ_are_one_block_per_layer(ranks_and_scalings):
    members = ranks_and_scalings
    wide = WideModel.from_models(members)
    inputs = LLAMA.inputs(3, padded=True)
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    lora = [e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    assert len(lora) == 2 * len(EVERY_LINEAR) and all(e.kind == Kind.BLOCK for e in lora)
    assert not wide.plan.fallbacks
    block = wide.model.get_submodule(lora[0].fqn)
    assert type(block.base_layer) is torch.nn.Linear  # the base's one weight serves every member
    assert block.lora_A.shape[:2] == (3, 16) and block.scaling.tolist() == pytest.approx([2.0, 2.0, 2.0])
    tokens = wide.generate(**inputs, max_new_tokens=4, do_sample=False)
    for i, member in enumerate(members):
        assert torch.equal(tokens[i], member.generate(**inputs, max_new_tokens=4, do_sample=False))
        got, want = wide.member(i).state_dict(), member.state_dict()  # each member's own rank back
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_members_with_their_own_base_weights_stack_the_base():
    members = [adapted(LLAMA.build(seed), seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
               for seed in range(3)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    block = wide.model.get_submodule(next(e.fqn for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"))
    assert block.base_layer.weight.shape[0] == 3  # a WideLinear


def test_dora_is_declined_and_runs_as_each_members_own_code():
    base = LLAMA.build(0)
    members = [adapted(base, seed, r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"]) for seed in range(2)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert not any(e.wide_class == "WideLoraLinear" for e in wide.plan.entries.values())
    loops = {e.name: e.reason for e in wide.plan.loops}
    assert "lora_variant" in loops["base_model.model.model.layers.0.self_attn.q_proj"]  # DoRA: a variant
