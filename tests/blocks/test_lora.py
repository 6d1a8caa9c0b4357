"""WideLoraLinear (hf_wide/blocks/lora.py): PEFT LoRA members fused with from_models, each member against its
PeftModel run alone."""

import lora_members
import peft
import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error

from hf_wide import Kind, WideModel
from hf_wide.blocks import lora as lora_block

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


def test_members_with_their_own_biases_over_one_base_weight():
    """PEFT's ``bias="lora_only"`` trains the adapted layers' biases: the base's one weight, each member's bias."""
    bert = CASES["bert-seqcls"]
    base, inputs = bert.build(0), bert.inputs(3, padded=True)
    members = [lora_members.adapted(base, seed, task_type="SEQ_CLS", r=4, lora_alpha=8, bias="lora_only",
                                    target_modules=["query", "value", "dense"]) for seed in range(3)]
    lora_members.own_biases(members, 7)
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    lora = [e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    assert lora and not wide.plan.fallbacks
    for entry in lora:
        block = wide.model.get_submodule(entry.fqn)
        assert type(block.base_layer) is torch.nn.Linear and block.base_layer.bias is None
        assert block.base_bias.shape == (3, block.base_layer.out_features)
    for i, member in enumerate(members):
        got, want = wide.member(i).state_dict(), member.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_dropouts_that_differ_are_each_members_own():
    """A sweep over ``lora_dropout`` (the dropout modules differ: ``nn.Identity`` where it is 0) fuses, each member's
    dropout on its own rows in training; it ran member by member."""
    base = LLAMA.build(0)
    members = [adapted(base, seed, r=4, lora_alpha=8, lora_dropout=p, target_modules=EVERY_LINEAR)
               for seed, p in enumerate((0.0, 1.0))]
    wide = WideModel.from_models(members)
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(wide, members, inputs) <= TOLERANCE  # eval: no dropout
    lora = [e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    assert len(lora) == 2 * len(EVERY_LINEAR) and not wide.plan.fallbacks
    assert isinstance(wide.model.get_submodule(lora[0].fqn).lora_dropout, lora_block.MemberDropout)
    assert [type(wide.member(i).get_submodule(lora[0].fqn).lora_dropout["default"]).__name__ for i in (0, 1)] == [
        "Identity", "Dropout"]
    lora_members.check_own_dropouts(wide, members, inputs, TOLERANCE)


def test_scalings_that_differ_and_scalings_loaded_later():
    base, inputs = LLAMA.build(0), LLAMA.inputs(2, padded=True)
    targets = ["q_proj", "v_proj"]
    members = [adapted(base, seed, r=4, lora_alpha=alpha, target_modules=targets) for seed, alpha in ((0, 4), (1, 16))]
    wide = WideModel.from_models(members)  # each member's scaling on its rows
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    one = WideModel.from_models([adapted(base, seed, r=4, lora_alpha=8, target_modules=targets) for seed in (2, 3)])
    one(**inputs)  # one scaling for both members, as baddbmm's alpha
    one.load_state_dict(wide.state_dict())  # the differing scalings loaded into its buffers: they are read again
    assert max_member_error(one, members, inputs) <= TOLERANCE


def test_the_forward_calls_the_transformers_model_and_refuses_peft_routing(ranks_and_scalings):
    members = ranks_and_scalings
    wide = WideModel.from_models(members)
    inputs = LLAMA.inputs(2, padded=True)
    peft_forward = type(wide.model).forward
    try:  # PEFT's wrappers add nothing to a wide forward: its transformers model is called directly
        type(wide.model).forward = lambda *args, **kwargs: pytest.fail("PeftModel.forward was called")
        got = wide(**inputs, adapter_names=None).logits
    finally:
        type(wide.model).forward = peft_forward
    for i, member in enumerate(members):
        assert (got[i] - member(**inputs).logits).abs().max().item() <= TOLERANCE
    with pytest.raises(TypeError, match="adapter_names"):
        wide(**inputs, adapter_names=["default"] * 2)


def test_members_given_with_copy_shared_false_hold_views_of_the_stacked_adapters():
    base, inputs = LLAMA.build(0), LLAMA.inputs(2, padded=True)
    members = [adapted(base, seed, r=rank, lora_alpha=8, target_modules=["q_proj"]) for seed, rank in ((0, 2), (1, 4))]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in members]
    wide = WideModel.from_models(members, copy_shared=False)  # what loading adapters does: each tensor held once
    fqn = next(e.fqn for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear")
    block = wide.model.get_submodule(fqn)
    for i, member in enumerate(members):
        layer = member.get_submodule(fqn)
        for name in ("lora_A", "lora_B"):
            mine = layer.get_submodule(f"{name}.default").weight
            assert mine.untyped_storage().data_ptr() == getattr(block, name).untyped_storage().data_ptr()
        assert all(torch.equal(v, before[i][k]) for k, v in member.state_dict().items())
    assert max_member_error(wide, members, inputs) <= TOLERANCE


@pytest.mark.parametrize("case_id", ["llama-causallm", "bert-seqcls"])  # base layers without and with a bias
def test_many_rows_per_member_are_each_members_own_matmul(case_id):
    case = CASES[case_id]
    base = case.build(0)
    task = "CAUSAL_LM" if case is LLAMA else "SEQ_CLS"
    members = [lora_members.adapted(base, seed, task_type=task, r=rank, lora_alpha=alpha,
                                    target_modules=["q_proj", "query"] if case is LLAMA else ["query"])
               for seed, rank, alpha in ((0, 4, 8), (1, 8, 64))]  # scalings that differ
    wide = WideModel.from_models(members)
    fqn = next(e.fqn for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear")
    block = wide.model.get_submodule(fqn)
    x = torch.randn(2 * 2, 200, block.lora_A.shape[-1])  # (N*B, T, D): 400 rows per member
    with torch.no_grad():
        assert lora_block._per_member(x, 2) and not lora_block._per_member(x[:, :90], 2)
    for grad in (False, True):  # without autograd each member's rows apart; with it, one matmul for all
        with torch.set_grad_enabled(grad):
            got = block(x).view(2, 2, 200, -1)
            for i, member in enumerate(members):
                want = member.get_submodule(fqn)(x.view(2, 2, 200, -1)[i])
                assert (got[i] - want).abs().max().item() <= TOLERANCE


def test_members_with_their_own_base_weights_stack_the_base():
    members = [adapted(LLAMA.build(seed), seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
               for seed in range(3)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    block = wide.model.get_submodule(next(e.fqn for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"))
    assert block.base_layer.weight.shape[0] == 3  # a WideLinear
