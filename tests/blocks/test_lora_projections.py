"""WideLoraProjections (hf_wide/blocks/lora_projections.py): LoRA-adapted q/k/v and gate/up fused inside the
attention and MLP blocks, each member against its PeftModel run alone. The fused path is declined on CPU by
default (no faster there); these tests turn it on."""

import lora_members
import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error

from hf_wide import Kind, WideModel
from hf_wide.blocks import lora_projections

LLAMA, BERT = CASES["llama-causallm"], CASES["bert-seqcls"]
EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(lora_projections, "FUSE_ON_CPU", True)


def blocks(wide) -> dict[str, str]:
    return {e.fqn: e.wide_class for e in wide.plan.entries.values() if e.kind == Kind.BLOCK}


def test_ranks_alphas_and_rslora_that_differ_in_fused_attention_and_mlp(fused_on_cpu):
    base = LLAMA.build(0)
    members = [lora_members.adapted(base, 0, task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=EVERY_LINEAR),
               lora_members.adapted(base, 1, task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=EVERY_LINEAR),
               lora_members.adapted(base, 2, task_type="CAUSAL_LM", r=16, lora_alpha=8, use_rslora=True,
                                    target_modules=EVERY_LINEAR)]
    wide = WideModel.from_models(members)
    kinds = sorted(set(blocks(wide).values()))
    assert kinds == ["WideAttention", "WideGatedMLP"] and not wide.plan.fallbacks  # no WideLoraLinear left apart
    attention = wide.model.get_submodule(next(f for f, c in blocks(wide).items() if c == "WideAttention"))
    assert attention.lora_qkv.weight.dim() == 2  # the base's one q/k/v weight serves every member
    assert attention.lora_qkv.lora_A.shape[:2] == (3, 3 * 16)  # 3 projections, padded to the largest rank
    inputs = LLAMA.inputs(3, padded=True)
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    tokens = wide.generate(**inputs, max_new_tokens=4, do_sample=False)
    for i, member in enumerate(members):
        assert torch.equal(tokens[i], member.generate(**inputs, max_new_tokens=4, do_sample=False))
        got, want = wide.member(i).state_dict(), member.state_dict()  # each member's own ranks back
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_bert_query_key_value_fused_with_a_saved_classifier(fused_on_cpu):
    base = BERT.build(0)
    members = [lora_members.adapted(base, seed, task_type="SEQ_CLS", r=8, lora_alpha=16, modules_to_save=["classifier"],
                                    target_modules=["query", "key", "value", "dense"]) for seed in range(3)]
    wide = WideModel.from_models(members)
    fused = blocks(wide)
    assert sum(c == "WideAttention" for c in fused.values()) == base.config.num_hidden_layers
    assert max_member_error(wide, members, BERT.inputs(3, padded=True)) <= TOLERANCE


def test_members_with_their_own_base_weights_stack_the_base(fused_on_cpu):
    members = [lora_members.adapted(LLAMA.build(seed), seed, task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                    target_modules=EVERY_LINEAR) for seed in range(2)]
    wide = WideModel.from_models(members)
    mlp = wide.model.get_submodule(next(f for f, c in blocks(wide).items() if c == "WideGatedMLP"))
    assert mlp.lora_gate_up.weight.dim() == 3  # (N, 2*I, D)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_members_with_their_own_biases_keep_one_base_weight(fused_on_cpu):
    """PEFT's ``bias="lora_only"`` trains the adapted projections' biases: one q/k/v weight, each member's biases."""
    base = BERT.build(0)
    members = [lora_members.adapted(base, seed, task_type="SEQ_CLS", r=4, lora_alpha=8, bias="lora_only",
                                    target_modules=["query", "key", "value"]) for seed in range(3)]
    lora_members.own_biases(members, 7)
    wide = WideModel.from_models(members)
    attention = wide.model.get_submodule(next(f for f, c in blocks(wide).items() if c == "WideAttention"))
    assert attention.lora_qkv.weight.dim() == 2 and attention.lora_qkv.bias.shape[0] == 3  # (D_out, D_in), (N, D_out)
    assert max_member_error(wide, members, BERT.inputs(3, padded=True)) <= TOLERANCE
    for i, member in enumerate(members):
        got, want = wide.member(i).state_dict(), member.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_dropout_applies_in_training_only(fused_on_cpu):
    base = LLAMA.build(0)
    targets = ["q_proj", "k_proj", "v_proj"]
    members = [lora_members.adapted(base, seed, task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.999,
                                    target_modules=targets) for seed in range(2)]
    wide = WideModel.from_models(members)
    assert "WideAttention" in blocks(wide).values()
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(wide, members, inputs) <= TOLERANCE  # eval: no dropout
    with torch.no_grad():
        adapted = wide(**inputs).logits
        for member in (wide, *members):
            member.train()
        for module in wide.modules():
            if isinstance(module, lora_projections.WideLoraProjections):
                for drop in module.lora_dropout:
                    drop.p = 1.0  # every input to lora_A dropped: no update at all, exactly the base's output
        got = wide(**inputs).logits
        for i, member in enumerate(members):
            with member.disable_adapter():
                want = member(**inputs).logits
            assert (got[i] - want).abs().max().item() <= TOLERANCE
        assert (got - adapted).abs().max().item() > 1e-3  # the updates had mattered


def test_dropouts_that_differ_are_each_members_own(fused_on_cpu):
    base = LLAMA.build(0)
    members = [lora_members.adapted(base, seed, task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=p,
                                    target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
               for seed, p in enumerate((0.0, 1.0))]
    wide = WideModel.from_models(members)
    assert sorted(set(blocks(wide).values())) == ["WideAttention", "WideGatedMLP"] and not wide.plan.fallbacks
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(wide, members, inputs) <= TOLERANCE  # eval: no dropout
    lora_members.check_own_dropouts(wide, members, inputs, TOLERANCE)


def test_loaded_members_become_views_of_the_fused_tensors(fused_on_cpu):
    base, inputs = LLAMA.build(0), LLAMA.inputs(2, padded=True)
    members = [lora_members.adapted(base, seed, task_type="CAUSAL_LM", r=rank, lora_alpha=8, target_modules=EVERY_LINEAR)
               for seed, rank in ((0, 2), (1, 4))]
    for m in members[1:]:  # adapters over one base, as loading them holds it: the very same base tensors
        for (name, p), q in zip(m.named_parameters(), members[0].parameters()):
            if "base_layer" in name:
                p.data = q.data
    outputs = [m(**inputs).logits.detach() for m in members]
    wide = WideModel.from_models(members, copy_shared=False)
    attention = wide.model.get_submodule(next(f for f, c in blocks(wide).items() if c == "WideAttention"))
    q_proj = members[1].get_submodule(next(f for f, c in blocks(wide).items() if c == "WideAttention") + ".q_proj")
    storage = attention.lora_qkv.weight.untyped_storage().data_ptr()
    assert q_proj.base_layer.weight.untyped_storage().data_ptr() == storage
    assert q_proj.lora_A["default"].weight.untyped_storage().data_ptr() == attention.lora_qkv.lora_A.untyped_storage().data_ptr()
    for member, want in zip(members, outputs):  # the members themselves unchanged
        assert (member(**inputs).logits - want).abs().max().item() <= TOLERANCE
    assert max_member_error(wide, members, inputs) <= TOLERANCE


def test_declined_on_cpu_by_default():
    base = LLAMA.build(0)
    members = [lora_members.adapted(base, seed, task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=EVERY_LINEAR)
               for seed in range(2)]
    wide = WideModel.from_models(members)
    assert "WideAttention" not in blocks(wide).values()
    assert any("on CPU LoRA projections run apart" in note for note in wide.plan.warnings)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_projections_left_unadapted_are_held_once(fused_on_cpu):
    base = LLAMA.build(0)
    members = [lora_members.adapted(base, seed, task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                    target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
               for seed in range(3)]
    wide = WideModel.from_models(members)
    fused = blocks(wide)
    attention = wide.model.get_submodule(next(f for f, c in fused.items() if c == "WideAttention"))
    mlp = wide.model.get_submodule(next(f for f, c in fused.items() if c == "WideGatedMLP"))
    assert type(attention.o_proj) is torch.nn.Linear and type(mlp.down_proj) is torch.nn.Linear  # the base's own
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    for i, member in enumerate(members):
        got, want = wide.member(i).state_dict(), member.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_an_adapted_output_projection_alone_is_planned_by_its_parts(fused_on_cpu):
    base = LLAMA.build(0)
    members = [lora_members.adapted(base, seed, task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                    target_modules=["o_proj", "down_proj"]) for seed in range(2)]
    wide = WideModel.from_models(members)
    assert set(blocks(wide).values()) == {"WideLoraLinear"}  # no fused block around a layer it would not build
    assert any("o_proj is a Linear but q, k and v are not adapted" in w for w in wide.plan.warnings)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_float32_adapters_over_a_bfloat16_base_run_apart(fused_on_cpu):
    """PEFT keeps adapters of a half-precision base in float32 and computes their updates so: the fused block
    (one dtype for the base and the updates) declines, and each projection's WideLoraLinear computes as PEFT."""
    base = LLAMA.build(0).to(torch.bfloat16)
    members = [lora_members.adapted(base, seed, task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=EVERY_LINEAR)
               for seed in range(2)]
    assert members[0].base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    wide = WideModel.from_models(members)
    assert "WideAttention" not in blocks(wide).values() and not wide.plan.fallbacks
    assert any("float32" in note for note in wide.plan.warnings)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) == 0.0
