"""WideModel end to end: exactness for every family, member round trip, ties, errors (generation:
tests/test_generation.py)."""

import copy

import pytest
import torch
from conftest import CASES, NUM_MEMBERS
from oracle import TOLERANCE, assert_gradients_are_the_members, main_output, max_member_error

import test_architectures as arch
from hf_wide import Kind, PerMember, WideModel


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case_id", list(CASES))
def test_member_i_equals_checkpoint_i(fused, case_id, batch, padded):
    members, wide = fused(case_id)
    inputs = CASES[case_id].inputs(batch, padded)
    assert max_member_error(wide, members, inputs) <= TOLERANCE


@pytest.mark.parametrize("case_id", list(CASES))
def test_member_round_trip_state_dict(fused, case_id):
    members, wide = fused(case_id)
    for i, original in enumerate(members):
        back = wide.member(i)
        assert type(back) is type(original)
        expected, got = original.state_dict(), back.state_dict()
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("case_id", ["bert-seqcls", "llama-causallm", "gpt2-causallm", "t5-encoder", "mpnet-seqcls",
                                     "deberta-v2-seqcls", "resnet-imgcls", "vit-imgcls"])
def test_each_members_gradients_are_its_own(case_id):
    """The oracle for training (``share_identical=False``): each parameter's gradient of member i through the wide
    model is checkpoint i's own, for a cotangent of its own. T5's position bias, a tensor to train that reaches its
    attention as the mask, stopped the vectorised fallback (vmap chose CPU flash attention, not differentiable in
    the mask); the wide embeddings gave the padding rows gradients their members' tables do not get."""
    case = CASES[case_id]
    members = [case.build(seed) for seed in range(NUM_MEMBERS)]
    wide = WideModel.from_models(members, share_identical=False)
    assert_gradients_are_the_members(wide, members, case.inputs(2, padded=True))


@pytest.mark.parametrize("frozen", ["all but the head", "q only"])
@pytest.mark.parametrize("case_id", ["bert-seqcls", "llama-causallm", "vit-imgcls", "deberta-v2-seqcls"])
def test_a_frozen_parameter_stays_frozen(case_id, frozen):
    # A fused block stacked q, k and v (gate and up, ViT's embeddings) as a new parameter that trained whatever its
    # sources: members that train their head alone had their frozen attentions moved by the optimizer, and member(i)
    # still said frozen. Now a block takes them only where all train or none do; else they are planned by parts.
    case = CASES[case_id]
    members = [case.build(seed) for seed in range(NUM_MEMBERS)]
    for member in members:
        for name, param in member.named_parameters():
            head = name.startswith(("classifier", "lm_head", "pooler", "score", "model.norm"))  # (a tied lm_head)
            param.requires_grad_(head if frozen == "all but the head" else "query" in name or "q_proj" in name)
    before = [copy.deepcopy(m.state_dict()) for m in members]
    trained = [{n for n, p in m.named_parameters() if p.requires_grad} for m in members]
    wide = WideModel.from_models(members, share_identical=False)
    optimizer = torch.optim.SGD([p for p in wide.parameters() if p.requires_grad], lr=1.0)
    main_output(wide(**case.inputs(2, padded=True))).square().sum().backward()
    optimizer.step()
    for i in range(NUM_MEMBERS):
        after = wide.member(i).state_dict()
        moved = {k for k, v in after.items() if not torch.equal(v, before[i][k])}
        assert moved and moved <= trained[i], sorted(moved - trained[i])


@pytest.mark.parametrize("case_id", ["bert-seqcls", "llama-causallm", "resnet-imgcls", "vit-imgcls"])
def test_member_runs_alone_and_shares_no_storage(fused, case_id):
    members, wide = fused(case_id)
    back = wide.member(1)
    inputs = CASES[case_id].inputs(2, padded=True)
    with torch.no_grad():
        assert torch.equal(main_output(back(**inputs)), main_output(members[1](**inputs)))
    wide_ptrs = {t.untyped_storage().data_ptr() for t in wide.state_dict().values()}
    assert not wide_ptrs & {t.untyped_storage().data_ptr() for t in back.parameters()}
    assert back.config._name_or_path == members[1].config._name_or_path


@pytest.mark.parametrize("case_id", ["bert-seqcls", "llama-causallm", "vit-imgcls"])
def test_member_views_share_storage_and_run_alone(fused, case_id):
    members, wide = fused(case_id)
    view = wide.member(2, share=True)
    wide_ptrs = {t.untyped_storage().data_ptr() for t in wide.state_dict().values()}
    assert {p.untyped_storage().data_ptr() for p in view.parameters()} <= wide_ptrs
    inputs = CASES[case_id].inputs(2, padded=True)
    with torch.no_grad():
        assert torch.equal(main_output(view(**inputs)), main_output(members[2](**inputs)))


@pytest.mark.parametrize("case_id", ["gpt2-causallm", "llama-causallm"])
def test_tied_embeddings_stay_one_tensor(fused, case_id):
    members, wide = fused(case_id)
    assert members[0].lm_head.weight is members[0].get_input_embeddings().weight
    assert wide.model.lm_head.weight is wide.model.get_input_embeddings().weight
    assert wide.model.lm_head.weight.shape[0] == NUM_MEMBERS
    back = wide.member(0)
    assert back.lm_head.weight is back.get_input_embeddings().weight


def test_a_masked_lms_decoder_trains_its_embeddings_as_its_members_do():
    # Its embeddings run vectorised (no builder for BertEmbeddings), its decoder (tied to their word embeddings) as a
    # wide linear: two stacked copies of one tensor, never tied again (a tie was made only between wide primitives),
    # so each took its part of the gradient and training moved them apart: 20.8 off in the word embeddings' gradient.
    models = arch.members(arch.ENCODERS["bert-mlm"])
    wide = WideModel.from_models(models, share_identical=False)
    assert wide.plan.entries["bert.embeddings"].kind == Kind.VECTORISED
    assert_gradients_are_the_members(wide, models, arch.text_batch(0))


def test_embeddings_each_member_runs_stay_one_tensor_with_their_ties():
    # A hook on the input embeddings (transformers' enable_input_require_grads, from gradient_checkpointing_enable
    # before fusing) runs them as each member's own module: T5's shared and encoder.embed_tokens, two such modules of
    # one tensor, were copied apart, and the encoder's took the whole gradient (shared none).
    case = CASES["t5-encoder"]
    members = [case.build(seed) for seed in range(NUM_MEMBERS)]
    for member in members:
        member.enable_input_require_grads()
    wide = WideModel.from_models(members, share_identical=False)
    assert wide.plan.entries["shared"].wide_class == "PerMemberFallback"
    for i in range(NUM_MEMBERS):
        assert wide.model.shared.members[i].weight is wide.model.encoder.embed_tokens.members[i].weight
    assert_gradients_are_the_members(wide, members, case.inputs(2, padded=True), {"shared.weight"})


def test_a_head_tied_to_a_module_each_member_runs_runs_per_member_too():
    # RecurrentGemma keeps state in its modules, so its model runs as each member's own; its lm_head (its embeddings'
    # tensor) was a wide linear, a stacked copy that training would have moved apart from the members' embeddings.
    models = arch.members(arch.DECODERS["recurrent_gemma"])
    wide = WideModel.from_models(models, share_identical=False)  # (its model's normalizer, shared, kept it apart)
    entry = wide.plan.entries["lm_head"]
    assert entry.wide_class == "PerMemberFallback" and "lm_head.weight is model.embed_tokens.weight" in entry.reason
    for i in range(NUM_MEMBERS):
        assert wide.model.lm_head.members[i].weight is wide.model.model.members[i].embed_tokens.weight
    inputs = arch.text_batch(0)
    assert arch.worst(wide, models, inputs) <= TOLERANCE
    wide(**inputs).logits.sum().backward()
    for i, model in enumerate(models):
        model(**inputs).logits.sum().backward()
        torch.testing.assert_close(wide.model.lm_head.members[i].weight.grad, model.lm_head.weight.grad)


def test_a_frozen_head_tied_to_a_module_each_member_runs_stays_wide():
    # Copies of a tensor nothing trains stay equal (a LoRA base's embeddings and lm_head): the head keeps its speed.
    models = arch.members(arch.DECODERS["recurrent_gemma"])
    for model in models:
        model.requires_grad_(False)
    wide = WideModel.from_models(models, share_identical=False)
    assert wide.plan.entries["lm_head"].wide_class == "WideLinear"
    assert arch.worst(wide, models, arch.text_batch(0)) <= TOLERANCE


def test_wide_model_holds_about_one_members_parameter_tensors(fused):
    members, wide = fused("llama-causallm")
    # Stacked, and fewer still where blocks fuse q/k/v or gate/up into one tensor.
    assert len(list(wide.parameters())) <= len(list(members[0].parameters()))
    assert sum(p.numel() for p in wide.parameters()) == NUM_MEMBERS * sum(p.numel() for p in members[0].parameters())


@pytest.mark.parametrize("case_id, attention", [("bert-base", "BertSelfAttention"), ("llama-causallm", "LlamaAttention")])
def test_plan_has_no_fallback_for_known_layers(fused, case_id, attention):
    _, wide = fused(case_id)
    assert wide.plan.fallbacks == []
    kinds = {e.module_class: e.kind for e in wide.plan.entries.values()}
    for cls in ("Linear", "Embedding"):
        assert kinds[cls] == Kind.PRIMITIVE
    assert any(k == Kind.PRIMITIVE and "Norm" in c for c, k in kinds.items())
    assert kinds[attention] == Kind.BLOCK  # q/k/v projections fused


def test_per_member_inputs(fused):
    members, wide = fused("bert-seqcls")
    case = CASES["bert-seqcls"]
    per_member = [case.inputs(2, padded=True, seed=s) for s in range(NUM_MEMBERS)]
    ids = PerMember(torch.stack([p["input_ids"] for p in per_member]))
    mask = PerMember(torch.stack([p["attention_mask"] for p in per_member]))
    with torch.no_grad():
        logits = wide(input_ids=ids, attention_mask=mask).logits
        for i, member in enumerate(members):
            assert (logits[i] - member(**per_member[i]).logits).abs().max() <= TOLERANCE


def test_per_member_inputs_of_the_wrong_shape_are_refused(fused):
    _, wide = fused("bert-seqcls")
    with pytest.raises(ValueError, match="leading dim"):
        wide(input_ids=PerMember(torch.zeros(NUM_MEMBERS + 1, 2, 7, dtype=torch.long)))
    with pytest.raises(ValueError, match="attention_mask gives each member 3 rows, but the batch of input_ids has 2"):
        wide(input_ids=PerMember(torch.zeros(NUM_MEMBERS, 2, 7, dtype=torch.long)),
             attention_mask=PerMember(torch.ones(NUM_MEMBERS, 3, 7, dtype=torch.long)))


def test_wide_model_is_an_nn_module(fused):
    members, wide = fused("bert-seqcls")
    assert isinstance(wide, torch.nn.Module)
    assert wide.num_members == NUM_MEMBERS
    keys = wide.state_dict().keys()
    assert any(k.endswith("word_embeddings.weight") for k in keys)
    double = WideModel.from_models(members).to(torch.float64)
    inputs = CASES["bert-seqcls"].inputs(2, padded=True)
    with torch.no_grad():
        assert double(**inputs).logits.dtype == torch.float64


def test_device_dtype_and_generation_config_as_transformers_models_have_them(fused):
    members, wide = fused("llama-causallm")
    assert wide.device == members[0].device and wide.dtype == members[0].dtype == torch.float32
    assert wide.generation_config is wide.model.generation_config
    assert wide.generation_config.to_dict() == members[0].generation_config.to_dict()
    half = copy.deepcopy(wide).to(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.device == torch.device("cpu")


def test_n_equals_one_is_allowed():
    case = CASES["bert-seqcls"]
    member = case.build(0)
    wide = WideModel.from_models([member])
    assert max_member_error(wide, [member], case.inputs(3, padded=True)) <= TOLERANCE


def test_validate_accepts_an_exact_fusion():
    case = CASES["llama-seqcls"]
    members = [case.build(s) for s in range(2)]
    WideModel.from_models(members, validate=True)


def test_validate_holds_half_precision_to_its_rounding():
    """``validate=True`` held every dtype to 1e-4: a bfloat16 ViT whose logits were a few last bits (0.012) off its
    members' was refused, as if its fusion were wrong."""
    case = CASES["vit-imgcls"]
    members = [case.build(s).to(torch.bfloat16) for s in range(3)]
    sample = {"pixel_values": case.inputs(8, padded=True)["pixel_values"].to(torch.bfloat16)}
    WideModel.from_models(members, sample, validate=True)


@pytest.mark.parametrize("case_id", ["llama-causallm", "t5-encoder", "mixtral-causallm"])  # blocks, vectorised, loop
def test_a_wide_model_deep_copies_and_pickles(case_id, tmp_path):
    # after forwards, which make per-thread state (a thread-local, which cannot be copied: copy.deepcopy and
    # torch.save raised); a copy made after transformers' capture hooks were installed installs its own
    case = CASES[case_id]
    members = [case.build(seed) for seed in range(NUM_MEMBERS)]
    wide = WideModel.from_models(members)
    inputs = case.inputs(2, padded=True)
    with torch.no_grad():
        wide(**inputs)
    torch.save(wide, tmp_path / "wide.pt")  # (after capture hooks, transformers' own models cannot be pickled)
    loaded = torch.load(tmp_path / "wide.pt", weights_only=False)
    with torch.no_grad():
        wide(**inputs, output_hidden_states=True)
    copied = copy.deepcopy(wide)
    assert not any(p is q for p, q in zip(copied.parameters(), wide.parameters()))
    with torch.no_grad():
        want = members[1](**inputs, output_hidden_states=True).hidden_states
        for model in (loaded, copied):
            assert max_member_error(model, members, inputs) <= TOLERANCE
            got = model(**inputs, output_hidden_states=True).hidden_states
            assert len(got) == len(want) and all((g[1] - w).abs().max() <= TOLERANCE for g, w in zip(got, want))
