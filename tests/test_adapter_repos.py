"""Adapter repos (hf_wide/adapter_repos.py): adapters of one base found and loaded from folders and the test Hub at
pinned revisions, the base once; what is refused, and how (other bases, a missing base, other PEFT types, inits that
change the base, pickles, unknown options); an ensemble of adapters saved (with its base's tokenizer), pushed and
loaded back; its members saved as adapters of the base they were loaded over."""

import json
import logging
import warnings

import peft
import pytest
import torch
from huggingface_hub import constants, hf_hub_download
from hub_server import TOKEN, hub  # noqa: F401  (the fixture)
from lora_members import EVERY_LINEAR, LLAMA, alone, lora_keys, save_adapter, save_llama_adapters
from oracle import TOLERANCE, max_member_error
from pipelines.text_members import decoder_tokenizer

from hf_wide import IncompatibleMembersError, WideModel, pipeline
from hf_wide.download import MemberLoadError
from hf_wide.preprocessor_files import preprocessor_files


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    return save_llama_adapters(tmp_path_factory.mktemp("llama"))


def test_adapters_of_different_bases_are_refused(llama_adapters, tmp_path):
    base, adapters = llama_adapters
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((base.parent / "a1" / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "someone/else"}))
    (other / "adapter_model.safetensors").write_bytes((base.parent / "a1" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(IncompatibleMembersError, match=r"member 1 .* 'someone/else'.*member 0 .*base"):
        WideModel.from_pretrained([adapters[0], str(other)])


@pytest.mark.parametrize("spelling", ["trailing slash", "link", "relative"])
def test_adapters_naming_one_base_folder_by_other_names_share_it(llama_adapters, tmp_path, monkeypatch, spelling):
    # '<dir>' and '<dir>/' (or a link to it, or a relative path) were refused as adapters of different bases
    base, adapters = llama_adapters
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(base.parent)
    if spelling == "link":
        (tmp_path / "link").symlink_to(base)
    name = {"trailing slash": f"{base}/", "link": str(tmp_path / "link"), "relative": base.name}[spelling]
    config = json.loads((base.parent / "a1" / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": name}))
    (other / "adapter_model.safetensors").write_bytes((base.parent / "a1" / "adapter_model.safetensors").read_bytes())
    wide = WideModel.from_pretrained([adapters[0], str(other)])
    references = [alone(LLAMA, base, adapters[0]), alone(LLAMA, base, adapters[1])]  # (other: a1's weights)
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_a_base_that_cannot_be_found(llama_adapters):
    _, adapters = llama_adapters
    with pytest.raises(MemberLoadError, match="base model 'nobody/nothing'") as refused:
        WideModel.from_pretrained(adapters[:2], base_model="nobody/nothing", local_files_only=True)
    assert "member 0" not in str(refused.value)  # (the base was called so)


def test_unsupported_adapters_are_refused_and_merge_is_the_way_out(llama_adapters, tmp_path):
    base, _ = llama_adapters
    ia3 = peft.get_peft_model(LLAMA.model_class.from_pretrained(base), peft.IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in ia3.named_parameters():
            if "ia3_" in name:
                p.add_(0.1)
    ia3.save_pretrained(tmp_path / "ia3")
    dora = save_adapter(LLAMA, base, tmp_path / "dora", 3, r=4, lora_alpha=8, use_dora=True,
                        target_modules=["q_proj"], task_type="CAUSAL_LM")
    biased = save_adapter(LLAMA, base, tmp_path / "biased", 4, r=4, lora_alpha=8, lora_bias=True,
                          target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(NotImplementedError, match=r"member 0 .*ia3.* IA3 adapter.*merge=True"):
        WideModel.from_pretrained([str(tmp_path / "ia3"), dora])
    with pytest.raises(NotImplementedError, match=r"member 1 .*biased.* lora_bias=True.*bias of its own.*merge=True"):
        WideModel.from_pretrained([str(base), biased])
    wide = WideModel.from_pretrained([str(tmp_path / "ia3"), dora], merge=True)
    references = [alone(LLAMA, base, str(tmp_path / "ia3")), alone(LLAMA, base, dora)]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= 1e-4  # merged weights round


def test_an_adapter_that_mixes_its_updates_per_input_is_offered_no_merge(llama_adapters, tmp_path):
    # Poly (a router over task_ids) was offered merge=True, which then failed with PEFT's bare "task_ids should not be
    # None" (naming no member); no one merge of it is the adapter
    base, adapters = llama_adapters
    poly = peft.get_peft_model(LLAMA.model_class.from_pretrained(base), peft.PolyConfig(
        r=4, target_modules=["q_proj", "v_proj"], n_tasks=2, task_type="CAUSAL_LM"))
    poly.save_pretrained(tmp_path / "poly")
    for merge in (False, True):
        with pytest.raises(NotImplementedError, match=r"member 1 .*poly.* POLY adapter.*mixes its updates per input, "
                                                      r"which no merge into its base is"):
            WideModel.from_pretrained([adapters[0], str(tmp_path / "poly")], merge=merge)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_init_that_changes_the_base_is_refused_and_merge_is_the_way_out(llama_adapters, init, tmp_path):
    """PEFT's PiSSA and OLoRA make the base layer's weight the base's less the adapter's first update, again each time
    the adapter loads (``weight.data = ...``, which no version counter sees): over the one base its members share,
    every member computed with that residual, the check against them agreed, and the wide model was wrong by 0.36."""
    base, adapters = llama_adapters
    residual = save_adapter(LLAMA, base, tmp_path / init, 3, r=4, target_modules=["q_proj"], init_lora_weights=init,
                            task_type="CAUSAL_LM")
    with pytest.raises(NotImplementedError, match=rf"member 1 .*init_lora_weights='{init}'.*merge=True"):
        WideModel.from_pretrained([adapters[0], residual])
    wide = WideModel.from_pretrained([adapters[0], residual], merge=True)
    references = [alone(LLAMA, base, adapters[0]), alone(LLAMA, base, residual)]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= 1e-4  # merged weights round


def test_a_pickle_only_adapter_needs_allow_pickle(llama_adapters, tmp_path):
    base, adapters = llama_adapters
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes((base.parent / "a1" / "adapter_config.json").read_bytes())
    torch.save({}, pickled / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"member 1 .*pickle.*allow_pickle=True"):
        WideModel.from_pretrained([adapters[0], str(pickled)])


def test_an_unknown_keyword_argument_is_a_type_error(llama_adapters):
    _, adapters = llama_adapters
    with pytest.raises(TypeError, match="tensor_parallel"):
        WideModel.from_pretrained(adapters, tensor_parallel=True)


def test_base_and_adapters_as_repos_at_pinned_revisions(hub, tmp_path):
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    base_sha = hub.publish("meta/base", tmp_path / "base")
    LLAMA.build(1).save_pretrained(tmp_path / "base-later")
    hub.publish("meta/base", tmp_path / "base-later")  # main moves on to other weights; the pinned revision stays
    ids, shas = [], []
    for seed in range(2):
        folder = save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, base_name="meta/base", r=4 * (seed + 1),
                              lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        shas.append(hub.publish(f"alice/lora-{seed}", folder))
        ids.append(f"alice/lora-{seed}")
    wide = WideModel.from_pretrained(ids, revision=shas, base_revision=base_sha, token=TOKEN,
                                     cache_dir=tmp_path / "cache")
    references = [alone(LLAMA, tmp_path / "base", str(tmp_path / f"a{seed}")) for seed in range(2)]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert wide.member_revisions == shas
    downloads = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path and "meta/base" in r.path]
    assert sum(p.endswith("model.safetensors") for p in downloads) == 1  # the base, once


def test_the_base_at_the_revision_the_adapters_pin(hub, tmp_path):
    """PEFT's ``revision`` (``get_peft_model(..., revision=)``) pins the base, and ``AutoPeftModel`` loads it there;
    the base was loaded at its default branch, which had moved on to other weights. Adapters that pin different
    revisions are of different bases."""
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    base_sha = hub.publish("meta/pinned", tmp_path / "base")
    LLAMA.build(1).save_pretrained(tmp_path / "base-later")
    later_sha = hub.publish("meta/pinned", tmp_path / "base-later")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, base_name="meta/pinned", r=4,
                             target_modules=["q_proj"], task_type="CAUSAL_LM", revision=base_sha) for seed in range(2)]
    wide = WideModel.from_pretrained(adapters, token=TOKEN, cache_dir=tmp_path / "cache")
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    later = save_adapter(LLAMA, tmp_path / "base-later", tmp_path / "later", 2, base_name="meta/pinned", r=4,
                         target_modules=["q_proj"], task_type="CAUSAL_LM", revision=later_sha)
    with pytest.raises(IncompatibleMembersError, match=rf"member 1 .* revision '{later_sha}'.*member 0 .*'{base_sha}'"):
        WideModel.from_pretrained([adapters[0], later], token=TOKEN, cache_dir=tmp_path / "cache")
    unpinned = save_adapter(LLAMA, tmp_path / "base-later", tmp_path / "unpinned", 3, base_name="meta/pinned", r=4,
                            target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(IncompatibleMembersError, match=r"member 1 .* no revision \(the default branch\)"):
        WideModel.from_pretrained([adapters[0], unpinned], token=TOKEN, cache_dir=tmp_path / "cache")
    WideModel.from_pretrained([adapters[0], later], base_revision=base_sha, token=TOKEN, cache_dir=tmp_path / "cache")


def test_the_base_in_the_list_at_a_revision_of_its_own_is_a_member_of_its_own(hub, tmp_path):
    """The base's id in the list, at another revision than the one the adapters pin, is that revision's checkpoint: it
    was taken for the adapters' base, and member 0 came out the pinned base (0.54 off). An ensemble pinned to a branch
    records the commit its base was loaded at, which a reload uses after the branch has moved on (0.62 off)."""
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    base_sha = hub.publish("meta/moving", tmp_path / "base", revision="stable")
    LLAMA.build(1).save_pretrained(tmp_path / "base-later")
    hub.publish("meta/moving", tmp_path / "base-later")  # main: other weights
    adapter = save_adapter(LLAMA, tmp_path / "base", tmp_path / "a0", 0, base_name="meta/moving", r=4,
                           target_modules=["q_proj"], task_type="CAUSAL_LM", revision="stable")
    options = dict(token=TOKEN, cache_dir=tmp_path / "cache")
    wide = WideModel.from_pretrained(["meta/moving", adapter], **options)
    references = [LLAMA.build(1), alone(LLAMA, tmp_path / "base", adapter)]  # main's weights, then the adapter's
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(wide, references, inputs) <= TOLERANCE
    pinned = WideModel.from_pretrained([adapter, "meta/moving"], revision=[None, "stable"], **options)
    assert max_member_error(pinned, [references[1], LLAMA.build(0)], inputs) <= TOLERANCE
    assert pinned.adapter_sources.base_revision == base_sha  # the commit, not the branch
    pinned.save_pretrained(tmp_path / "saved")
    hub.publish("meta/moving", tmp_path / "base-later", revision="stable")  # the branch moves on
    back = WideModel.from_pretrained(str(tmp_path / "saved"), **options)
    assert max_member_error(back, [references[1], LLAMA.build(0)], inputs) <= TOLERANCE


def test_an_ensemble_of_adapters_saved_and_loaded_back(llama_adapters, tmp_path):
    base, adapters = llama_adapters
    wide = WideModel.from_pretrained([str(base), *adapters])
    inputs = LLAMA.inputs(2, padded=True)
    wide.save_pretrained(tmp_path / "ensemble")
    saved = {p.relative_to(tmp_path / "ensemble").as_posix() for p in (tmp_path / "ensemble").rglob("*.safetensors")}
    assert saved == {f"members/member-{i}/adapter_model.safetensors" for i in (1, 2, 3)}  # the base: referenced
    back = WideModel.from_pretrained(str(tmp_path / "ensemble"))
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, wide(**inputs).logits)
    assert back.member_ids == wide.member_ids
    full = WideModel.from_models([LLAMA.model_class.from_pretrained(base), LLAMA.build(5)])  # one kind over another
    full.save_pretrained(tmp_path / "ensemble")
    assert not (tmp_path / "ensemble" / "members").exists()  # (the adapters' folders were left beside it)
    wide.save_pretrained(tmp_path / "ensemble")
    assert not (tmp_path / "ensemble" / "model.safetensors").exists()  # (and its weights beside them)
    folders = wide.save_members(tmp_path / "members")
    # the base itself is no adapter: its own repo (there was no folder, and a gap in the members' numbers)
    saved_base = LLAMA.model_class.from_pretrained(folders[0]).eval()
    with torch.no_grad():
        assert torch.equal(saved_base(**inputs).logits, LLAMA.model_class.from_pretrained(base).eval()(**inputs).logits)
    for folder, adapter in zip(folders[1:], adapters):  # ordinary PEFT adapters, without the zero updates
        again, original = alone(LLAMA, base, str(folder)), alone(LLAMA, base, adapter)
        assert lora_keys(again) == lora_keys(original)
        with torch.no_grad():
            assert torch.equal(again(**inputs).logits, original(**inputs).logits)
    # moved to bfloat16, it loads back over a bfloat16 base (it came back in float32), the adapters in float32 as
    # PEFT keeps them over a half-precision base
    wide.to(torch.bfloat16).save_pretrained(tmp_path / "half")
    back = WideModel.from_pretrained(str(tmp_path / "half"))
    saved = [str(tmp_path / "half" / "members" / f"member-{i}") for i in (1, 2, 3)]  # (its adapters, rounded)
    over = WideModel.from_pretrained([str(base), *saved], dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16 and {p.dtype for p in back.parameters()} == {p.dtype for p in over.parameters()}
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, over(**inputs).logits)


def test_a_saved_ensemble_of_adapters_is_built_by_its_plan_and_verified_not_traced(llama_adapters, tmp_path, traces):
    # It was traced again at every load: 3.6 of the 3.8 s that four adapters of a small BERT took
    base, adapters = llama_adapters
    wide = WideModel.from_pretrained([str(base), *adapters])
    assert len(traces) == 1
    wide.save_pretrained(tmp_path / "ensemble")
    back = WideModel.from_pretrained(str(tmp_path / "ensemble"))
    assert len(traces) == 1
    assert {k: e.kind for k, e in back.plan.entries.items()} == {k: e.kind for k, e in wide.plan.entries.items()}
    inputs = LLAMA.inputs(2, padded=True)
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, wide(**inputs).logits)
    WideModel.from_pretrained(str(tmp_path / "ensemble"), verify=False)  # unverified, as any load: planned afresh
    assert len(traces) == 2


@pytest.mark.parametrize("alike", [False, True])
def test_a_saved_plan_that_is_not_the_members_is_traced_again(llama_adapters, tmp_path, traces, caplog, alike):
    base, adapters = llama_adapters
    if alike:  # one rank and targets: member 0's layer for all builds, and gives other numbers
        adapters = [save_adapter(LLAMA, base, tmp_path / f"alike-{i}", i, r=8, target_modules=EVERY_LINEAR)
                    for i in range(2)]
    wide = WideModel.from_pretrained(adapters if alike else [str(base), *adapters])
    wide.save_pretrained(tmp_path / "ensemble")
    config = json.loads((tmp_path / "ensemble" / "config.json").read_text())
    entries = config["hf_wide"]["plan"]["entries"]
    adapted = next(k for k, e in entries.items() if e["wide_class"] == "WideLoraLinear")
    entries[adapted].update(kind="shared", wide_class=None, reason="identical in every member")  # member 0's for all
    (tmp_path / "ensemble" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="hf_wide.fuse"):
        back = WideModel.from_pretrained(str(tmp_path / "ensemble"))
    assert len(traces) == 2 and back.plan.entries[adapted].wide_class == "WideLoraLinear"
    said = [r.getMessage() for r in caplog.records if "the saved plan is not these members'" in r.getMessage()]
    # differently padded ranks: the shared layer's parts have other shapes than the members' (an error, caught)
    assert len(said) == 1 and ("RuntimeError" in said[0]) != alike, said
    inputs = LLAMA.inputs(2, padded=True)
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, wide(**inputs).logits)

def test_an_ensemble_of_adapters_pushed_and_loaded_in_a_fresh_cache(hub, tmp_path, monkeypatch):
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    base_sha = hub.publish("meta/llama", tmp_path / "base")
    ids = []
    for seed in range(2):
        hub.publish(f"alice/lora-x{seed}", save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed,
                                                     base_name="meta/llama", r=4, lora_alpha=8,
                                                     target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        ids.append(f"alice/lora-x{seed}")
    wide = WideModel.from_pretrained(ids, token=TOKEN, cache_dir=tmp_path / "cache")
    assert wide.adapter_sources.base_revision == base_sha
    wide.push_to_hub("alice/lora-xensemble", token=TOKEN)
    files = hub.repos["alice/lora-xensemble"].commits[hub.repos["alice/lora-xensemble"].branches["main"]].files
    assert "model.safetensors" not in files and "members/member-1/adapter_model.safetensors" in files
    back = WideModel.from_pretrained("alice/lora-xensemble", token=TOKEN, cache_dir=tmp_path / "fresh")
    inputs = LLAMA.inputs(2, padded=True)
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, wide(**inputs).logits)
    # offline, from the warm cache: its weights are under members/, and the load asked the Hub for the repo's file
    # list to see whether it held pickles only (OfflineModeIsEnabled)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = WideModel.from_pretrained("alice/lora-xensemble", cache_dir=tmp_path / "fresh")
    with torch.no_grad():
        assert torch.equal(offline(**inputs).logits, wide(**inputs).logits)


def test_adapters_without_tokenizer_files_are_saved_with_their_bases(tmp_path):
    """PEFT saves an adapter alone, and it reads text with its base's tokenizer (as a pipeline over the adapters
    does): a fused repo of adapters held no tokenizer files, and a pipeline over it failed ("Couldn't instantiate the
    backend tokenizer"); with the base in the list beside them, their none were taken to differ from its files, and
    none were saved (warned). Merged, each member saved held none either. Adapters that ship tokenizer files of their
    own are read by them, as before: where theirs differ, none are saved."""
    base = tmp_path / "base"
    LLAMA.build(0).save_pretrained(base)
    decoder_tokenizer(base).save_pretrained(base)
    adapters = [save_adapter(LLAMA, base, tmp_path / f"a{seed}", seed, r=4, lora_alpha=8, target_modules=["q_proj"],
                             task_type="CAUSAL_LM") for seed in range(2)]
    files = {p.name: p.read_bytes() for p in preprocessor_files(base)}
    assert files and not preprocessor_files(tmp_path / "a0")
    for name, members in (("adapters", adapters), ("with-base", [str(base), *adapters])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            WideModel.from_pretrained(members).save_pretrained(tmp_path / name)
        assert not [w for w in caught if "files differ" in str(w.message)]
        assert {p.name: p.read_bytes() for p in preprocessor_files(tmp_path / name)} == files
    generate = pipeline("text-generation", model=str(tmp_path / "adapters"))
    assert generate(["good movie"], max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("good movie")
    for folder in WideModel.from_pretrained(adapters, merge=True).save_members(tmp_path / "merged"):
        assert {p.name: p.read_bytes() for p in preprocessor_files(folder)} == files
    own = save_adapter(LLAMA, base, tmp_path / "own", 2, r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    decoder_tokenizer(own).save_pretrained(own)  # an adapter's own tokenizer files, which differ from the base's
    (tmp_path / "own" / "tokenizer_config.json").write_text(json.dumps({**json.loads(files["tokenizer_config.json"]),
                                                                      "model_max_length": 16}))
    mixed = WideModel.from_pretrained([adapters[0], own])
    with pytest.warns(UserWarning, match="tokenizer or processor files differ"):
        mixed.save_pretrained(tmp_path / "differ")
    assert not preprocessor_files(tmp_path / "differ")
    saved = mixed.save_members(tmp_path / "mixed")  # each adapter as it shipped: the second with its own files
    assert not preprocessor_files(saved[0]) and [p.name for p in preprocessor_files(saved[1])] == sorted(files)


def test_members_saved_after_base_model_name_the_base_they_were_loaded_over(llama_adapters, hub, tmp_path):
    """``save_members`` after ``base_model=``: each adapter's config still named the base it had named, and its
    folder, loaded over that one (by ``AutoPeftModel``, or anyone who reads the config), was 2.7 off the wide model's
    member; ``push_members`` pushed PEFT's own save of ``member(i)``, which named it too. The revision the adapters pin
    is their own base's: over another base, the one ``base_revision=`` gives (PEFT's ``revision``), or none."""
    base, _ = llama_adapters
    other = tmp_path / "other"
    LLAMA.build(1).save_pretrained(other)
    pinned = [save_adapter(LLAMA, base, tmp_path / f"p{seed}", seed, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", revision="v1")
              for seed in range(2)]
    inputs = LLAMA.inputs(2, padded=True)
    for revision in (None, "v2"):
        wide = WideModel.from_pretrained(pinned, base_model=str(other), base_revision=revision)
        with torch.no_grad():
            logits = wide(**inputs).logits
        for i, folder in enumerate(wide.save_members(tmp_path / f"members-{revision}")):
            config = json.loads((folder / "adapter_config.json").read_text())
            assert (config["base_model_name_or_path"], config["revision"]) == (str(other), revision)
            again = alone(LLAMA, config["base_model_name_or_path"], str(folder))
            with torch.no_grad():
                assert (again(**inputs).logits - logits[i]).abs().max().item() <= TOLERANCE
    wide.push_members(["alice/over-0", "alice/over-1"], token=TOKEN)
    pushed = json.loads(open(hf_hub_download("alice/over-1", "adapter_config.json", token=TOKEN)).read())
    assert (pushed["base_model_name_or_path"], pushed["revision"]) == (str(other), "v2")


def test_saved_adapters_hold_what_they_held_whatever_their_base_became(tmp_path):
    # PEFT's save compares the vocabulary with its base's config.json as it is now (on the Hub: at main): a base whose
    # vocabulary grew since got both embedding tables saved whole into every adapter, which then wrote into the base's
    # own tables when loaded, and was refused
    from safetensors import safe_open

    base, adapters = save_llama_adapters(tmp_path / "llama")
    wide = WideModel.from_pretrained(adapters)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 20}))  # (moved on)
    folders = wide.save_members(tmp_path / "members")
    (base / "config.json").write_text(json.dumps(config))
    for folder, adapter in zip(folders, adapters):
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as saved, \
                safe_open(f"{adapter}/adapter_model.safetensors", "pt") as held:
            assert set(saved.keys()) == set(held.keys())
    again = WideModel.from_pretrained([str(f) for f in folders])
    with torch.no_grad():
        inputs = LLAMA.inputs(2, padded=True)
        assert torch.equal(again(**inputs).logits, wide(**inputs).logits)
