"""Adapters fused a group at a time and joined (hf_wide/adapter_groups.py): every member against
``PeftModel.from_pretrained(base, adapter)`` run alone, and the ways back to fusing them all at once (groups whose
plans differ, a module shared within groups and not between them, a join the final check finds wrong)."""

import logging

import pytest
import torch
from safetensors.torch import load_file
from conftest import CASES
from contrastive_pairs import adapter_alone, pair_adapters, pair_error, texts_and_images
from lora_members import EVERY_LINEAR, LLAMA, alone, save_adapter
from oracle import TOLERANCE, max_member_error

import hf_wide.adapter_groups as groups
import hf_wide.verify as verify
from hf_wide import Kind, WideModel
from hf_wide.blocks.lora import WideLoraLinear

BERT = CASES["bert-seqcls"]


@pytest.fixture
def joined(monkeypatch):
    """Groups of two or three members (four adapters or more are grouped); the number of groups each join took."""
    monkeypatch.setattr(groups, "GROUP_SIZE", 2)
    calls = []
    concatenate = groups.concatenate

    def spy(cls, wides, ids):
        calls.append(len(wides))
        return concatenate(cls, wides, ids)

    monkeypatch.setattr(groups, "concatenate", spy)
    return calls


def bert_adapters(root, seeds, **config):
    """A BERT classifier base and an adapter of it per seed: LoRA on query and value, the head saved whole."""
    BERT.build(0).save_pretrained(root / "base")
    def options():  # lists of their own: PEFT adds its task's head names to the list it is given
        return {"r": 4, "lora_alpha": 8, "target_modules": ["query", "value"], "modules_to_save": ["classifier"],
                "task_type": "SEQ_CLS", **config}

    return [save_adapter(BERT, root / "base", root / f"a{k}", seed, **options()) for k, seed in enumerate(seeds)]


def each_alone(wide, root, adapters) -> None:
    """The oracle: member i of ``wide`` is BERT adapter i over the base at ``root`` run alone."""
    references = [alone(BERT, root / "base", a) for a in adapters]
    assert max_member_error(wide, references, BERT.inputs(3, padded=True)) <= TOLERANCE


def test_bert_adapters_in_groups_equal_each_adapter_alone(joined, tmp_path):
    adapters = bert_adapters(tmp_path, range(5))
    adapters[3] = save_adapter(BERT, tmp_path / "base", tmp_path / "rs", 3, r=4, lora_alpha=16, use_rslora=True,
                               target_modules=["query", "value"], modules_to_save=["classifier"], task_type="SEQ_CLS")
    wide = WideModel.from_pretrained(adapters)
    assert joined == [2]  # 2 + 3 members
    assert wide.num_members == wide.plan.num_members == 5 and wide.member_ids == adapters
    references = [alone(BERT, tmp_path / "base", a) for a in adapters]
    inputs = BERT.inputs(3, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    heads = [e for e in wide.plan.entries.values() if "modules_to_save.default" in e.fqn]
    assert heads and all(e.kind == Kind.PRIMITIVE for e in heads)  # each member's own head: built anew, joined
    layers = [wide.model.get_submodule(e.fqn) for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    base = alone(BERT, tmp_path / "base", adapters[0]).base_model.model.bert.encoder.layer[0].attention.self.query
    assert layers and all(layer.lora_A.shape[0] == 5 for layer in layers)
    assert torch.equal(layers[0].base_layer.weight, base.base_layer.weight)  # one base weight, as in each group
    assert torch.equal(layers[0].scaling, torch.tensor([2.0, 2.0, 2.0, 8.0, 2.0]))  # rsLoRA: 16 / sqrt(4)
    for i in (1, 3):
        member, want = wide.member(i).state_dict(), references[i].state_dict()
        assert member.keys() == want.keys() and all(torch.equal(member[k], want[k]) for k in want)
    for folder, reference in zip(wide.save_members(tmp_path / "members"), references):
        with torch.no_grad():
            assert torch.equal(alone(BERT, tmp_path / "base", str(folder))(**inputs).logits,
                               reference(**inputs).logits)
    wide.save_pretrained(tmp_path / "ensemble")
    back = WideModel.from_pretrained(str(tmp_path / "ensemble"))
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, wide(**inputs).logits)
    assert back.adapter_sources.configs == wide.adapter_sources.configs and len(back.adapter_sources.configs) == 5


def test_the_joined_model_holds_the_base_once_and_each_adapter_once(joined, tmp_path):
    """What the joined model holds is the base's tensors, once, and the adapters' (their files' bytes), beside each
    layer's scalings: no copy of the base's weights in the joined LoRA layers."""
    adapters = bert_adapters(tmp_path, range(4))
    wide = WideModel.from_pretrained(adapters)
    assert joined == [2]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*wide.parameters(), *wide.buffers())}
    base = BERT.model_class.from_pretrained(tmp_path / "base")
    base_bytes = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in (*base.parameters(), *base.buffers())}
                     .values())
    adapter_bytes = sum(t.numel() * t.element_size() for a in adapters
                        for t in load_file(f"{a}/adapter_model.safetensors").values())
    assert base_bytes + adapter_bytes <= sum(held.values()) <= base_bytes + adapter_bytes + 4096


def test_llama_adapters_in_groups_generate_as_each_adapter_alone(joined, tmp_path):
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=4 + seed,
                             target_modules=EVERY_LINEAR, task_type="CAUSAL_LM") for seed in range(4)]
    wide = WideModel.from_pretrained(adapters)
    assert joined == [2]
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    tokens = wide.generate(**inputs, max_new_tokens=4, do_sample=False)
    for i, reference in enumerate(references):
        assert torch.equal(tokens[i], reference.generate(**inputs, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("config", [dict(use_dora=True), dict(bias="all")], ids=["dora", "own-biases"])
def test_dora_adapters_and_adapters_with_their_own_biases_join(joined, config, tmp_path):
    adapters = bert_adapters(tmp_path, range(4), **config)
    wide = WideModel.from_pretrained(adapters)
    assert joined == [2]
    each_alone(wide, tmp_path, adapters)
    layer = wide.model.get_submodule(next(e.fqn for e in wide.plan.entries.values()
                                          if e.wide_class == "WideLoraLinear"))
    held = layer.magnitude if "use_dora" in config else layer.base_bias
    assert held.shape[0] == 4


def test_unverified_groups_join_too(joined, tmp_path):
    adapters = bert_adapters(tmp_path, range(4))
    wide = WideModel.from_pretrained(adapters, verify=False)
    assert joined == [2]
    each_alone(wide, tmp_path, adapters)


@pytest.mark.parametrize("seeds, why", [
    ([0, 0, 1, 2], "plan differs"),  # members 0 and 1 one adapter twice: their group keeps every module whole
    ([0, 0, 1, 1], "differs between groups"),  # each group keeps its modules whole, and they differ
], ids=["plans-differ", "shared-apart"])
def test_groups_that_do_not_join_are_fused_all_at_once(joined, seeds, why, tmp_path, caplog):
    adapters = bert_adapters(tmp_path, seeds)
    with caplog.at_level(logging.INFO, logger="hf_wide.adapter_groups"):
        wide = WideModel.from_pretrained(adapters)
    assert joined == [] and why in caplog.text
    each_alone(wide, tmp_path, adapters)
    layer = wide.model.get_submodule(next(e.fqn for e in wide.plan.entries.values()
                                          if e.wide_class == "WideLoraLinear"))
    assert layer.lora_A.shape[0] == 4


def test_a_plan_whose_join_would_copy_the_base_is_fused_all_at_once_after_one_group(joined, tmp_path, caplog,
                                                                                    monkeypatch):
    """A LoRA on the embedding holds the base's table: the join would build it anew from its members' modules (a copy
    of the table), so the first group's plan sends the adapters to be fused all at once, before the others load."""
    loads, load = [], groups.load_adapter_members

    def counted(ids, *args, **kwargs):
        loads.append(len(ids))
        return load(ids, *args, **kwargs)

    monkeypatch.setattr(groups, "load_adapter_members", counted)
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4,
                             target_modules=["embed_tokens", "q_proj"]) for seed in range(4)]
    with caplog.at_level(logging.INFO, logger="hf_wide.adapter_groups"):
        wide = WideModel.from_pretrained(adapters)
    assert joined == [] and "would build anew" in caplog.text
    assert loads == [2, 4]  # the first group, then all at once
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_a_join_that_went_wrong_is_found_by_the_final_check(joined, monkeypatch, tmp_path, caplog):
    """A join that gives member 1 member 0's update: the joined model's output is checked against every member's
    own, and the members are then fused all at once."""
    join = WideLoraLinear.join.__func__

    def wrong(cls, layers, fold):
        built = join(cls, layers, fold)
        with torch.no_grad():
            built.lora_B[1] = built.lora_B[0]
        return built

    monkeypatch.setattr(WideLoraLinear, "join", classmethod(wrong))
    adapters = bert_adapters(tmp_path, range(4))
    with caplog.at_level(logging.WARNING, logger="hf_wide.adapter_groups"):
        wide = WideModel.from_pretrained(adapters)
    assert joined == [2] and "joined" in caplog.text and "fusing them all at once" in caplog.text
    each_alone(wide, tmp_path, adapters)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_adapters_of_a_contrastive_pair_join(joined, name, tmp_path):
    """CLIP's model (SigLIP's), rewritten to score each member's texts against its own images, is kept as a shared
    module is and reads the joined model's number of members; the last check takes the whole sample, whose texts
    are scored against every image (it was refused a join, and the first group loaded twice)."""
    adapters = pair_adapters(name, tmp_path, (4, 4, 4, 4))
    wide = WideModel.from_pretrained(adapters)
    assert joined == [2] and wide.plan.entries["base_model.model"].kind == Kind.REWRITTEN
    references = [adapter_alone(name, tmp_path, a) for a in adapters]
    for texts, images in ((2, 2), (3, 2)):
        assert pair_error(wide, references, texts_and_images(texts, images)) <= TOLERANCE


def test_adapters_that_build_different_modules_are_not_grouped(joined, tmp_path):
    adapters = bert_adapters(tmp_path, range(3)) + [
        save_adapter(BERT, tmp_path / "base", tmp_path / "k", 3, r=4, lora_alpha=8, target_modules=["key"],
                     modules_to_save=["classifier"], task_type="SEQ_CLS")]
    wide = WideModel.from_pretrained(adapters)
    assert joined == []
    each_alone(wide, tmp_path, adapters)


def test_check_by_rows_takes_the_whole_sample_where_rows_do_not_split(monkeypatch):
    class Wide:  # what check_by_rows reads of a wide model
        model = torch.nn.Linear(1, 1)
        own_batches = False

    seen = []

    def check(wide, outputs, args, kwargs, tf32=False):
        seen.append((kwargs["x"].shape[0], outputs[0][None][2].shape[0]))

    monkeypatch.setattr(verify, "check_whole", check)
    rows = [{None: ((), {}, torch.zeros(2, 3))}]
    assert groups.check_by_rows(Wide(), rows, (), {"x": torch.zeros(2, 4)}) is None
    assert seen == [(1, 1), (1, 1)]  # a row at a time, inputs and the members' outputs
    seen.clear()
    assert groups.check_by_rows(Wide(), rows, (), {"x": torch.zeros(2, 4), "table": torch.zeros(5)}) is None
    assert seen == [(2, 2)]  # a tensor without the sample's rows first: the whole sample
    seen.clear()
    Wide.own_batches = True  # rows scored against other rows (CLIP's texts against its images): the whole sample
    assert groups.check_by_rows(Wide(), rows, (), {"x": torch.zeros(2, 4)}) is None
    assert seen == [(2, 2)]


def test_groups_are_as_even_as_can_be_and_never_of_one_member():
    assert groups.group_slices(16, 4) == [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]
    assert groups.group_slices(9, 4) == [slice(0, 4), slice(4, 9)]
    assert groups.group_slices(5, 2) == [slice(0, 2), slice(2, 5)]
    assert not groups.grouped([{"r": 4}] * 7) and groups.grouped([{"r": 4}] * 8)
    assert not groups.grouped([{"r": 4}] * 8, merge=True) and not groups.grouped([{"r": 4}] * 7 + [None])
