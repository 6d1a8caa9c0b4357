"""DoRA members (hf_wide/blocks/lora_dora.py): PEFT's ``use_dora=True`` adapters as one WideLoraLinear per layer,
each member against its PeftModel run alone; the magnitudes random too (PEFT starts them at the weight's norms)."""

import lora_members
import peft
import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error

from hf_wide import IncompatibleMembersError, WideModel

LLAMA, BERT, GPT2 = CASES["llama-causallm"], CASES["bert-seqcls"], CASES["gpt2-causallm"]


def dora(base, seed: int, **config) -> peft.PeftModel:
    return lora_members.adapted(base, seed, use_dora=True, **config)


def blocks(wide) -> list:
    return [wide.model.get_submodule(e.fqn) for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]


def test_ranks_alphas_and_rslora_that_differ_are_one_block_per_layer():
    base = LLAMA.build(0)
    members = [dora(base, 0, r=4, lora_alpha=8, target_modules=lora_members.EVERY_LINEAR),
               dora(base, 1, r=8, lora_alpha=16, target_modules=lora_members.EVERY_LINEAR),
               dora(base, 2, r=2, lora_alpha=8, use_rslora=True, target_modules=lora_members.EVERY_LINEAR)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert not wide.plan.loops and len(blocks(wide)) == 7 * LLAMA.make_config().num_hidden_layers
    assert all(block.magnitude.shape[0] == 3 for block in blocks(wide))
    for i, member in enumerate(members):  # member(i) is member i's PeftModel, magnitudes and all
        assert lora_members.lora_keys(wide.member(i)) == lora_members.lora_keys(member)
        with torch.no_grad():
            x = LLAMA.inputs(2, padded=True)
            assert (wide.member(i)(**x).logits - member(**x).logits).abs().max().item() <= TOLERANCE


def test_a_classifier_with_biases_and_a_saved_head():
    base = BERT.build(0)
    members = [dora(base, seed, r=4 * (seed + 1), lora_alpha=8, target_modules=["query", "value", "dense"],
                    modules_to_save=["classifier"], task_type="SEQ_CLS") for seed in range(3)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, BERT.inputs(3, padded=True)) <= TOLERANCE
    assert blocks(wide) and not wide.plan.loops


def test_members_with_their_own_biases_or_base_weights():
    base = LLAMA.build(0)
    biased = [dora(base, seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) for seed in range(2)]
    for member in biased:  # each with biases of its own on q and v (Llama's have none: given here)
        for name, module in member.named_modules():
            if name.endswith(("q_proj.base_layer", "v_proj.base_layer")):
                module.bias = torch.nn.Parameter(0.1 * torch.randn(module.out_features))
    apart = [dora(LLAMA.build(seed), seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
             for seed in range(2)]
    apart_with_biases = [dora(BERT.build(seed), seed, r=4, lora_alpha=8, target_modules=["query", "value"],
                              task_type="SEQ_CLS") for seed in range(2)]
    for case, members in ((LLAMA, biased), (LLAMA, apart), (BERT, apart_with_biases)):
        wide = WideModel.from_models(members)
        assert max_member_error(wide, members, case.inputs(2, padded=True)) <= TOLERANCE
        assert blocks(wide) and not wide.plan.loops


def test_the_norms_follow_the_adapters_when_they_change():
    base = LLAMA.build(0)
    members = [dora(base, seed, r=4, lora_alpha=8, target_modules=["q_proj"]) for seed in range(2)]
    wide = WideModel.from_models(members)
    x = LLAMA.inputs(2, padded=True)
    with torch.no_grad():
        wide(**x)  # the norms computed, and kept
        for block in blocks(wide):
            block.lora_B.mul_(3.0)  # in place: a new version, as an optimiser's step leaves it
        got = wide(**x).logits
        for i in range(2):  # member(i) runs PEFT's own DoRA layer over the same tensors
            assert (got[i] - wide.member(i)(**x).logits).abs().max().item() <= TOLERANCE
        assert (got[0] - members[0](**x).logits).abs().max().item() > 1e-3  # the change mattered


def test_a_forward_with_gradients_computes_the_norms_of_weights_stepped_through_data():
    # A training loop that steps through p.data (no version counter sees it) read norms kept from before its steps:
    # 2.4 off member(i) after a write, 2.6% off the PeftModels trained alone after three steps
    base = LLAMA.build(0)
    members = [dora(base, seed, r=4, lora_alpha=8, target_modules=["q_proj"]) for seed in range(2)]
    wide = WideModel.from_models(members)
    x = LLAMA.inputs(2, padded=True)
    wide(**x)  # (with gradients: computed, as PEFT computes them in training)
    with torch.no_grad():
        wide(**x)  # computed, and kept for inference
    for block in blocks(wide):
        block.lora_B.data.mul_(3.0)
    got = wide(**x).logits.detach()
    with torch.no_grad():
        for i in range(2):
            assert (got[i] - wide.member(i)(**x).logits).abs().max().item() <= TOLERANCE
        for block in blocks(wide):  # a step through .data after that training forward, then an evaluation
            block.lora_A.data.mul_(0.5)
        got = wide(**x).logits
        for i in range(2):
            assert (got[i] - wide.member(i)(**x).logits).abs().max().item() <= TOLERANCE


def test_dropouts_in_training():
    base = LLAMA.build(0)
    members = [dora(base, seed, r=4, lora_alpha=8, lora_dropout=p, target_modules=["q_proj", "v_proj"])
               for seed, p in enumerate((0.0, 1.0))]
    wide = WideModel.from_models(members)
    lora_members.check_own_dropouts(wide, members, LLAMA.inputs(2, padded=True), TOLERANCE)


def test_targets_that_differ_are_given_dora_no_ops():
    """A member without an adapter on a layer that others adapt with DoRA gets a DoRA layer whose update is zero and
    whose magnitude is the base weight's norms: each output scaled by exactly 1."""
    base = LLAMA.build(0)
    members = [dora(base, seed, r=4, lora_alpha=8, target_modules=t)
               for seed, t in enumerate([["q_proj"], ["q_proj", "v_proj"], ["v_proj", "down_proj"]])]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert blocks(wide) and not wide.plan.loops
    for i, member in enumerate(members):  # the no-ops are taken out again
        assert lora_members.lora_keys(wide.member(i)) == lora_members.lora_keys(member)


def test_the_base_beside_dora_adapters(tmp_path):
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    LLAMA.build(0).save_pretrained(base_dir)
    # init_lora_weights=False: the base's own DoRA layers start with a random B, and with a magnitude from it
    adapter = lora_members.save_adapter(LLAMA, base_dir, tmp_path / "a", 0, r=4, lora_alpha=8, use_dora=True,
                                        init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                                        task_type="CAUSAL_LM")
    wide = WideModel.from_pretrained([str(base_dir), adapter])
    references = [LLAMA.model_class.from_pretrained(base_dir).eval(), lora_members.alone(LLAMA, base_dir, adapter)]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE


@pytest.mark.parametrize("plain_targets", [["q_proj", "v_proj"], ["q_proj"]], ids=["padded", "alike"])
def test_dora_and_plain_lora_on_one_layer_are_refused(plain_targets):
    base = LLAMA.build(0)
    members = [dora(base, 0, r=4, lora_alpha=8, target_modules=["q_proj"]),
               lora_members.adapted(base, 1, r=4, lora_alpha=8, target_modules=plain_targets)]
    refusal = r"Member 0's LoRA on .*q_proj is DoRA.*member 1's is not.*merge"
    with pytest.raises(IncompatibleMembersError, match=refusal):
        WideModel.from_models(members)


def test_over_gpt2s_conv1d():
    """GPT-2's Conv1D holds its weight as (D_in, D_out), which PEFT transposes for the norms."""
    base = GPT2.build(0)
    members = [dora(base, seed, r=4 + seed, lora_alpha=8, target_modules=["c_attn", "c_fc"]) for seed in range(2)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, GPT2.inputs(2, padded=True)) <= TOLERANCE
    assert blocks(wide) and not wide.plan.loops


def test_adapters_from_the_hub_and_back(tmp_path):
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    BERT.build(0).save_pretrained(base_dir)
    adapters = [lora_members.save_adapter(BERT, base_dir, tmp_path / f"a{seed}", seed, r=4 + 4 * seed, lora_alpha=8,
                                          use_dora=True, target_modules=["query", "value"], task_type="SEQ_CLS")
                for seed in range(2)]
    wide = WideModel.from_pretrained(adapters)
    references = [lora_members.alone(BERT, base_dir, a) for a in adapters]
    assert max_member_error(wide, references, BERT.inputs(2, padded=True)) <= TOLERANCE
    assert blocks(wide)
    wide.save_members(tmp_path / "saved")
    again = [lora_members.alone(BERT, base_dir, tmp_path / "saved" / name)
             for name in sorted(p.name for p in (tmp_path / "saved").iterdir())]
    assert max_member_error(wide, again, BERT.inputs(2, padded=True)) <= TOLERANCE
    wide.save_pretrained(tmp_path / "ensemble")  # the base referenced, each member's adapter as PEFT writes it
    loaded = WideModel.from_pretrained(tmp_path / "ensemble")
    assert max_member_error(loaded, references, BERT.inputs(2, padded=True)) <= TOLERANCE


def test_over_a_bfloat16_base_as_peft_computes(tmp_path):
    """PEFT keeps DoRA's adapters and magnitudes in float32 over a half-precision base and adds the update in
    float32, rounding once: so does the wide model (PEFT's order, not the in-place one)."""
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    LLAMA.build(0).save_pretrained(base_dir)
    adapters = [lora_members.save_adapter(LLAMA, base_dir, tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                                          use_dora=True, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
                for seed in range(2)]
    wide = WideModel.from_pretrained(adapters, dtype=torch.bfloat16)
    inputs = LLAMA.inputs(2, padded=True)
    with torch.no_grad():
        out = wide(**inputs).logits
        for i, adapter in enumerate(adapters):
            want = peft.PeftModel.from_pretrained(LLAMA.model_class.from_pretrained(base_dir, dtype=torch.bfloat16),
                                                  adapter).eval()(**inputs).logits
            error = (out[i].float() - want.float()).abs()
            assert (error > 0).float().mean() < 0.05 and error.max() <= 2 ** -6 * max(1.0, want.abs().max().item())
    assert {b.magnitude.dtype for b in blocks(wide)} == {torch.float32}


def test_compiled():
    base = LLAMA.build(0)
    members = [dora(base, seed, r=4, lora_alpha=8, target_modules=["q_proj"]) for seed in range(2)]
    wide = torch.compile(WideModel.from_models(members))
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_each_members_gradients_are_its_own():
    """In training the norms get no gradient (PEFT detaches them); the magnitudes, A and B get each member's."""
    base = LLAMA.build(0)
    members = [dora(base, seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) for seed in range(2)]
    for member in members:
        for name, p in member.named_parameters():
            p.requires_grad_("lora_" in name)
        member.train()
    wide = WideModel.from_models(members, share_identical=False).train()
    x = LLAMA.inputs(2, padded=True)
    wide(**x).logits.square().sum().backward()
    for member in members:
        member(**x).logits.square().sum().backward()
    for block in blocks(wide):
        path = next(e.fqn for e in wide.plan.entries.values() if wide.model.get_submodule(e.fqn) is block)
        for i, member in enumerate(members):
            layer = member.get_submodule(path)
            for got, want in [(block.magnitude.grad[i], layer.lora_magnitude_vector["default"].weight.grad),
                              (block.lora_A.grad[i], layer.lora_A["default"].weight.grad),
                              (block.lora_B.grad[i], layer.lora_B["default"].weight.grad)]:
                assert (got - want).abs().max().item() <= TOLERANCE * max(1.0, want.abs().max().item())
