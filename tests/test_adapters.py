"""PEFT adapters as members (hf_wide/adapters.py): from_pretrained of adapter folders over one base, each member
against ``PeftModel.from_pretrained(base, adapter)`` run alone (repos, refusals and the round trip:
test_adapter_repos.py)."""

import gc
import json
import sys
import warnings
from pathlib import Path

import peft
import pytest
import torch
from conftest import CASES
from lora_members import EVERY_LINEAR, LLAMA, adapted, alone, lora_keys, save_adapter, save_llama_adapters
from oracle import TOLERANCE, max_member_error

from hf_wide import IncompatibleMembersError, Kind, WideModel

BERT, VIT, GPT2 = CASES["bert-seqcls"], CASES["vit-imgcls"], CASES["gpt2-causallm"]


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    return save_llama_adapters(tmp_path_factory.mktemp("llama"))


def test_llama_adapters_of_different_ranks_and_targets(llama_adapters):
    base, adapters = llama_adapters
    wide = WideModel.from_pretrained(adapters)
    references = [alone(LLAMA, base, a) for a in adapters]
    inputs = LLAMA.inputs(3, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    lora = [e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    assert len(lora) == 2 * len(EVERY_LINEAR) and not wide.plan.fallbacks  # a missing target: a zero update
    assert wide.member_ids == adapters
    tokens = wide.generate(**inputs, max_new_tokens=4, do_sample=False)
    for i, reference in enumerate(references):
        assert torch.equal(tokens[i], reference.generate(**inputs, max_new_tokens=4, do_sample=False))


def test_loading_adapters_shows_a_progress_bar(llama_adapters, capfd):
    _, adapters = llama_adapters
    WideModel.from_pretrained(adapters)
    bar = [line for line in capfd.readouterr().err.replace("\r", "\n").splitlines() if "Loading members" in line]
    assert bar and "100%|" in bar[-1] and f"{len(adapters)}/{len(adapters)}" in bar[-1]


def test_a_member_is_its_own_adapter_with_its_own_config(llama_adapters, tmp_path):
    """``member(i).peft_config`` was member 0's (the fused model's): ``member(1).save_pretrained`` wrote rank 4
    and alpha 8 beside rank-8 weights, which PEFT then could not load (or, at equal ranks, loaded with the wrong
    scaling)."""
    base, adapters = llama_adapters
    wide = WideModel.from_pretrained(adapters)
    inputs = LLAMA.inputs(2, padded=True)
    for i, adapter in enumerate(adapters):
        config = wide.member(i).peft_config["default"]
        saved = json.loads((Path(adapter) / "adapter_config.json").read_text())
        assert (config.r, config.lora_alpha, config.use_rslora, set(config.target_modules)) == (
            saved["r"], saved["lora_alpha"], saved["use_rslora"], set(saved["target_modules"]))
        wide.member(i).save_pretrained(tmp_path / f"m{i}")  # PEFT's own save of the member
        with torch.no_grad():
            assert torch.equal(alone(LLAMA, base, str(tmp_path / f"m{i}"))(**inputs).logits,
                               alone(LLAMA, base, adapter)(**inputs).logits)


def test_the_base_in_the_list_is_a_member(llama_adapters):
    base, adapters = llama_adapters
    wide = WideModel.from_pretrained([str(base), adapters[1]])
    references = [LLAMA.model_class.from_pretrained(base).eval(), alone(LLAMA, base, adapters[1])]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    bare, adapter = wide.member(0), wide.member(1)  # the base itself, and a PeftModel
    assert type(bare) is LLAMA.model_class and isinstance(adapter, peft.PeftModel)
    want = references[0].state_dict()
    assert bare.state_dict().keys() == want.keys() and all(torch.equal(bare.state_dict()[k], want[k]) for k in want)



def test_the_base_comes_back_beside_an_adapter_that_saves_a_module_the_first_does_not(llama_adapters, tmp_path):
    # The base is wrapped as the first adapter is (no modules_to_save), then given lm_head to save as a later adapter
    # does: that wrapper was left with PEFT's active adapter ["default"], and member(i) and save_members of the base
    # raised "unhashable type: 'list'" in PEFT's unload()
    base, adapters = llama_adapters
    saving = save_adapter(LLAMA, base, tmp_path / "saving", 3, r=4, target_modules=["q_proj"],
                          modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    wide = WideModel.from_pretrained([adapters[1], str(base), saving])
    references = [alone(LLAMA, base, adapters[1]), LLAMA.model_class.from_pretrained(base).eval(),
                  alone(LLAMA, base, saving)]
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    with torch.no_grad():
        assert torch.equal(wide.member(1)(**inputs).logits, references[1](**inputs).logits)
    wide.save_members(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(LLAMA.model_class.from_pretrained(tmp_path / "saved" / "member-1").eval()(**inputs).logits,
                           references[1](**inputs).logits)

def test_loading_adapters_shows_no_warning_of_peft_reading_a_deprecated_attribute(llama_adapters):
    """PEFT reads ``is_gradient_checkpointing``, deprecated by transformers 5: nothing a user can act on. The base in
    the list makes the loader wrap a full member too (``get_peft_model``)."""
    base, adapters = llama_adapters
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        WideModel.from_pretrained([str(base), adapters[0]])
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_a_full_checkpoint_of_the_base_architecture_among_adapters(llama_adapters, tmp_path):
    base, adapters = llama_adapters
    full = LLAMA.build(5)  # another model of the base's architecture: a member with its own weights
    full.save_pretrained(tmp_path / "full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wide = WideModel.from_pretrained([adapters[0], str(tmp_path / "full")])
    # PEFT's warning that the adapters' config names another base, wrapping the full member: nothing to act on
    assert not [w for w in caught if "base_model_name_or_path" in str(w.message)]
    references = [alone(LLAMA, base, adapters[0]), full]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert type(wide.member(1)) is LLAMA.model_class and torch.equal(
        wide.member(1).model.embed_tokens.weight, full.model.embed_tokens.weight)
    lora = next(e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear")
    assert wide.model.get_submodule(lora.fqn).base_layer.weight.shape[0] == 2  # the base weights stacked
    with pytest.raises(NotImplementedError, match="not all loaded as adapters of one base"):
        wide.save_pretrained(tmp_path / "saved")  # neither adapters of one base nor a plain transformers model


def test_bert_classifier_with_a_saved_head(tmp_path):
    BERT.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(BERT, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                             target_modules=["query", "value"], modules_to_save=["classifier"], task_type="SEQ_CLS")
                for seed in range(3)]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(BERT, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, BERT.inputs(3, padded=True)) <= TOLERANCE
    heads = [e for e in wide.plan.entries.values() if "modules_to_save.default" in e.fqn]
    assert heads and all(e.kind == Kind.PRIMITIVE for e in heads)  # each member's own head, stacked


def test_adapters_that_save_different_modules(tmp_path):
    """``modules_to_save`` that differ between adapters were refused ("has no tensor ..."): a member gets a saved
    copy of the base's module for each one it lacks (exact), taken out again by ``member(i)``."""
    BERT.build(0).save_pretrained(tmp_path / "base")
    saved = [["classifier"], [], ["classifier", "pooler"]]
    adapters = [save_adapter(BERT, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                             target_modules=["value"] if seed == 1 else ["query"], modules_to_save=modules,
                             task_type="SEQ_CLS") for seed, modules in enumerate(saved)]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(BERT, tmp_path / "base", a) for a in adapters]
    inputs = BERT.inputs(3, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE and not wide.plan.fallbacks
    for i, reference in enumerate(references):
        member, want = wide.member(i).state_dict(), reference.state_dict()  # as saved: no copies it lacked
        assert member.keys() == want.keys() and all(torch.equal(member[k], want[k]) for k in want)
    for folder, adapter in zip(wide.save_members(tmp_path / "members"), adapters):
        with torch.no_grad():
            assert torch.equal(alone(BERT, tmp_path / "base", str(folder))(**inputs).logits,
                               alone(BERT, tmp_path / "base", adapter)(**inputs).logits)


def test_adapters_that_save_one_module_inside_another_are_refused_and_merge_is_the_way_out(tmp_path):
    # one saves a Llama MLP whole, the other its down_proj: a wrapper was put inside the other's wrapper, and the load
    # failed on "member 1 has no tensor ...original_module.weight", naming neither the option nor the way out
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, target_modules=["q_proj"],
                             modules_to_save=[saved], task_type="CAUSAL_LM")
                for seed, saved in enumerate(["mlp", "down_proj"])]
    for order in (adapters, adapters[::-1]):
        with pytest.raises(IncompatibleMembersError, match=r"saves model\.layers\.0\.mlp whole \(modules_to_save\), "
                                                           r"and member \d saves model\.layers\.0\.mlp\.down_proj "
                                                           r"inside it"):
            WideModel.from_pretrained(order)
    wide = WideModel.from_pretrained(adapters, merge=True)
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= 1e-4  # merged weights round


def test_an_adapter_that_ties_its_saved_tables_beside_one_that_saves_the_head_alone(tmp_path):
    """Member 0 saves its embeddings tied to its head (``ensure_weight_tying``), member 1 its head alone: the wide
    model's ties were member 0's, so ``member(1)`` (and ``save_members``, and a saved ensemble loaded back) copied
    member 1's embeddings, the base's, over its head (1.99 off). A tie is the wide model's only where every member
    holds it; either order."""
    LLAMA.build(0).save_pretrained(tmp_path / "base")  # (its head tied to its embeddings)
    tied = dict(modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, r=2 + 2 * seed,
                             target_modules=["q_proj"], task_type="CAUSAL_LM",
                             **(tied if seed == 0 else dict(modules_to_save=["lm_head"]))) for seed in range(2)]
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    inputs = LLAMA.inputs(2, padded=True)
    for order in ([0, 1], [1, 0]):
        wide = WideModel.from_pretrained([adapters[i] for i in order])
        ordered = [references[i] for i in order]
        assert max_member_error(wide, ordered, inputs) <= TOLERANCE
        folders = wide.save_members(tmp_path / f"members{order[0]}")
        for i, (reference, folder) in enumerate(zip(ordered, folders)):
            with torch.no_grad():
                want = reference(**inputs).logits
                assert torch.equal(wide.member(i)(**inputs).logits, want)
                assert torch.equal(alone(LLAMA, tmp_path / "base", str(folder))(**inputs).logits, want)


def test_an_adapter_that_trains_every_bias_beside_one_that_saves_the_head(tmp_path):
    """PEFT's ``bias="all"`` trains the head's bias where the adapter does not save the head; another adapter saves
    it whole (and the pooler). The head was to get a zero LoRA layer for the biases, over the other member's saved
    copy, and the load was refused ("a ModulesToSaveWrapper: hf-wide can give it no zero LoRA"): a module saved
    whole carries its biases, so the first member gets a saved copy of its own head and pooler instead."""
    BERT.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(BERT, tmp_path / "base", tmp_path / "a0", 0, r=4, target_modules=["query"], bias="all"),
                save_adapter(BERT, tmp_path / "base", tmp_path / "a1", 1, r=2, target_modules=["value"],
                             modules_to_save=["classifier", "pooler"])]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(BERT, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, BERT.inputs(3, padded=True)) <= TOLERANCE and not wide.plan.fallbacks
    for i, reference in enumerate(references):
        member, want = wide.member(i).state_dict(), reference.state_dict()
        assert member.keys() == want.keys() and all(torch.equal(member[k], want[k]) for k in want)


def test_peft_models_that_target_and_save_different_modules_fuse_with_from_models():
    """``from_models`` of PeftModels whose adapters differ in ``target_modules``, ``modules_to_save`` and ``bias``
    was refused ("member 1 has no tensor ..."): views of them get the zero updates and saved copies that adapters
    loaded from folders get. The models given are left as they were, and ``member(i)`` is each of them again."""
    from lora_members import adapted

    base, inputs = BERT.build(0), BERT.inputs(3, padded=True)
    members = [adapted(base, 0, r=4, target_modules=["query", "value"], modules_to_save=["classifier"]),
               adapted(base, 1, r=8, target_modules=["query"], modules_to_save=["classifier", "pooler"]),
               adapted(base, 2, r=2, target_modules=["value"], bias="all")]
    with torch.no_grad():  # what bias="all" trains: every bias of member 2's own
        for name, p in members[2].named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    before = [dict(m.named_modules()) for m in members]
    trainable = [{name: p.requires_grad for name, p in m.named_parameters()} for m in members]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, inputs) <= TOLERANCE and not wide.plan.fallbacks
    assert {e.wide_class for e in wide.plan.entries.values()} >= {"WideLoraLinear"}
    for member, modules, flags in zip(members, before, trainable):  # the very modules each held, as they were
        assert dict(member.named_modules()).keys() == modules.keys()
        assert all(member.get_submodule(path) is module for path, module in modules.items())
        assert {name: p.requires_grad for name, p in member.named_parameters()} == flags  # bias="all": still trained
    for i, member in enumerate(members):
        got, want = wide.member(i).state_dict(), member.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_peft_models_beside_plain_models_of_their_base_fuse_with_from_models():
    """``from_models`` took PeftModels or plain models, not both ("all members must be the same model class"), where
    ``from_pretrained`` takes the base and full checkpoints beside adapters: a view of each plain model is wrapped as
    the adapters are, with zero updates, and ``member(i)`` is that plain model again; the models given stay as they
    were."""
    from lora_members import adapted

    base, other, inputs = BERT.build(0), BERT.build(5), BERT.inputs(3, padded=True)
    members = [base, adapted(base, 1, r=4, target_modules=["query"], modules_to_save=["classifier"]), other]
    trainable = [{name: p.requires_grad for name, p in m.named_parameters()} for m in members]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, inputs) <= TOLERANCE and not wide.plan.fallbacks
    for i in (0, 2):
        got, want = wide.member(i).state_dict(), members[i].state_dict()
        assert type(wide.member(i)) is BERT.model_class and got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert [type(m) for m in members[::2]] == [BERT.model_class] * 2  # not wrapped in place
    assert [{name: p.requires_grad for name, p in m.named_parameters()} for m in members] == trainable


def test_the_text_classification_pipeline_on_adapters(tmp_path):
    from hf_wide.pipelines import pipeline

    sys.path.insert(0, str(Path(__file__).parent / "pipelines"))
    from text_members import bert_tokenizer

    tokenizer = bert_tokenizer(tmp_path / "tok")
    BERT.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(BERT, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                             target_modules=["query", "value"], modules_to_save=["classifier"], task_type="SEQ_CLS")
                for seed in range(3)]
    texts = ["the cat sat on the mat", "a very bad movie"]
    results = pipeline("text-classification", model=adapters, tokenizer=tokenizer)(texts)
    with torch.no_grad():
        probs = torch.stack([alone(BERT, tmp_path / "base", a)(**tokenizer(texts, return_tensors="pt", padding=True))
                             .logits.softmax(-1) for a in adapters])  # (N, B, C)
    for b, result in enumerate(results):
        assert result["score"] == pytest.approx(float(probs[:, b].mean(0).max()), abs=1e-5)
        for i, member in enumerate(result["members"]):
            assert member["score"] == pytest.approx(float(probs[i, b].max()), abs=1e-5)


def test_vit_image_classifier(tmp_path):
    VIT.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(VIT, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"]) for seed in range(2)]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(VIT, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, VIT.inputs(2, padded=False)) <= TOLERANCE


def test_t5_adapters_on_the_feed_forward_run_fused(tmp_path):
    """T5's feed-forward reads ``self.wo.weight.dtype``, which PEFT's LoRA layers give (their base's weight): the
    wide LoRA layer had no ``weight``, the layer raised and ran as each member's own code (exact, member by member)."""
    t5 = CASES["t5-encoder"]
    t5.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(t5, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4 * (seed + 1), lora_alpha=8,
                             target_modules=["q", "v", "wi", "wo"]) for seed in range(2)]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(t5, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, t5.inputs(2, padded=True)) <= TOLERANCE
    assert not wide.plan.fallbacks and any(e.fqn.endswith("DenseReluDense.wo") for e in wide.plan.entries.values()
                                           if e.wide_class == "WideLoraLinear")


def test_gpt2_adapters_over_conv1d_layers(tmp_path):
    """GPT-2's layers are transformers' ``Conv1D`` (weight ``(D_in, D_out)``), which PEFT wraps with
    ``fan_in_fan_out=True``: ranks 2, 4 and 8 on different targets, one with rsLoRA, and a full checkpoint of the
    architecture among them (its own Conv1D weights: the bases stacked)."""
    with warnings.catch_warnings():  # PEFT says it sets fan_in_fan_out for Conv1D
        warnings.simplefilter("ignore", UserWarning)
        GPT2.build(0).save_pretrained(tmp_path / "base")
        adapters = [
            save_adapter(GPT2, tmp_path / "base", tmp_path / "a0", 0, r=4, lora_alpha=8,
                         target_modules=["c_attn", "c_proj", "c_fc"], task_type="CAUSAL_LM"),
            save_adapter(GPT2, tmp_path / "base", tmp_path / "a1", 1, r=8, lora_alpha=16, target_modules=["c_attn"],
                         task_type="CAUSAL_LM"),
            save_adapter(GPT2, tmp_path / "base", tmp_path / "a2", 2, r=2, lora_alpha=4, use_rslora=True,
                         target_modules=["c_fc", "c_proj"], task_type="CAUSAL_LM"),
        ]
    assert all(json.loads((Path(a) / "adapter_config.json").read_text())["fan_in_fan_out"] for a in adapters)
    wide = WideModel.from_pretrained(adapters)
    references = [alone(GPT2, tmp_path / "base", a) for a in adapters]
    inputs = GPT2.inputs(3, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    lora = [e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    assert len(lora) == 2 * 4 and not wide.plan.fallbacks  # c_attn, attn.c_proj, c_fc, mlp.c_proj per layer
    tokens = wide.generate(**inputs, max_new_tokens=4, do_sample=False)
    for i, reference in enumerate(references):
        assert torch.equal(tokens[i], reference.generate(**inputs, max_new_tokens=4, do_sample=False))
        member, want = wide.member(i).state_dict(), reference.state_dict()  # the adapter as saved, no zero updates
        assert member.keys() == want.keys() and all(torch.equal(member[k], want[k]) for k in want)
    for folder, adapter in zip(wide.save_members(tmp_path / "members"), adapters):  # ordinary PEFT adapters
        again, original = alone(GPT2, tmp_path / "base", str(folder)), alone(GPT2, tmp_path / "base", adapter)
        assert lora_keys(again) == lora_keys(original)
        with torch.no_grad():
            assert torch.equal(again(**inputs).logits, original(**inputs).logits)

    full = GPT2.build(5)
    full.save_pretrained(tmp_path / "full")
    mixed = WideModel.from_pretrained([adapters[1], adapters[2], str(tmp_path / "full")])
    assert max_member_error(mixed, [references[1], references[2], full], inputs) <= TOLERANCE
    layer = mixed.model.get_submodule(next(e.fqn for e in mixed.plan.entries.values()
                                           if e.wide_class == "WideLoraLinear"))
    assert type(layer.base_layer).__name__ == "WideConv1D"  # the members' own Conv1D weights, stacked
    member, want = mixed.member(0).state_dict(), references[1].state_dict()  # c_attn only: no zero updates left
    assert member.keys() == want.keys() and all(torch.equal(member[k], want[k]) for k in want)


@pytest.mark.parametrize("case, targets", [(BERT, ["query", "value"]), (GPT2, ["c_attn"])], ids=["bert", "gpt2"])
def test_adapters_that_train_the_base_biases(case, targets, tmp_path):
    """PEFT's ``bias="all"`` and ``bias="lora_only"`` train the base's biases and save them with the adapter. They
    were loaded into the base tensors the members share, so every member ran the last adapter's biases (0.07 off
    on BERT logits), and the check at fuse time could not see it (its members were loaded the same way). Each
    member now has biases of its own, over the base's one weight."""
    with warnings.catch_warnings():  # PEFT says it sets fan_in_fan_out for GPT-2's Conv1D
        warnings.simplefilter("ignore", UserWarning)
        case.build(0).save_pretrained(tmp_path / "base")
        task = dict(modules_to_save=["classifier"], task_type="SEQ_CLS") if case is BERT else dict(task_type="CAUSAL_LM")
        adapters = [save_adapter(case, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                                 target_modules=targets, bias=bias, **task)
                    for seed, bias in enumerate(["all", "lora_only", "none"])]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(case, tmp_path / "base", a) for a in adapters]
    inputs = case.inputs(3, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    for entry in (e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"):
        layer = wide.model.get_submodule(entry.fqn)
        assert layer.base_layer.weight.dim() == 2 and layer.base_bias.shape[0] == 3  # one weight, N biases
    # bias="all" trains every bias: the linears no adapter targets hold one weight too (given zero updates); only
    # a head saved whole is stacked
    stacked = [e.fqn for e in wide.plan.entries.values() if e.wide_class in ("WideLinear", "WideConv1D")]
    assert all("modules_to_save" in fqn for fqn in stacked)
    for i, reference in enumerate(references):
        member, want = wide.member(i).state_dict(), reference.state_dict()
        assert member.keys() == want.keys() and all(torch.equal(member[k], want[k]) for k in want)
    for folder, adapter in zip(wide.save_members(tmp_path / "members"), adapters):  # the biases saved too
        again, original = alone(case, tmp_path / "base", str(folder)), alone(case, tmp_path / "base", adapter)
        with torch.no_grad():
            assert torch.equal(again(**inputs).logits, original(**inputs).logits)
    wide.save_pretrained(tmp_path / "ensemble")
    back = WideModel.from_pretrained(str(tmp_path / "ensemble"))
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, wide(**inputs).logits)


def test_an_adapter_that_holds_a_base_weight_is_refused_and_merge_is_the_way_out(llama_adapters, tmp_path):
    """An adapter file with a tensor of the base itself (edited by hand, or by a tool other than PEFT) would be
    loaded into the base every member shares."""
    from safetensors.torch import load_file, save_file

    base, adapters = llama_adapters
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "adapter_config.json").write_bytes((Path(adapters[1]) / "adapter_config.json").read_bytes())
    tensors = load_file(Path(adapters[1]) / "adapter_model.safetensors")
    weight = LLAMA.model_class.from_pretrained(base).model.layers[0].mlp.up_proj.weight.detach()
    tensors["base_model.model.model.layers.0.mlp.up_proj.weight"] = weight + 0.1
    save_file(tensors, edited / "adapter_model.safetensors")
    with pytest.raises(IncompatibleMembersError, match=r"member 1 .*layers\.0\.mlp\.up_proj\.weight.*merge=True"):
        WideModel.from_pretrained([adapters[0], str(edited)])
    wide = WideModel.from_pretrained([adapters[0], str(edited)], merge=True)
    references = [alone(LLAMA, base, adapters[0]), alone(LLAMA, base, str(edited))]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= 1e-4  # merged weights round


@pytest.fixture(scope="module")
def embedding_adapters(tmp_path_factory):
    """A Llama base (its output layer tied to the embedding) and three adapters: LoRA on the embedding and q, on v
    only, on the embedding only (rsLoRA). PEFT saves an embedding it adapts whole (``save_embedding_layers``)."""
    root = tmp_path_factory.mktemp("embedding")
    LLAMA.build(0).save_pretrained(root / "base")
    adapters = [save_adapter(LLAMA, root / "base", root / "a0", 0, r=4, target_modules=["embed_tokens", "q_proj"]),
                save_adapter(LLAMA, root / "base", root / "a1", 1, r=8, lora_alpha=4, target_modules=["v_proj"]),
                save_adapter(LLAMA, root / "base", root / "a2", 2, r=2, use_rslora=True, target_modules=["embed_tokens"])]
    return root / "base", adapters


def test_adapters_of_the_embedding_hold_the_base_table_once(embedding_adapters, tmp_path):
    """The table each adapter's file holds equals the base's: loaded, it is the base's one tensor again, which the
    fused embedding and the tied output layer hold. An adapter that does not adapt the embedding gets a zero
    update there; taken out, each member is its adapter as saved."""
    from safetensors import safe_open

    from hf_wide.adapters import adapter_config, load_adapter_members

    base, adapters = embedding_adapters
    with safe_open(Path(adapters[0]) / "adapter_model.safetensors", "pt") as f:
        assert "base_model.model.model.embed_tokens.base_layer.weight" in f.keys()  # the table, saved whole
    wide = WideModel.from_pretrained(adapters)
    references = [alone(LLAMA, base, a) for a in adapters]
    inputs = LLAMA.inputs(3, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    path = "base_model.model.model.embed_tokens"
    assert wide.plan.entries[path].wide_class == "WideLoraEmbedding" and not wide.plan.fallbacks
    block = wide.model.get_submodule(path)
    assert wide.model.get_submodule("base_model.model.lm_head").weight is block.base_layer.weight
    models, _, _, _ = load_adapter_members(adapters, adapters, [adapter_config(Path(a)) for a in adapters])
    assert len({id(m.get_submodule(path).base_layer.weight) for m in models}) == 1  # the base's, held once
    wide.save_pretrained(tmp_path / "ensemble")  # the adapters, the base referenced
    with torch.no_grad():
        assert torch.equal(WideModel.from_pretrained(str(tmp_path / "ensemble"))(**inputs).logits,
                           wide(**inputs).logits)
    wide.save_members(tmp_path / "members")
    for i, reference in enumerate(references):
        assert (type(wide.member(i).get_submodule(path)) is torch.nn.Embedding) == (i == 1)  # its zero update out
        back = peft.PeftModel.from_pretrained(LLAMA.model_class.from_pretrained(base), tmp_path / "members" /
                                              f"member-{i}").eval()
        assert lora_keys(back) == lora_keys(reference)
        with torch.no_grad():
            assert torch.equal(back(**inputs).logits, reference(**inputs).logits)


def test_adapters_of_the_embedding_over_a_bfloat16_base_compute_as_peft_does(embedding_adapters):
    """PEFT keeps an embedding's adapter in float32 over a bfloat16 base too, and adds its update in float32."""
    base, adapters = embedding_adapters
    wide = WideModel.from_pretrained(adapters, dtype=torch.bfloat16)
    assert wide.model.get_submodule("base_model.model.model.embed_tokens").lora_embedding_A.dtype == torch.float32
    inputs = LLAMA.inputs(3, padded=True)
    with torch.no_grad():
        out = wide(**inputs).logits
        for i, adapter in enumerate(adapters):
            reference = peft.PeftModel.from_pretrained(LLAMA.model_class.from_pretrained(base, dtype=torch.bfloat16),
                                                       adapter).eval()
            want = reference(**inputs).logits
            error = (out[i].float() - want.float()).abs()
            assert (error > 0).float().mean() < 0.05 and error.max() <= 2 ** -6 * max(1.0, want.abs().max().item())


def test_adapters_of_a_scaled_embedding_beside_one_that_does_not_adapt_it(tmp_path):
    """Gemma's embedding scales its lookup (an ``nn.Embedding`` subclass, which PEFT adapts as any embedding): the
    adapter that does not adapt it was refused its zero update ("hf-wide can give it no zero LoRA"). Now it gets
    one; the fused embedding runs each member's own code (the block declines a scaled table), exactly."""
    gemma = CASES["gemma3-causallm"]
    gemma.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(gemma, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, target_modules=targets)
                for seed, targets in enumerate([["embed_tokens", "q_proj"], ["q_proj"]])]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(gemma, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, gemma.inputs(3, padded=True)) <= TOLERANCE
    for i, reference in enumerate(references):  # the zero update taken out again
        member, want = wide.member(i).state_dict(), reference.state_dict()
        assert member.keys() == want.keys() and all(torch.equal(member[k], want[k]) for k in want)


def test_the_base_and_a_full_checkpoint_beside_an_adapter_of_the_embedding(embedding_adapters, tmp_path):
    """A full member gets the adapters' structure with zero updates: for a LoRA embedding, a zero
    ``lora_embedding_B`` (the loader reached for ``lora_B``, which a LoRA embedding leaves empty: KeyError)."""
    base, adapters = embedding_adapters
    LLAMA.build(5).save_pretrained(tmp_path / "full")
    wide = WideModel.from_pretrained([str(base), adapters[0], str(tmp_path / "full")])
    references = [LLAMA.model_class.from_pretrained(base).eval(), alone(LLAMA, base, adapters[0]),
                  LLAMA.model_class.from_pretrained(tmp_path / "full").eval()]
    assert max_member_error(wide, references, LLAMA.inputs(3, padded=True)) <= TOLERANCE
    for i in (0, 2):  # the plain models again, each with its own weights
        got, want = wide.member(i).state_dict(), references[i].state_dict()
        assert type(wide.member(i)) is LLAMA.model_class and got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_only_the_tables_of_adapted_embeddings_are_copied_as_an_adapter_loads(embedding_adapters, tmp_path):
    """An adapter's file names the embedding table it adapts and saves whole by its base layer; a module it saves
    whole (``modules_to_save``) by names that read like the base's own (``classifier.weight``), but that loads
    into a copy of its own: copying the base's tensors of those too would hold a second saved head (a whole
    ``lm_head``, say) while each adapter loads, for nothing."""
    from hf_wide.adapter_base import adapter_keys
    from hf_wide.adapter_views import held_base_tensors

    base, adapters = embedding_adapters
    llama = LLAMA.model_class.from_pretrained(base)
    assert held_base_tensors(adapter_keys(Path(adapters[0])), llama) == {"model.embed_tokens.weight"}
    assert held_base_tensors(adapter_keys(Path(adapters[1])), llama) == set()  # v_proj only
    BERT.build(0).save_pretrained(tmp_path / "bert")
    head = save_adapter(BERT, tmp_path / "bert", tmp_path / "head", 0, r=4, target_modules=["query"],
                        modules_to_save=["classifier"])
    assert "base_model.model.classifier.weight" in adapter_keys(Path(head))  # the head, saved whole
    assert held_base_tensors(adapter_keys(Path(head)), BERT.model_class.from_pretrained(tmp_path / "bert")) == set()


def test_an_adapter_whose_saved_table_differs_from_the_base_is_refused(embedding_adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    base, adapters = embedding_adapters
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "adapter_config.json").write_bytes((Path(adapters[0]) / "adapter_config.json").read_bytes())
    tensors = load_file(Path(adapters[0]) / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.base_layer.weight"] += 0.1
    save_file(tensors, edited / "adapter_model.safetensors")
    with pytest.raises(IncompatibleMembersError, match=r"member 1 .*model\.embed_tokens\.weight.* differ from the "
                                                        r"base's.*merge=True"):
        WideModel.from_pretrained([adapters[1], str(edited)])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="mappings are read from /proc (Linux)")
def test_each_adapter_is_held_once_in_the_tensors_the_wide_model_keeps(llama_adapters):
    """As the adapters are loaded, every LoRA weight moves into one stacked tensor per layer (the members' become
    views of it), which ``WideLoraLinear`` then holds as it is: no second copy of the adapters while the base is
    traced and fused, and no adapter file left mapped."""
    from hf_wide.adapters import adapter_config, load_adapter_members

    _, adapters = llama_adapters
    models, _, _, _ = load_adapter_members(adapters, adapters, [adapter_config(Path(a)) for a in adapters])
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert not [a for a in adapters if f"{a}/adapter_model.safetensors" in maps]
    path = "base_model.model.model.layers.1.mlp.down_proj"  # ranks 4 and 16, and a zero update for member 1
    views = [m.get_submodule(path).lora_B["default"].weight for m in models]
    wide = WideModel.from_models(models, copy_shared=False)
    held = wide.model.get_submodule(path).lora_B
    assert held.shape == (3, views[0].shape[0], 16)
    assert {v.untyped_storage().data_ptr() for v in views} == {held.untyped_storage().data_ptr()}


def test_adapters_over_a_bfloat16_base_compute_as_peft_does(llama_adapters, tmp_path):
    """Over a half-precision base PEFT keeps the adapters in float32 (``autocast_adapter_dtype``) and adds their
    update in float32, rounding once: so does the wide model, and it loads them as ``PeftModel.from_pretrained``
    does (PEFT's ``low_cpu_mem_usage`` would round them to bfloat16 first). Left: float32 summation order, which
    may move a logit by one bfloat16 step; before, 80% of the logits differed, by up to 0.03."""
    base, adapters = llama_adapters
    wide = WideModel.from_pretrained(adapters, dtype=torch.bfloat16)
    references = [peft.PeftModel.from_pretrained(LLAMA.model_class.from_pretrained(base, dtype=torch.bfloat16),
                                                 a).eval() for a in adapters]
    inputs = LLAMA.inputs(3, padded=True)
    with torch.no_grad():
        out = wide(**inputs).logits
        for i, reference in enumerate(references):
            want = reference(**inputs).logits
            error = (out[i].float() - want.float()).abs()
            assert (error > 0).float().mean() < 0.05 and error.max() <= 2 ** -6 * max(1.0, want.abs().max().item())
    lora = [m for m in wide.modules() if type(m).__name__ == "WideLoraLinear"]
    assert lora and not wide.plan.fallbacks and {m.lora_A.dtype for m in lora} == {torch.float32}
    assert wide.member(0).base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == (
        torch.float32)
    # saved and loaded back as it was saved: the ensemble's bfloat16, not the base checkpoint's float32
    wide.save_pretrained(tmp_path / "saved")
    back = WideModel.from_pretrained(tmp_path / "saved")
    assert {p.dtype for n, p in back.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, out)


def test_adapters_that_replicate_layers_fuse_only_when_they_all_replicate_them_alike(llama_adapters, tmp_path):
    # layer_replication builds a deeper model whose layers share the base's tensors in its pattern. Beside the base,
    # the base member was given the adapter's replicated layers (0.088 off, silently); two patterns fused right, but
    # member(1) came back in member 0's (0.27 off); beside an adapter without one, an AttributeError.
    base, _ = llama_adapters

    def replicating(name, seed, pattern):
        return save_adapter(LLAMA, base, tmp_path / name, seed, r=4, target_modules=["q_proj", "v_proj"],
                            task_type="CAUSAL_LM", layer_replication=pattern)

    same = [replicating(f"same{i}", i, [[0, 2], [1, 2]]) for i in range(2)]
    other = replicating("other", 2, [[0, 1], [0, 2]])
    plain = save_adapter(LLAMA, base, tmp_path / "plain", 3, r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    wide = WideModel.from_pretrained(same)
    references = [alone(LLAMA, base, a) for a in same]
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    with torch.no_grad():
        for i, reference in enumerate(references):
            assert (wide.member(i).eval()(**inputs).logits - reference(**inputs).logits).abs().max() <= TOLERANCE
    for members, says in [([str(base), same[0]], r"differently: member 0 \(.*\) not, member 1 \(.*\) \[\[0, 2\]"),
                          ([same[0], other], r"\) \[\[0, 2\], \[1, 2\]\], member 1 \(.*\) \[\[0, 1\], \[0, 2\]\]"),
                          ([same[0], plain], r"member 1 \(.*\) not\.")]:
        with pytest.raises(IncompatibleMembersError, match=says):
            WideModel.from_pretrained(members)
    with pytest.raises(IncompatibleMembersError, match="member 1 not"):
        WideModel.from_models([references[0], LLAMA.model_class.from_pretrained(base).eval()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dora_adapters_of_different_targets_over_a_half_precision_base(llama_adapters, tmp_path, dtype):
    # A member without DoRA on a layer another adapts gets a DoRA no-op: its magnitude the norms of the base's rows,
    # to scale by exactly 1. It was made in the base's dtype, and rounded there it scaled by 1 +- a half-precision
    # step: a third of the logits or more were off (by one bfloat16 step), where DoRA with the same targets was exact.
    base, _ = llama_adapters
    adapters = [save_adapter(LLAMA, base, tmp_path / f"dora{i}", i, r=4, lora_alpha=8, use_dora=True,
                             target_modules=targets, task_type="CAUSAL_LM")
                for i, targets in enumerate([["q_proj", "v_proj"], ["k_proj", "v_proj"]])]
    wide = WideModel.from_pretrained(adapters, dtype=dtype)
    inputs = LLAMA.inputs(3, padded=True)
    with torch.no_grad():
        out = wide(**inputs).logits
        for i, adapter in enumerate(adapters):
            reference = peft.PeftModel.from_pretrained(LLAMA.model_class.from_pretrained(base, dtype=dtype), adapter)
            want = reference.eval()(**inputs).logits
            error = (out[i].float() - want.float()).abs()
            assert (error > 0).float().mean() < 0.05 and error.max() <= 2 ** -6 * max(1.0, want.abs().max().item())


def test_falcon_adapters_of_different_targets(tmp_path):
    # Falcon's linears are FalconLinear, an nn.Linear PEFT adapts as one: a member without an adapter there was
    # refused its zero LoRA
    import transformers

    torch.manual_seed(0)
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
        multi_query=True, alibi=False, bias=False))
    falcon.save_pretrained(tmp_path / "base")

    class Falcon:  # what save_adapter and alone read of a case
        model_class = transformers.FalconForCausalLM

    adapters = [save_adapter(Falcon, tmp_path / "base", tmp_path / f"a{i}", i, r=4, target_modules=targets,
                             task_type="CAUSAL_LM")
                for i, targets in enumerate([["query_key_value"], ["query_key_value", "dense_4h_to_h"]])]
    wide = WideModel.from_pretrained(adapters)
    inputs = {"input_ids": torch.randint(3, 64, (2, 6))}
    assert max_member_error(wide, [alone(Falcon, tmp_path / "base", a) for a in adapters], inputs) <= TOLERANCE


def test_the_base_named_by_another_path_is_the_base(llama_adapters, tmp_path, monkeypatch):
    # The adapters name the base by its absolute path: given as "base/" or relative, it loaded a second time as a
    # full checkpoint beside the adapters, and saving the ensemble was refused for it
    base, adapters = llama_adapters
    monkeypatch.chdir(base.parent)
    for name in (f"{base}/", base.name):
        wide = WideModel.from_pretrained([name, adapters[1]])
        assert wide.adapter_sources is not None  # (None where a full checkpoint other than the base is a member)
        wide.save_pretrained(tmp_path / "ensemble")


def test_prompt_learning_members_given_as_models_are_refused_by_name():
    # from_pretrained names the PEFT type; from_models let verification refuse them ("a layout that matches no
    # member's"), without saying why
    base = LLAMA.build(0)
    members = [peft.get_peft_model(LLAMA.build(0), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
               for _ in range(2)]
    with pytest.raises(IncompatibleMembersError, match="member 0 is a PREFIX_TUNING PeftModel: prompt learning"):
        WideModel.from_models(members)
    with pytest.raises(IncompatibleMembersError, match="member 1 is a PROMPT_TUNING PeftModel"):
        WideModel.from_models([base, peft.get_peft_model(LLAMA.build(0), peft.PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4))])


def test_adapters_of_which_one_has_a_bias_of_its_own_are_refused_by_name():
    members = [adapted(LLAMA.build(0), seed, r=4, target_modules=["q_proj"], lora_bias=bias)
               for seed, bias in enumerate((False, True))]
    with pytest.raises(IncompatibleMembersError, match="member 0 uses lora_bias=False and member 1 lora_bias=True"):
        WideModel.from_models(members)


def test_adapters_of_other_names_are_refused_by_name():
    base = LLAMA.build(0)
    named = peft.get_peft_model(LLAMA.build(0), peft.LoraConfig(r=4, target_modules=["q_proj"]), adapter_name="a")
    with pytest.raises(IncompatibleMembersError, match=r"member 0 holds the adapters \['default'\] and member 1 \['a'\]"):
        WideModel.from_models([adapted(base, 0, r=4, target_modules=["q_proj"]), named])


def test_adapters_of_other_task_types_are_refused_by_name(tmp_path):
    """Their PeftModel classes differ (PeftModelForCausalLM, PeftModel): the refusal said so, not why."""
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, target_modules=["q_proj"],
                             **({"task_type": "CAUSAL_LM"} if seed == 0 else {})) for seed in range(2)]
    with pytest.raises(IncompatibleMembersError, match=r"task_type \(adapter_config\.json\) differs: None for "
                                                       r"member 1 .*, CAUSAL_LM for member 0"):
        WideModel.from_pretrained(adapters)
