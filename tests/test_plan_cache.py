"""The plans kept on disk (hf_wide/plan_cache.py): a list of adapters or of full checkpoints loaded again is fused by
the plan it was fused by, verified, not traced; a cached plan that is not the members' is traced past; with the cache
off, a file that does not read, or a cache that cannot be written, the members are traced as before."""

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import CASES
from lora_members import LLAMA, alone, save_adapter, save_llama_adapters
from oracle import TOLERANCE, max_member_error

from hf_wide import WideModel, hub, loading, plan_cache


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    return save_llama_adapters(tmp_path_factory.mktemp("llama"))  # ranks 4, 8 and 16 on different targets


def kinds(wide: WideModel) -> dict:
    return {fqn: (e.kind, e.wide_class) for fqn, e in wide.plan.entries.items()}


def assert_traced_unchecked_or_uncached(ids: list[str], traces: list, monkeypatch, **options) -> None:
    """With ``verify=False`` (a plan is never used unchecked) and with the cache off, ``ids`` are traced."""
    before = len(traces)
    WideModel.from_pretrained(ids, verify=False, **options)
    assert len(traces) == before + 1
    monkeypatch.setenv("HF_WIDE_DISABLE_PLAN_CACHE", "1")
    WideModel.from_pretrained(ids, **options)
    assert len(traces) == before + 2


def test_a_list_loaded_again_is_fused_by_its_cached_plan_verified_not_traced(llama_adapters, traces, plan_cache,
                                                                            monkeypatch):
    # Every load traced member 0 again: most of a load's time over adapters of one base
    base, adapters = llama_adapters
    ids = [str(base), *adapters]
    wide = WideModel.from_pretrained(ids)
    assert len(traces) == 1 and len(list(plan_cache.glob("*.json"))) == 1
    again = WideModel.from_pretrained(ids)
    assert len(traces) == 1 and kinds(again) == kinds(wide)
    inputs = LLAMA.inputs(3, padded=True)
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, wide(**inputs).logits)
    members = [LLAMA.model_class.from_pretrained(base).eval(), *(alone(LLAMA, base, a) for a in adapters)]
    assert max_member_error(again, members, inputs) <= TOLERANCE
    assert_traced_unchecked_or_uncached(ids, traces, monkeypatch)


def test_a_cached_plan_that_keeps_once_what_the_members_hold_apart_is_traced_past(llama_adapters, traces, tmp_path,
                                                                                 caplog):
    # A full checkpoint of the base's architecture in the base's place keys alike (no adapter config either way),
    # and the plan made with the base kept its modules once: member 0's would have run with the base's weights
    base, adapters = llama_adapters
    WideModel.from_pretrained([str(base), *adapters[:2]])
    other = tmp_path / "other"
    LLAMA.build(7).save_pretrained(other)
    with caplog.at_level(logging.INFO, logger="hf_wide.fuse"):
        wide = WideModel.from_pretrained([str(other), *adapters[:2]])
    assert len(traces) == 2 and "which the members hold apart" in caplog.text
    members = [LLAMA.model_class.from_pretrained(other).eval(), *(alone(LLAMA, base, a) for a in adapters[:2])]
    assert max_member_error(wide, members, LLAMA.inputs(3, padded=True)) <= TOLERANCE


def test_adapters_of_other_ranks_or_targets_are_planned_apart(llama_adapters, tmp_path, traces, plan_cache):
    base, adapters = llama_adapters
    WideModel.from_pretrained(adapters[:2])
    wider = save_adapter(LLAMA, base, tmp_path / "wider", 1, r=12, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                         task_type="CAUSAL_LM")  # adapters[1] at another rank
    wide = WideModel.from_pretrained([adapters[0], wider])
    assert len(traces) == 2 and len(list(plan_cache.glob("*.json"))) == 2
    members = [alone(LLAMA, base, a) for a in (adapters[0], wider)]
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_the_key_holds_the_structure_not_where_it_came_from(llama_adapters, monkeypatch):
    base = LLAMA.model_class.from_pretrained(llama_adapters[0])
    configs = [json.loads((llama_adapters[0].parent / f"a{i}" / "adapter_config.json").read_text()) for i in range(2)]
    key = plan_cache.plan_key(base, configs, {"verify": True})
    moved = [{**c, "base_model_name_or_path": "elsewhere/base", "revision": "main"} for c in configs]
    assert plan_cache.plan_key(base, moved, {"verify": True}) == key
    base.config._name_or_path = "elsewhere/base"
    assert plan_cache.plan_key(base, configs, {"verify": True}) == key
    assert plan_cache.plan_key(base, [configs[0], {**configs[1], "r": 2}], {"verify": True}) != key
    assert plan_cache.plan_key(base, configs[::-1], {"verify": True}) != key
    assert plan_cache.plan_key(base, configs, {"verify": True, "share_identical": False}) != key
    ours = plan_cache.code_digest
    monkeypatch.setattr(plan_cache, "code_digest", lambda: "another hf-wide")  # (its version number unchanged)
    assert plan_cache.plan_key(base, configs, {"verify": True}) != key
    monkeypatch.setattr(plan_cache, "code_digest", ours)
    assert plan_cache.plan_key(base.to(torch.bfloat16), configs, {"verify": True}) != key


@pytest.mark.parametrize("damage", ["torn", "foreign"])
def test_a_cached_plan_that_does_not_read_is_traced_past_and_written_anew(llama_adapters, traces, plan_cache, damage):
    _, adapters = llama_adapters
    wide = WideModel.from_pretrained(adapters[:2])
    (path,) = plan_cache.glob("*.json")
    path.write_text(path.read_text()[:100] if damage == "torn" else json.dumps({"entries": {"x": {"kind": "odd"}}}))
    again = WideModel.from_pretrained(adapters[:2])
    assert len(traces) == 2 and kinds(again) == kinds(wide)
    assert json.loads(path.read_text())["entries"].keys() == wide.plan.entries.keys()
    WideModel.from_pretrained(adapters[:2])
    assert len(traces) == 2


def test_a_cache_that_cannot_be_written_is_passed_over(llama_adapters, traces, tmp_path, monkeypatch):
    _, adapters = llama_adapters
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HF_WIDE_PLAN_CACHE", str(tmp_path / "a-file" / "plans"))  # (no folder can be made there)
    for _ in range(2):
        WideModel.from_pretrained(adapters[:2])
    assert len(traces) == 2
    assert not list(tmp_path.glob("**/*.tmp"))


@pytest.mark.parametrize("saved", [False, True], ids=["loaded-again", "saved-ensemble"])
def test_adapters_fused_in_groups_are_fused_by_the_known_plan_group_by_group(tmp_path, traces, monkeypatch, saved):
    """Adapters of one recipe, fused a group at a time (hf_wide/adapter_groups.py; groups of two here), loaded again
    or saved and loaded back: each group built by the plan, verified, none traced; the joined model exact."""
    import hf_wide.adapter_groups as groups

    monkeypatch.setattr(groups, "GROUP_SIZE", 2)
    base = tmp_path / "base"
    LLAMA.build(0).save_pretrained(base)
    adapters = [save_adapter(LLAMA, base, tmp_path / f"a{seed}", seed, r=4, lora_alpha=4 + seed,
                             target_modules=["o_proj", "down_proj"], task_type="CAUSAL_LM") for seed in range(4)]
    wide = WideModel.from_pretrained(adapters)
    assert len(traces) == 1
    if saved:
        wide.save_pretrained(tmp_path / "ensemble")
        monkeypatch.setenv("HF_WIDE_DISABLE_PLAN_CACHE", "1")
    joins, concatenate = [], groups.concatenate
    monkeypatch.setattr(groups, "concatenate", lambda *args: joins.append(1) or concatenate(*args))
    again = WideModel.from_pretrained(str(tmp_path / "ensemble") if saved else adapters)
    assert len(traces) == 1 and joins == [1] and kinds(again) == kinds(wide)
    inputs = LLAMA.inputs(3, padded=True)
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, wide(**inputs).logits)
    assert max_member_error(again, [alone(LLAMA, base, a) for a in adapters], inputs) <= TOLERANCE


def test_a_known_plan_a_group_disagrees_with_is_traced_past_all_at_once(tmp_path, traces, plan_cache, monkeypatch,
                                                                        caplog):
    import hf_wide.adapter_groups as groups

    monkeypatch.setattr(groups, "GROUP_SIZE", 2)
    base = tmp_path / "base"
    LLAMA.build(0).save_pretrained(base)
    adapters = [save_adapter(LLAMA, base, tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                             target_modules=["o_proj"], task_type="CAUSAL_LM") for seed in range(4)]
    WideModel.from_pretrained(adapters)
    (path,) = plan_cache.glob("*.json")
    plan = json.loads(path.read_text())  # one adapted layer kept once: member 0's update for all
    fqn = next(fqn for fqn, e in plan["entries"].items() if e["wide_class"] == "WideLoraLinear")
    plan["entries"][fqn].update(kind="shared", wide_class=None)
    path.write_text(json.dumps(plan))
    with caplog.at_level(logging.INFO, logger="hf_wide"):
        wide = WideModel.from_pretrained(adapters)
    assert "the known plan is not group 0's" in caplog.text and len(traces) >= 2
    assert wide.plan.entries[fqn].wide_class == "WideLoraLinear"
    assert max_member_error(wide, [alone(LLAMA, base, a) for a in adapters], LLAMA.inputs(3, padded=True)) <= TOLERANCE


# ---------------------------------------------------------------- full checkpoints, streamed from their files
BERT = CASES["bert-seqcls"]


def save_seeds(folder, embeddings_alike: bool) -> tuple[list, list[str]]:
    """Three BERT classifiers saved in ``folder``; ``embeddings_alike``: all with member 0's embeddings (which the
    plan then keeps once)."""
    members = [BERT.build(seed) for seed in range(3)]
    for member in members[1:] if embeddings_alike else ():
        member.bert.embeddings.load_state_dict(members[0].bert.embeddings.state_dict())
    paths = [str(folder / f"seed-{i}") for i in range(len(members))]
    for member, path in zip(members, paths):
        member.save_pretrained(path)
    return members, paths


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return save_seeds(tmp_path_factory.mktemp("seeds"), embeddings_alike=True)


def test_checkpoints_loaded_again_are_filled_by_their_cached_plan_verified_not_traced(seeds, traces, plan_cache,
                                                                                      monkeypatch):
    # Full checkpoints (seeds from the Hub) traced member 0 at every load: about half of its time
    members, paths = seeds
    wide = WideModel.from_pretrained(paths)
    assert len(traces) == 1 and len(list(plan_cache.glob("*.json"))) == 1
    assert wide.plan.entries["bert.embeddings.word_embeddings"].kind == "shared"
    verifications, verified = [], loading.verified
    monkeypatch.setattr(hub, "verified", lambda *args: verifications.append(1) or verified(*args))
    again = WideModel.from_pretrained(paths)
    assert len(traces) == 1 and verifications == [1] and kinds(again) == kinds(wide)
    inputs = BERT.inputs(3, padded=True)
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, wide(**inputs).logits)
    assert max_member_error(again, members, inputs) <= TOLERANCE
    assert_traced_unchecked_or_uncached(paths, traces, monkeypatch)


def test_members_loaded_whole_again_are_fused_by_their_cached_plan(seeds, tmp_path, traces, plan_cache, monkeypatch):
    # Pickle checkpoints (many older repos hold only pytorch_model.bin) are loaded as models and fused
    members, paths = seeds
    pickled = []
    for i, (member, path) in enumerate(zip(members, paths)):
        folder = tmp_path / f"pickled-{i}"
        folder.mkdir()
        (folder / "config.json").write_text((Path(path) / "config.json").read_text())
        torch.save(member.state_dict(), folder / "pytorch_model.bin")
        pickled.append(str(folder))
    wide = WideModel.from_pretrained(pickled, allow_pickle=True)
    assert len(traces) == 1 and wide.plan.entries["bert.embeddings.word_embeddings"].kind == "shared"
    again = WideModel.from_pretrained(pickled, allow_pickle=True)
    assert len(traces) == 1 and kinds(again) == kinds(wide) and len(list(plan_cache.glob("*.json"))) == 1
    inputs = BERT.inputs(3, padded=True)
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, wide(**inputs).logits)
    assert max_member_error(again, members, inputs) <= TOLERANCE
    assert_traced_unchecked_or_uncached(pickled, traces, monkeypatch, allow_pickle=True)


def test_checkpoints_that_hold_other_tensors_alike_are_planned_apart(seeds, tmp_path, traces, plan_cache):
    # The same architecture and configs: which modules the plan keeps once is read from the files
    WideModel.from_pretrained(seeds[1])
    members, paths = save_seeds(tmp_path, embeddings_alike=False)
    wide = WideModel.from_pretrained(paths)
    assert len(traces) == 2 and len(list(plan_cache.glob("*.json"))) == 2
    assert wide.plan.entries["bert.embeddings.word_embeddings"].kind != "shared"
    assert max_member_error(wide, members, BERT.inputs(3, padded=True)) <= TOLERANCE


def test_a_cached_plan_that_keeps_once_what_the_files_hold_apart_is_traced_past(seeds, traces, plan_cache, caplog):
    # Streamed by it, every member would have run with member 0's classifier, and the check, which runs each member
    # as a view of the wide model's tensors, could not have seen it
    members, paths = seeds
    WideModel.from_pretrained(paths)
    (path,) = plan_cache.glob("*.json")
    plan = json.loads(path.read_text())
    plan["entries"]["classifier"].update(kind="shared", wide_class=None)
    path.write_text(json.dumps(plan))
    with caplog.at_level(logging.INFO, logger="hf_wide"):
        wide = WideModel.from_pretrained(paths)
    assert "the cached plan is not these members'" in caplog.text and "classifier.weight once" in caplog.text
    assert len(traces) == 2 and wide.plan.entries["classifier"].kind != "shared"
    assert max_member_error(wide, members, BERT.inputs(3, padded=True)) <= TOLERANCE
    assert json.loads(path.read_text())["entries"]["classifier"]["kind"] != "shared"  # written anew
    WideModel.from_pretrained(paths)
    assert len(traces) == 2


def test_a_checkpoints_key_holds_the_structure_and_what_the_members_hold_alike(seeds):
    template = BERT.model_class.from_pretrained(seeds[1][0])
    options = {"share_identical": True}
    key = plan_cache.checkpoints_key(template, [{}, {}], {"classifier.bias"}, options)
    assert plan_cache.checkpoints_key(template, [{}, {"_name_or_path": "elsewhere"}], {"classifier.bias"},
                                      options) == key
    assert plan_cache.checkpoints_key(template, [{}, {"id2label": {0: "no", 1: "yes"}}], {"classifier.bias"},
                                      options) != key
    assert plan_cache.checkpoints_key(template, [{}, {}, {}], {"classifier.bias"}, options) != key
    assert plan_cache.checkpoints_key(template, [{}, {}], set(), options) != key
    assert plan_cache.checkpoints_key(template, [{}, {}], {"classifier.bias"}, {"share_identical": False}) != key
    # members loaded whole: what they hold alike, by value
    assert plan_cache.models_key([template, BERT.build(0)], options) != plan_cache.models_key(
        [template, template], options)


def test_checkpoints_whose_cached_plan_a_module_disagrees_with_keep_the_plan_they_were_fused_anew_by(seeds, traces,
                                                                                                    monkeypatch):
    # Cached, then a wide LayerNorm off by 1e-3: the check of the cached plan finds it and the members are fused anew
    # with it moved down; that plan replaces the cached one, and the next load is streamed into it, not traced
    from hf_wide.primitives.norm import WideLayerNorm

    members, paths = seeds
    WideModel.from_pretrained(paths)
    forward = WideLayerNorm.forward
    monkeypatch.setattr(WideLayerNorm, "forward", lambda self, x: forward(self, x) + 1e-3)
    wide = WideModel.from_pretrained(paths)
    moved = {fqn for fqn, e in wide.plan.entries.items() if e.module_class == "LayerNorm"}
    assert len(traces) == 2 and moved and all(wide.plan.entries[f].wide_class != "WideLayerNorm" for f in moved)
    again = WideModel.from_pretrained(paths)
    assert len(traces) == 2 and kinds(again) == kinds(wide)
    assert max_member_error(again, members, BERT.inputs(3, padded=True)) <= TOLERANCE
