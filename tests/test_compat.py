"""Members that do not share an architecture are refused with errors that name what differs,
and a refused fusion leaves the members as they were."""

import pytest
import torch
import transformers as tf
from conftest import CASES
from lora_members import adapted
from oracle import TOLERANCE, max_member_error

from hf_wide import IncompatibleMembersError, WideModel


def test_empty_list_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        WideModel.from_models([])


def test_members_of_different_classes():
    a = CASES["bert-seqcls"].build(0)
    b = CASES["bert-base"].build(1)
    with pytest.raises(IncompatibleMembersError, match=r"member 1.*BertModel.*BertForSequenceClassification"):
        WideModel.from_models([a, b])


def test_a_member_on_the_meta_device_is_refused_by_name():
    # torch's own error came from deep in the fusion ("aten::equal ... Meta tensors")
    members = [torch.nn.Linear(4, 4) for _ in range(2)]
    with torch.device("meta"):
        members.append(torch.nn.Linear(4, 4))
    with pytest.raises(IncompatibleMembersError, match=r"member 2's 'weight' is on the meta device"):
        WideModel.from_models(members, torch.randn(2, 4))


def test_different_hidden_sizes_name_the_field_and_both_values():
    a = CASES["bert-seqcls"].build(0)
    config = CASES["bert-seqcls"].make_config()
    config.hidden_size, config.intermediate_size = 48, 64
    b = tf.BertForSequenceClassification(config).eval()
    with pytest.raises(IncompatibleMembersError, match=r"member 1.*hidden_size = 48.*32.*config\.hidden_size sizes "
                                                       r"the members' tensors") as refused:
        WideModel.from_models([a, b])
    assert "set it alike" not in str(refused.value)  # (their weights could not be one architecture's)


def test_a_vocabulary_grown_beside_one_that_was_not_says_which_fuse_together():
    # an adapter trained over a vocabulary grown with resize_token_embeddings, beside its base: the advice was to set
    # vocab_size alike, which no user can do
    case = CASES["llama-causallm"]
    grown = case.build(1)
    grown.resize_token_embeddings(grown.config.vocab_size + 3, mean_resizing=False)
    with pytest.raises(IncompatibleMembersError, match=r"vocab_size = 103, but member 0 has 100.*Their vocabularies "
                                                       r"differ.*adapters that grew it alike") as refused:
        WideModel.from_models([case.build(0), grown])
    assert "set it alike" not in str(refused.value)


def test_tied_beside_untied_embeddings_are_refused_without_advice_to_set_them_alike():
    # The advice to set the field alike would change a member's numbers (PEFT's merge unties an adapter's embeddings)
    case = CASES["gpt2-causallm"]
    config = case.make_config()
    config.tie_word_embeddings = False
    untied = case.model_class(config).eval()
    with pytest.raises(IncompatibleMembersError, match=r"tie_word_embeddings = False, but member 0 has True.*cannot "
                                                       r"be fused together") as refused:
        WideModel.from_models([case.build(0), untied])
    assert "set it alike" not in str(refused.value)


def test_a_sub_config_field_that_differs_is_named_not_the_whole_sub_config():
    from test_architectures import MIXED

    factory = MIXED["clip"][0]
    a, b = factory(), factory()
    b.config.text_config.layer_norm_eps = 1e-3
    with pytest.raises(IncompatibleMembersError, match=r"member 1 has config\.text_config\.layer_norm_eps = 0\.001, "
                                                       r"but member 0 has 1e-05"):
        WideModel.from_models([a, b])
    # where a sub-config came from is provenance, as at the top level: it was refused, by a message that said it is not
    b.config.text_config.layer_norm_eps = a.config.text_config.layer_norm_eps
    b.config.text_config._name_or_path, b.config.text_config.finetuning_task = "org/clip-text", "sts"
    WideModel.from_models([a, b])


def test_members_built_with_other_attention_implementations_are_refused():
    # the wide model ran member 0's eager attention for a member built with sdpa: its padded positions differed
    make = CASES["llama-causallm"].make_config
    eager = tf.LlamaForCausalLM._from_config(make(), attn_implementation="eager")
    sdpa = tf.LlamaForCausalLM._from_config(make(), attn_implementation="sdpa")
    with pytest.raises(IncompatibleMembersError, match="member 1 runs attn_implementation='sdpa', but member 0 runs "
                                                       "'eager'"):
        WideModel.from_models([eager, sdpa])
    sdpa.set_attn_implementation("eager")
    WideModel.from_models([eager, sdpa])

def test_labels_may_differ_only_when_allowed():
    a, b = CASES["bert-seqcls"].build(0), CASES["bert-seqcls"].build(1)
    b.config.id2label = {0: "neg", 1: "neu", 2: "pos"}
    with pytest.raises(IncompatibleMembersError, match="allow_label_mismatch"):
        WideModel.from_models([a, b])
    wide = WideModel.from_models([a, b], allow_label_mismatch=True)
    assert wide.member(1).config.id2label[2] == "pos"


def test_state_dict_shape_mismatch_is_named():
    a, b = CASES["llama-causallm"].build(0), CASES["llama-causallm"].build(1)
    b.model.norm.weight = torch.nn.Parameter(torch.ones(40))
    with pytest.raises(IncompatibleMembersError, match=r"member 1.*model.norm.weight.*\(40,\).*\(32,\)"):
        WideModel.from_models([a, b])


def test_a_refused_fusion_leaves_members_untouched():
    a, b = CASES["bert-seqcls"].build(0), CASES["bert-base"].build(1)
    a.train()
    before = {k: v.clone() for k, v in a.state_dict().items()}
    with pytest.raises(IncompatibleMembersError):
        WideModel.from_models([a, b])
    assert a.training
    assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())


def test_fusion_does_not_modify_members():
    members = [CASES["bert-seqcls"].build(s) for s in range(2)]
    classes = [type(m).__name__ for m in members[0].modules()]
    WideModel.from_models(members)
    assert [type(m).__name__ for m in members[0].modules()] == classes


@pytest.mark.parametrize("name, targets", [("vit-imgcls", ["projection", "q_proj"]),  # a LoRA on a Conv2d
                                           ("mixtral-causallm", ["gate", "q_proj"])])  # on the router's weight
def test_lora_layers_no_block_takes_may_differ_in_rank(name, targets):
    """Adapters may differ in rank on any LoRA layer, not only on those a fused block pads (they were refused: "member
    1 has '...gate.lora_A.default.weight' of shape (2, 32), but member 0 has (4, 32)"): such a layer runs as each
    member's own module, and each member taken out holds its own rank."""
    case = CASES[name]
    base = case.build(0)
    members = [adapted(base, seed, r=r, lora_alpha=8, target_modules=targets) for seed, r in enumerate((4, 2, 8))]
    wide = WideModel.from_models(members)
    with torch.no_grad():
        assert max_member_error(wide, members, case.inputs(2, padded=False)) <= TOLERANCE
    for i, member in enumerate(members):
        shapes = {k: v.shape for k, v in member.state_dict().items()}
        assert {k: v.shape for k, v in wide.member(i).state_dict().items()} == shapes


def test_a_lora_rank_differs_only_in_the_tensors_that_hold_it():
    """What may differ in shape between LoRA members is their ranks, not the tensors around them."""
    base = CASES["vit-imgcls"].build(0)
    members = [adapted(base, seed, r=4, target_modules=["projection"]) for seed in range(2)]
    members[1].base_model.model.vit.layernorm.weight = torch.nn.Parameter(torch.ones(40))
    with pytest.raises(IncompatibleMembersError, match=r"member 1.*vit.layernorm.weight.*\(40,\).*\(32,\)"):
        WideModel.from_models(members)


def test_members_of_different_dtypes_are_refused_unless_one_is_given(tmp_path):
    # The wide model holds one dtype: a bfloat16 member stacked with a float32 one ran in float32 (0.013 off itself),
    # and from folders a float32 checkpoint beside a bfloat16 one ran in bfloat16 (0.025 off), silently
    case = CASES["llama-causallm"]
    members = [case.build(0).to(torch.bfloat16), case.build(1)]
    with pytest.raises(IncompatibleMembersError, match=r"member 1 .* in torch\.float32, but member 0 in torch\.bfloat16"
                                                       r".*Pass dtype="):
        WideModel.from_models(members)
    folders = [str(tmp_path / f"m{i}") for i in range(2)]
    for member, folder in zip(members, folders):
        member.save_pretrained(folder)
    with pytest.raises(IncompatibleMembersError, match=r"in torch\.float32, but .* in torch\.bfloat16.*ass dtype="):
        WideModel.from_pretrained(folders)
    # dtype="auto" (transformers' default: each in its own) as None; it ran member 1 in member 0's, 0.016 off
    with pytest.raises(IncompatibleMembersError, match=r"in torch\.float32, but .* in torch\.bfloat16.*ass dtype="):
        WideModel.from_pretrained(folders, dtype="auto")
    wide = WideModel.from_pretrained(folders, dtype=torch.float32)  # every member in one, as transformers loads it
    alone = [case.model_class.from_pretrained(f, dtype=torch.float32).eval() for f in folders]
    assert max_member_error(wide, alone, case.inputs(2, padded=True)) <= TOLERANCE


def test_members_whose_configs_name_other_dtypes_than_their_tensors_are_refused(tmp_path):
    # Without a dtype, transformers loads a member in its config's dtype before its tensors': a config saying bfloat16
    # over float32 tensors is a bfloat16 model alone, and the wide model ran it in float32 (0.019 off)
    case = CASES["llama-causallm"]
    folders = [str(tmp_path / f"m{i}") for i in range(2)]
    for seed, folder in enumerate(folders):
        case.build(seed).save_pretrained(folder)
    config = tf.AutoConfig.from_pretrained(folders[1])
    config.dtype = torch.bfloat16
    config.save_pretrained(folders[1])  # its tensors stay float32
    assert case.model_class.from_pretrained(folders[1]).dtype == torch.bfloat16
    with pytest.raises(IncompatibleMembersError, match=r"member 1 .*the dtype it loads in .* torch\.bfloat16, but "
                                                       r"member 0 .* torch\.float32.*Pass dtype="):
        WideModel.from_pretrained(folders)


def test_flex_attention_is_refused_clearly(tmp_path):
    # transformers runs it alone on the CPU; the wide model failed in its trace ("no implementation found for
    # 'torch.ops.higher_order.flex_attention' on types that implement __torch_function__"), advising what failed too
    case = CASES["llama-causallm"]
    folders = [str(tmp_path / f"m{i}") for i in range(2)]
    for seed, folder in enumerate(folders):
        case.build(seed).save_pretrained(folder)
    with pytest.raises(ValueError, match="hf-wide does not run flex attention.*'sdpa' or 'eager'"):
        WideModel.from_pretrained(folders, attn_implementation="flex_attention")
    members = [case.model_class.from_pretrained(f, attn_implementation="flex_attention") for f in folders]
    with pytest.raises(ValueError, match="hf-wide does not run flex attention"):
        WideModel.from_models(members)
