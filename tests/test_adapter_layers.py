"""The structure of adapter members (hf_wide/adapter_layers.py): PEFT's trainable tokens, alike in every member or
refused; a module saved whole by one member and adapted by another, refused (the no-ops of differing targets and
saved modules: test_adapters.py)."""

import peft
import pytest
import torch
from conftest import CASES
from lora_members import LLAMA, adapted, alone
from oracle import TOLERANCE, max_member_error

from hf_wide import IncompatibleMembersError, WideModel


def save_token_adapters(folder, indices: list[list[int] | None]) -> list[str]:
    """Adapters of the base at ``folder / "base"``, LoRA on q and v, each training the tokens at its ``indices``
    (None: none), with random updates and tokens of their own."""
    LLAMA.build(0).save_pretrained(folder / "base")
    adapters = []
    for seed, tokens in enumerate(indices):
        model = peft.get_peft_model(LLAMA.model_class.from_pretrained(folder / "base"), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], trainable_token_indices=tokens,
            task_type="CAUSAL_LM"))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name or "trainable_tokens_delta" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(folder / f"a{seed}")
        adapters.append(str(folder / f"a{seed}"))
    return adapters


def inputs_with_tokens(tokens: list[int]) -> dict:
    inputs = LLAMA.inputs(2, padded=True)
    inputs["input_ids"][:, 1:1 + len(tokens)] = torch.tensor(tokens)
    return inputs


def test_adapters_with_trainable_tokens(tmp_path):
    """PEFT's ``trainable_token_indices``: each member's own rows of the (tied) embedding and output layer, run as
    each member's code, the LoRA layers fused. The inputs hold the trained tokens."""
    adapters = save_token_adapters(tmp_path, [[5, 7], [5, 7]])
    wide = WideModel.from_pretrained(adapters)
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, inputs_with_tokens([5, 7])) <= TOLERANCE
    lora = [e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    assert len(lora) == 2 * 2  # not one fallback of the whole model (the trace names its layers by a slice)


def test_adapters_that_train_other_tokens(tmp_path):
    adapters = save_token_adapters(tmp_path, [[5, 7], [3, 9]])
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    inputs = inputs_with_tokens([3, 5, 7, 9])
    assert max_member_error(WideModel.from_pretrained(adapters), references, inputs) <= TOLERANCE


def test_adapters_that_train_different_numbers_of_tokens_are_refused_and_merge_is_the_way_out(tmp_path):
    """One trains two tokens, the other none: their embeddings differ in structure (was: "member 1 has no tensor
    '...embed_tokens.token_adapter.base_layer.weight'"). The refusal names the option; merged, each is exact."""
    adapters = save_token_adapters(tmp_path, [[5, 7], None])
    with pytest.raises(IncompatibleMembersError, match=r"member 1 trains no tokens .*trainable_token_indices.* member "
                       r"0 2 tokens of model\.embed_tokens.*merge=True"):
        WideModel.from_pretrained(adapters)
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    with pytest.raises(IncompatibleMembersError, match="trainable_token_indices"):
        WideModel.from_models(references)
    wide = WideModel.from_pretrained(adapters, merge=True)
    assert max_member_error(wide, references, inputs_with_tokens([5, 7])) <= TOLERANCE


def test_a_module_one_member_saves_whole_and_another_adapts_is_refused_with_both_named():
    """An adapter trained without a task type (PEFT then adapts the head's linears) beside one that saves the head
    whole: refused with the paths and the members named (it was "...classifier.dense is a Linear: hf-wide can give it
    no zero LoRA", naming the member that had the LoRA)."""
    base = CASES["roberta-seqcls"].build(0)
    members = [adapted(base, 0, r=2, target_modules=["query"], modules_to_save=["classifier"]),
               adapted(base, 1, r=2, target_modules=["query", "dense"])]
    for order, (saves, adapts) in ((members, (0, 1)), (members[::-1], (1, 0))):
        with pytest.raises(IncompatibleMembersError, match=rf"member {saves} saves classifier whole .*member {adapts} "
                                                           r"has a LoRA on classifier\.dense.*merge=True"):
            WideModel.from_models(order)


def test_an_adapter_of_the_experts_parameters_beside_the_base_itself(tmp_path):
    """A LoRA on Mixtral's experts' stacked ``gate_up_proj`` (``target_parameters``) beside the base in the list: the
    base, wrapped as the adapter is with a zero update, failed ("'MixtralExperts' object has no attribute 'weight'",
    read for a DoRA magnitude it does not have)."""
    from lora_members import save_adapter

    mixtral = CASES["mixtral-causallm"]
    mixtral.build(0).save_pretrained(tmp_path / "base")
    adapter = save_adapter(mixtral, tmp_path / "base", tmp_path / "a0", 0, r=4, target_modules=["q_proj"],
                           target_parameters=["mlp.experts.gate_up_proj"], task_type="CAUSAL_LM")
    wide = WideModel.from_pretrained([adapter, str(tmp_path / "base")])
    references = [alone(mixtral, tmp_path / "base", adapter), mixtral.model_class.from_pretrained(tmp_path / "base")]
    assert max_member_error(wide, [r.eval() for r in references], mixtral.inputs(2, padded=True)) <= TOLERANCE
    assert type(wide.member(1)) is mixtral.model_class


@pytest.mark.parametrize("targets", [dict(target_modules=["q_proj", "gate"]),
                                     dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])],
                         ids=["router", "experts"])
def test_loras_of_different_ranks_on_a_mixture_of_experts_run_on_token_rows_unverified(targets, tmp_path):
    """A LoRA on Mixtral's router or its experts' parameters whose rank differs between members runs each member's
    own layer, in a loop; that loop split the rows it was given as batch rows, where they are tokens, and every
    forward of more than one token failed unless verification had moved the loop up to the MoE block."""
    from lora_members import save_adapter

    mixtral = CASES["mixtral-causallm"]
    mixtral.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(mixtral, tmp_path / "base", tmp_path / f"a{r}", r, r=r, task_type="CAUSAL_LM", **targets)
                for r in (4, 2)]
    wide = WideModel.from_pretrained(adapters, verify=False)
    references = [alone(mixtral, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, mixtral.inputs(2, padded=True)) <= TOLERANCE


def test_an_adapter_of_parameters_beside_one_of_modules(tmp_path):
    """PEFT's ``target_parameters`` (a LoRA on a parameter, ``ParamWrapper``) in one adapter: its tuner's record of the
    parameters it adapted differed from the other member's, and the whole model ran as each member's own code; now
    only the layers that differ do, and each member taken out lists what it adapts as PEFT does."""
    from lora_members import save_adapter

    LLAMA.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / "a0", 0, r=4, target_modules=["q_proj"],
                             target_parameters=["mlp.up_proj.weight"], task_type="CAUSAL_LM"),
                save_adapter(LLAMA, tmp_path / "base", tmp_path / "a1", 1, r=2, target_modules=["q_proj", "v_proj"],
                             task_type="CAUSAL_LM")]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert {e.fqn.rsplit(".", 1)[-1] for e in wide.plan.fallbacks} == {"up_proj"}
    for i, reference in enumerate(references):
        ours, theirs = wide.member(i).base_model, reference.base_model
        assert ours.targeted_module_names == sorted(theirs.targeted_module_names)
        assert ours.targeted_parameter_names == sorted(theirs.targeted_parameter_names)


def test_adapters_of_different_convolutions_beside_their_base(tmp_path):
    """LoRA on a ResNet's convolutions, each adapter on its own, and the base itself in the list: each member is given
    a zero LoRA on the convolutions it does not adapt, as on linears (they were refused: "no zero LoRA")."""
    from lora_members import save_adapter

    resnet = CASES["resnet-imgcls"]
    resnet.build(0).save_pretrained(tmp_path / "base")
    convolutions = [f"resnet.encoder.stages.0.layers.0.layer.{i}.convolution" for i in range(2)]
    adapters = [save_adapter(resnet, tmp_path / "base", tmp_path / f"a{i}", i, r=4, target_modules=[convolution])
                for i, convolution in enumerate(convolutions)]
    wide = WideModel.from_pretrained([*adapters, str(tmp_path / "base")])
    references = [alone(resnet, tmp_path / "base", a) for a in adapters]
    inputs = resnet.inputs(2, padded=False)
    base = resnet.model_class.from_pretrained(tmp_path / "base").eval()
    assert max_member_error(wide, [*references, base], inputs) <= TOLERANCE
    for folder, reference in zip(wide.save_members(tmp_path / "members"), references):
        back = alone(resnet, tmp_path / "base", str(folder))  # the adapter as saved, no zero LoRA left in it
        assert back.state_dict().keys() == reference.state_dict().keys()
        assert torch.equal(back(**inputs).logits, reference(**inputs).logits)
