"""Fused repos on disk (hf_wide.saving): exact round trips, the stored layout, shards, cards, members back out."""

import json

import pytest
import torch
import transformers
from conftest import CASES
from oracle import TOLERANCE, main_output, max_member_error
from safetensors import safe_open

from hf_wide import IncompatibleMembersError, Kind, WideModel
from hf_wide.checkpoints import WEIGHTS_INDEX_NAME, Checkpoint
from hf_wide.saving import CONFIG_KEY, FusedRepoError, model_class_for

ROUND_TRIP_CASES = [
    "bert-seqcls", "llama-causallm", "vit-imgcls", "resnet-imgcls",
    "t5-encoder",  # a fallback (the encoder) whose embeddings are tied to a wide table outside it
    "xmod-seqcls", "mixtral-causallm", "gemma3-causallm",  # fallbacks that take their callers, token rows
    "mpnet-seqcls",  # a rewritten module: MPNet's encoder
]


def kinds(wide) -> dict[str, Kind]:
    return {fqn: entry.kind for fqn, entry in wide.plan.entries.items()}


def assert_same_members(wide, members) -> None:
    """member(i) has exactly checkpoint i's state dict: same names, same values."""
    for i, member in enumerate(members):
        got, want = wide.member(i).state_dict(), member.state_dict()
        assert list(got) == list(want)
        assert all(torch.equal(got[k], want[k]) for k in want), f"member {i} differs"


def stored_shapes(folder) -> dict[str, tuple]:
    with Checkpoint(folder) as ckpt:
        return {k: ckpt.shape(k) for k in ckpt.entries}


@pytest.mark.parametrize("case_id", ROUND_TRIP_CASES)
def test_fused_repo_round_trip_is_exact(fused, case_id, tmp_path):
    members, wide = fused(case_id)
    wide.save_pretrained(tmp_path)
    back = WideModel.from_pretrained(str(tmp_path))
    inputs = CASES[case_id].inputs(3, padded=True)
    with torch.no_grad():
        assert torch.equal(main_output(back(**inputs)), main_output(wide(**inputs)))
    assert max_member_error(back, members, inputs) <= TOLERANCE
    assert kinds(back) == kinds(wide)
    assert_same_members(back, members)
    assert not back.training


def test_vectorised_modules_keep_their_inputs_roles_in_the_repo(tmp_path):
    # Swinv2's vectorised attention learns at fusion which inputs carry the rows (the windows) and which do not (the
    # shifted windows' mask); loaded back without tracing and called first at other image sizes than the sample's,
    # it could not tell them by their lengths, and raised.
    config = transformers.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                       window_size=4, num_labels=3)
    members = []
    for seed in range(2):
        torch.manual_seed(seed)
        members.append(transformers.Swinv2ForImageClassification(config).eval())
    WideModel.from_models(members).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[CONFIG_KEY]["input_roles"]
    back = WideModel.from_pretrained(str(tmp_path))
    for batch, size in [(2, 64), (1, 40)]:
        assert max_member_error(back, members, {"pixel_values": torch.randn(batch, 3, size, size)}) <= TOLERANCE


def test_each_members_generation_config_comes_back(tmp_path):
    # generation_config.json is member 0's. Only it came back, for every member: generate, which refuses members
    # whose settings differ, then ran member 1 with member 0's (20 new tokens where it makes 5 alone).
    members = [CASES["llama-causallm"].build(seed) for seed in range(3)]
    members[1].generation_config.max_new_tokens = 5
    members[1].generation_config.repetition_penalty = 1.5
    WideModel.from_models(members).save_pretrained(tmp_path)
    back = WideModel.from_pretrained(str(tmp_path))
    for i, member in enumerate(members):
        assert back.member(i).generation_config.to_diff_dict() == member.generation_config.to_diff_dict()
        assert back.member_generation_configs[i].to_dict() == member.generation_config.to_dict()
    with pytest.raises(ValueError, match="generation configs differ.*max_new_tokens"):
        back.generate(input_ids=torch.tensor([[5, 6, 7]]))


def test_stacked_layout_ties_and_fallbacks(fused, tmp_path):
    members, wide = fused("llama-causallm")
    wide.save_pretrained(tmp_path)
    shapes = stored_shapes(tmp_path)
    assert shapes["model.embed_tokens.weight"] == (3, *members[0].model.embed_tokens.weight.shape)
    assert "lm_head.weight" not in shapes  # tied to the embeddings: stored once, under the first name
    back = WideModel.from_pretrained(str(tmp_path))
    assert back.model.lm_head.weight is back.model.model.embed_tokens.weight
    section = json.loads((tmp_path / "config.json").read_text())[CONFIG_KEY]
    assert section["num_members"] == 3 and section["shared"] == []
    assert back.member_generation_configs[0] is not None

    members, wide = fused("vit-imgcls")  # a block's raw parameters are stacked under the member names
    wide.save_pretrained(tmp_path / "vit")
    assert stored_shapes(tmp_path / "vit")["vit.embeddings.cls_token"] == (3, 1, 1, 32)

    case = CASES["deberta-v2-seqcls"]  # so are a fallback's: DeBERTa's encoder, with one attention shared
    members = [case.build(seed) for seed in range(3)]
    frozen = members[0].deberta.encoder.layer[0].attention.self.state_dict()
    for member in members[1:]:
        member.deberta.encoder.layer[0].attention.self.load_state_dict(frozen)
    wide = WideModel.from_models(members)
    assert [e.fqn for e in wide.plan.fallbacks] == ["deberta.encoder"]
    wide.save_pretrained(tmp_path / "deberta")
    rel = members[0].deberta.encoder.rel_embeddings.weight
    assert stored_shapes(tmp_path / "deberta")["deberta.encoder.rel_embeddings.weight"] == (3, *rel.shape)
    back = WideModel.from_pretrained(str(tmp_path / "deberta"))
    assert [e.fqn for e in back.plan.fallbacks] == [e.fqn for e in wide.plan.fallbacks]


def test_a_parametrized_module_held_alike_is_stored_once(tmp_path):
    """wav2vec2's positional convolution is weight-normed; where every member holds it alike (the base's, left as it
    was) it is shared, and stored so, and loads back shared."""
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_labels=3)
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(transformers.Wav2Vec2ForSequenceClassification(config).eval())
    for member in members[1:]:  # (the model's own masked_spec_embed too, which would leave it vectorised whole)
        member.wav2vec2.encoder.pos_conv_embed.load_state_dict(members[0].wav2vec2.encoder.pos_conv_embed.state_dict())
        member.wav2vec2.masked_spec_embed.data.copy_(members[0].wav2vec2.masked_spec_embed.data)
    for i, member in enumerate(members):
        member.save_pretrained(tmp_path / f"m{i}")
    wide = WideModel.from_pretrained([str(tmp_path / f"m{i}") for i in range(3)])
    conv = "wav2vec2.encoder.pos_conv_embed.conv"
    assert kinds(wide)[conv] == kinds(wide)[f"{conv}.parametrizations.weight"] == Kind.SHARED
    assert not wide.plan.fallbacks
    inputs = {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(0))}
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    wide.save_pretrained(tmp_path / "fused")
    assert stored_shapes(tmp_path / "fused")[f"{conv}.parametrizations.weight.original1"] == (32, 8, 16)
    back = WideModel.from_pretrained(str(tmp_path / "fused"))
    assert kinds(back) == kinds(wide)
    assert max_member_error(back, members, inputs) <= TOLERANCE


@pytest.fixture(scope="module")
def sharing_members(tmp_path_factory):
    """Three BERT checkpoints with the same embeddings and classifier bias, saved to folders."""
    case = CASES["bert-seqcls"]
    members = [case.build(seed) for seed in range(3)]
    with torch.no_grad():
        for m in members[1:]:
            m.bert.embeddings.load_state_dict(members[0].bert.embeddings.state_dict())
            m.classifier.bias.copy_(members[0].classifier.bias)
    root = tmp_path_factory.mktemp("sharing")
    paths = []
    for i, m in enumerate(members):
        m.save_pretrained(root / f"m{i}")
        paths.append(str(root / f"m{i}"))
    return members, paths


def test_identical_tensors_are_stored_once(sharing_members, tmp_path):
    members, paths = sharing_members
    wide = WideModel.from_pretrained(paths)  # the low-memory path finds the sharing from the files' bytes
    assert kinds(wide) == kinds(WideModel.from_models(members))
    assert wide.plan.entries["bert.embeddings.word_embeddings"].kind == Kind.SHARED
    wide.save_pretrained(tmp_path)
    shapes = stored_shapes(tmp_path)
    assert shapes["bert.embeddings.word_embeddings.weight"] == (100, 32)  # no member dim
    assert shapes["classifier.bias"] == (3,)  # identical inside a primitive: stored once too
    assert shapes["classifier.weight"] == (3, 3, 32)
    shared = json.loads((tmp_path / "config.json").read_text())[CONFIG_KEY]["shared"]
    assert "classifier.bias" in shared and "classifier.weight" not in shared
    back = WideModel.from_pretrained(str(tmp_path))
    assert kinds(back) == kinds(wide)
    assert max_member_error(back, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE
    # options the fused repo cannot take were dropped: a table held once stayed shared (trained by every member's
    # gradient), and the adapters' options loaded the full members as they are
    with pytest.raises(ValueError, match=r"holds \['bert.embeddings.*once for all its members.* share_identical=False"):
        WideModel.from_pretrained(str(tmp_path), share_identical=False)
    for option in ({"base_model": "org/base"}, {"base_revision": "abc"}, {"merge": True}):
        with pytest.raises(ValueError, match="apply to PEFT adapters; .* is a fused repo of full members"):
            WideModel.from_pretrained(str(tmp_path), **option)
    # fused with share_identical=False, its alike tables are stored once but held by each member: it loads so again
    # (it was refused as "fused with share_identical=True")
    unshared = WideModel.from_models(members, share_identical=False)
    unshared.save_pretrained(tmp_path / "unshared")
    back = WideModel.from_pretrained(str(tmp_path / "unshared"), share_identical=False)
    assert kinds(back) == kinds(unshared) and not back.plan.by_kind(Kind.SHARED)
    assert max_member_error(back, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE


def test_sharded_save(fused, tmp_path):
    members, wide = fused("bert-seqcls")
    wide.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / WEIGHTS_INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "model.safetensors").exists()
    back = WideModel.from_pretrained(str(tmp_path))
    assert_same_members(back, members)
    wide.save_pretrained(tmp_path)  # unsharded again: the old shards go
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_model_card_and_readme_kept(fused, tmp_path):
    _, wide = fused("bert-seqcls")
    wide.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "library_name: hf-wide" in card and "- ensemble" in card and "pipeline_tag: text-classification" in card
    assert "base_model" not in card  # local members are not Hub repos
    (tmp_path / "README.md").write_text("my own card")
    wide.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my own card"
    wide.save_pretrained(tmp_path, overwrite_readme=True)
    assert "library_name: hf-wide" in (tmp_path / "README.md").read_text()


def test_labels_per_member_and_dtype(tmp_path):
    case = CASES["bert-seqcls"]
    members = [case.build(seed) for seed in range(2)]
    members[1].config.id2label = {0: "neg", 1: "neutral", 2: "pos"}
    members[1].config.label2id = {"neg": 0, "neutral": 1, "pos": 2}
    wide = WideModel.from_models(members, allow_label_mismatch=True)
    wide.save_pretrained(tmp_path)
    back = WideModel.from_pretrained(str(tmp_path))
    assert back.member(1).config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    assert back.member(1).config.label2id == {"neg": 0, "neutral": 1, "pos": 2}
    assert back.member(0).config.id2label == members[0].config.id2label
    half = WideModel.from_pretrained(str(tmp_path), dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_a_fused_repo_keeps_in_float32_what_transformers_keeps(tmp_path):
    # T5 keeps its feed-forward output `wo` in float32 when transformers loads it in float16 (_keep_in_fp32_modules).
    # A fused repo loaded back built every tensor in float16: each member's output moved 3e-3 off its own, and
    # save_members wrote `wo` rounded.
    case = CASES["t5-encoder"]
    members = [case.build(seed) for seed in range(2)]
    for i, member in enumerate(members):
        member.save_pretrained(tmp_path / f"m{i}")
        member.to(torch.float16).save_pretrained(tmp_path / f"half{i}")
    WideModel.from_pretrained([str(tmp_path / f"half{i}") for i in range(2)]).save_pretrained(tmp_path / "half")
    WideModel.from_pretrained([str(tmp_path / f"m{i}") for i in range(2)]).save_pretrained(tmp_path / "full")
    inputs = case.inputs(2, padded=True)
    for repo, sources in (("half", "half"), ("full", "m")):
        wide = WideModel.from_pretrained(str(tmp_path / repo), dtype=torch.float16)
        alone = [transformers.T5EncoderModel.from_pretrained(tmp_path / f"{sources}{i}", dtype=torch.float16).eval()
                 for i in range(2)]
        kept = {n: p.dtype for n, p in alone[0].named_parameters() if p.dtype == torch.float32}
        assert kept and all(n.endswith("wo.weight") for n in kept)  # what transformers keeps
        assert {n: p.dtype for n, p in wide.member(0).named_parameters() if p.dtype == torch.float32} == kept
        with torch.no_grad():
            got = wide(**inputs).last_hidden_state
            for i, member in enumerate(alone):
                torch.testing.assert_close(got[i], member(**inputs).last_hidden_state, rtol=0, atol=1e-5)


def _members_with_tokenizers(folder, words_per_member):
    """Saved bert-seqcls members, each with a BERT tokenizer over its own words; returns their folders."""
    folders = []
    folder.mkdir(parents=True, exist_ok=True)
    for i, words in enumerate(words_per_member):
        (folder / f"vocab{i}.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
        CASES["bert-seqcls"].build(i).save_pretrained(folder / f"m{i}")
        transformers.BertTokenizer(str(folder / f"vocab{i}.txt")).save_pretrained(folder / f"m{i}")
        folders.append(str(folder / f"m{i}"))
    return folders


def test_a_repo_saved_over_another_does_not_keep_its_tokenizer(tmp_path):
    # Members whose tokenizers differ save none (warned); saved over a fused repo whose members shared one, that
    # one's files stayed, and the new repo, and save_members' every member, carried another tokenizer.
    alike = _members_with_tokenizers(tmp_path / "alike", [["good", "bad"]] * 2)
    differ = _members_with_tokenizers(tmp_path / "differ", [["good", "bad"], ["good", "bad", "movie"]])
    WideModel.from_pretrained(alike).save_pretrained(tmp_path / "repo")
    assert (tmp_path / "repo" / "tokenizer_config.json").is_file()
    with pytest.warns(UserWarning, match="tokenizer or processor files differ"):
        WideModel.from_pretrained(differ).save_pretrained(tmp_path / "repo")
    assert not [p.name for p in (tmp_path / "repo").iterdir() if p.name.startswith(("tokenizer", "vocab"))]
    # A folder that is no fused repo keeps what it holds
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    WideModel.from_pretrained(alike).save_pretrained(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def test_a_fused_repo_saves_again_where_it_was_loaded_from(tmp_path):
    # Its tokenizer files were copied onto themselves: shutil.SameFileError, after the weights were written.
    folders = _members_with_tokenizers(tmp_path, [["good", "bad"]] * 2)
    WideModel.from_pretrained(folders).save_pretrained(tmp_path / "repo")
    tokenizer = (tmp_path / "repo" / "tokenizer.json").read_bytes()
    back = WideModel.from_pretrained(str(tmp_path / "repo"))
    back.save_pretrained(tmp_path / "repo", max_shard_size="100KB")
    assert (tmp_path / "repo" / "tokenizer.json").read_bytes() == tokenizer
    again = WideModel.from_pretrained(str(tmp_path / "repo"))
    for i in range(2):
        for key, value in again.member(i).state_dict().items():
            assert torch.equal(value, back.member(i).state_dict()[key]), key


def test_save_members_gives_ordinary_checkpoints(fused, tmp_path, capfd):
    members, wide = fused("bert-seqcls")
    capfd.readouterr()
    folders = wide.save_members(tmp_path)
    bars = capfd.readouterr().err.replace("\r", "\n")
    # one bar for the members, not transformers' for each
    assert "Saving members: 100%" in bars and "3/3" in bars and "Writing model shards" not in bars
    assert [f.name for f in folders] == ["member-0", "member-1", "member-2"]
    inputs = CASES["bert-seqcls"].inputs(2, padded=True)
    with torch.no_grad():
        for folder, member in zip(folders, members):
            loaded = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
            assert torch.equal(loaded(**inputs).logits, member(**inputs).logits)


def test_fused_repo_cannot_be_a_member(fused, tmp_path):
    _, wide = fused("bert-seqcls")
    wide.save_pretrained(tmp_path / "fused")
    wide.save_members(tmp_path / "members")
    with pytest.raises(ValueError, match=r"member 1 \(.*fused\) is a fused hf-wide repo"):
        WideModel.from_pretrained([str(tmp_path / "members" / "member-0"), str(tmp_path / "fused")])


def test_validate_checks_every_member_once_however_it_was_loaded(sharing_members, tmp_path, monkeypatch):
    members, paths = sharing_members
    checked = []
    check = WideModel.validate
    monkeypatch.setattr(WideModel, "validate", lambda self, models, *a, **k: (checked.append(len(models)),
                                                                              check(self, models, *a, **k)))
    wide = WideModel.from_pretrained(paths, validate=True)  # from the files: against its members taken out
    assert checked == [3]
    wide.save_pretrained(tmp_path / "fused")
    WideModel.from_pretrained(str(tmp_path / "fused"), validate=True)  # a fused repo: the same
    assert checked == [3, 3]
    folder = tmp_path / "pickled"  # loaded as models and fused: checked against them there, not again
    members[0].save_pretrained(folder, safe_serialization=False)
    WideModel.from_pretrained([str(folder), *paths[1:]], validate=True, allow_pickle=True)
    assert checked == [3, 3, 3]


def test_weights_of_the_wrong_shape_name_the_member(sharing_members, tmp_path):
    members, paths = sharing_members
    config = members[0].config
    model = type(members[0])(config)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["classifier.weight"] = torch.zeros(4, 32)
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(IncompatibleMembersError, match=r"member 1 \(.*\) has 'classifier.weight' of shape \(4, 32\)"):
        WideModel.from_pretrained([paths[0], str(tmp_path)])


def edited(folder, tmp_path, edit) -> str:
    """A copy of the fused repo ``folder`` whose config.json ``edit`` changed."""
    import shutil

    copy = tmp_path / "edited"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def test_an_edited_fused_repo_is_refused_not_loaded_wrong(tmp_path):
    # A plan entry edited out of config.json made a stacked attention one module of member 0's weights, run for
    # every member (0.19 off member 1), with nothing said; other edits gave bare IndexErrors and KeyErrors
    members = [CASES["bert-seqcls"].build(seed) for seed in range(3)]
    WideModel.from_models(members).save_pretrained(tmp_path / "good")
    layer = "bert.encoder.layer.0.attention.self"
    refusals = [
        (lambda c: c[CONFIG_KEY]["plan"]["entries"].pop(next(k for k in c[CONFIG_KEY]["plan"]["entries"]
                                                             if layer in str(k))),
         r"stores \['bert.encoder.layer.0.attention.self.key.bias'.* for each member, but its plan holds them once"),
        (lambda c: c[CONFIG_KEY].update(member_ids=c[CONFIG_KEY]["member_ids"][:2]), "holds 2 member_ids for its 3"),
        (lambda c: c[CONFIG_KEY].update(labels=c[CONFIG_KEY]["labels"][:2]), "holds 2 labels for its 3 members"),
        (lambda c: c[CONFIG_KEY].pop("plan"), "hf_wide section has no plan"),
        (lambda c: c.update(architectures=["BertForTokenClassification"]),
         "plan does not fit BertForTokenClassification"),
    ]
    for edit, match in refusals:
        with pytest.raises(FusedRepoError, match=match):
            WideModel.from_pretrained(edited(tmp_path / "good", tmp_path, edit))


def test_saving_over_a_fused_repo_keeps_a_members_folder_of_the_users(tmp_path):
    """Saved again over itself, a fused repo of full members deleted any ``members/`` folder there (the user's
    ``save_members("./members")``): only an ensemble of adapters writes one, and only its adapters' go."""
    wide = WideModel.from_models([CASES["bert-seqcls"].build(seed) for seed in range(2)])
    wide.save_pretrained(tmp_path)
    wide.save_members(tmp_path / "members")
    wide.save_pretrained(tmp_path)
    assert (tmp_path / "members" / "member-1" / "model.safetensors").is_file()


def test_a_tensor_the_model_has_no_place_for_is_logged(tmp_path, caplog):
    members = [CASES["bert-seqcls"].build(seed) for seed in range(2)]
    WideModel.from_models(members).save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, "bogus.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="hf_wide.fused_load"):
        wide = WideModel.from_pretrained(str(tmp_path))
    assert "['bogus.weight'] that BertForSequenceClassification has no place for" in caplog.text
    assert max_member_error(wide, members, CASES["bert-seqcls"].inputs(2, padded=True)) <= TOLERANCE


def test_a_class_of_the_checkpoints_own_code_is_named_as_such():
    """A checkpoint whose class comes from its own code (``auto_map``, ``trust_remote_code=True``) was told only that
    its architecture names no transformers class."""
    config = transformers.PretrainedConfig(architectures=["TinyModel"],
                                           auto_map={"AutoModel": "modeling_tiny.TinyModel"})
    with pytest.raises(ValueError, match=r"names no transformers class \(its own code, by the config's auto_map"):
        model_class_for(config, "member 0")


def test_a_batchnorm_a_repo_saved_before_held_once_is_each_members_own(tmp_path):
    # fused repos saved before 2026-11-30 held the BatchNorms the members had alike once: in training, they read every
    # member's rows. Loaded, each member holds its own, from the tensors stored once
    case = CASES["resnet-imgcls"]
    members = [case.build(seed) for seed in range(2)]
    for mine, theirs in zip(members[1].modules(), members[0].modules()):
        if isinstance(mine, torch.nn.modules.batchnorm._BatchNorm):
            mine.load_state_dict(theirs.state_dict())
    WideModel.from_models(members).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    entries = config[CONFIG_KEY]["plan"]["entries"]
    norms = [fqn for fqn, entry in entries.items() if entry["module_class"] == "BatchNorm2d"]
    assert norms and {f"{fqn}.running_mean" for fqn in norms} <= set(config[CONFIG_KEY]["shared"])  # stored once
    for fqn in norms:  # as the planner held them
        entries[fqn].update(kind="shared", wide_class=None, reason="identical in every member")
    path.write_text(json.dumps(config))
    back = WideModel.from_pretrained(str(tmp_path))
    assert not any(e.module_class == "BatchNorm2d" for e in back.plan.by_kind(Kind.SHARED))
    with torch.no_grad():
        assert max_member_error(back.train(), [m.train() for m in members], case.inputs(2, padded=False)) <= TOLERANCE
