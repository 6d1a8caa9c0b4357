"""from_pretrained on local folders: the same loading path as Hub repos once the files are local."""

import json
import os
import re

from pathlib import Path

import pytest
import torch
import transformers
from conftest import CASES
from oracle import TOLERANCE, max_member_error
from safetensors.torch import load_file, save_file

from hf_wide import IncompatibleMembersError, WideModel
from hf_wide.placement import resolve_dtype
from hf_wide.planner import tensor_aliases


@pytest.fixture(scope="module")
def saved_members(tmp_path_factory):
    case = CASES["bert-seqcls"]
    root = tmp_path_factory.mktemp("members")
    members, paths = [], []
    for seed in range(3):
        model = case.build(seed)
        path = root / f"member-{seed}"
        model.save_pretrained(path)
        members.append(model)
        paths.append(str(path))
    return members, paths


def test_from_pretrained_local_folders_is_exact(saved_members):
    members, paths = saved_members
    wide = WideModel.from_pretrained(paths)
    assert wide.member_ids == paths
    assert max_member_error(wide, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("biases", ["alike", "differing"])
def test_masked_lms_whose_head_ties_its_bias_to_its_decoder_load_exactly(tmp_path, family, biases):
    # BERT's MLM head ties cls.predictions.bias to its decoder's bias, whose weight (the embeddings') differs. Held
    # alike, the bias was shared while the decoder stacked its copy; read from the files by name, the stacked copy
    # was never filled, and loading failed ("filled 75556 of the 75756 elements"). Loaded whole, the tie broke.
    config_class, model_class = {"bert": (transformers.BertConfig, transformers.BertForMaskedLM),
                                 "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM)}[family]
    config = config_class(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64)
    members, paths = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        model = model_class(config).eval()
        if biases == "differing":
            with torch.no_grad():
                model.get_output_embeddings().bias.add_(0.1 * seed)
        model.save_pretrained(tmp_path / f"m{seed}")
        members.append(model)
        paths.append(str(tmp_path / f"m{seed}"))
    inputs = {"input_ids": torch.randint(5, 100, (3, 7)), "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    for wide in (WideModel.from_pretrained(paths), WideModel.from_models(members)):
        assert max_member_error(wide, members, inputs) <= TOLERANCE
        for i, member in enumerate(members):
            back = wide.member(i)
            assert tensor_aliases(back) == tensor_aliases(member)  # tied as they were
            assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), member.state_dict().values()))


def test_folders_given_as_paths(saved_members, tmp_path):
    # as transformers takes them: a folder as a pathlib.Path, alone (a fused repo) or in the list
    members, paths = saved_members
    wide = WideModel.from_pretrained([Path(p) for p in paths])
    assert wide.member_ids == paths
    wide.save_pretrained(tmp_path / "fused")
    again = WideModel.from_pretrained(tmp_path / "fused")
    assert max_member_error(again, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE


def test_dtype_request(saved_members):
    _, paths = saved_members
    wide = WideModel.from_pretrained(paths[:2], dtype="bfloat16")
    assert {p.dtype for p in wide.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="Unsupported dtype 'float8'"):
        WideModel.from_pretrained(paths[:2], dtype="float8")
    older = WideModel.from_pretrained(paths[:2], torch_dtype=torch.float16)  # its older name, as in transformers
    assert {p.dtype for p in older.parameters()} == {torch.float16}
    both = WideModel.from_pretrained(paths[:2], dtype="bfloat16", torch_dtype=torch.float16)
    assert {p.dtype for p in both.parameters()} == {torch.bfloat16}
    assert resolve_dtype(torch.float16) is torch.float16


@pytest.mark.parametrize("path", ["streaming", "whole", "fused"])
def test_attn_implementation_as_in_transformers(saved_members, tmp_path, path):
    # traced, fused and verified with it: eager attention returns each member's attentions, sdpa none
    _, paths = saved_members
    sources = paths[:2]
    if path == "whole":  # a pickle checkpoint is loaded as a whole model
        pickled = tmp_path / "pickled"
        pickled.mkdir()
        (pickled / "config.json").write_text(open(f"{paths[1]}/config.json").read())
        torch.save(load_file(f"{paths[1]}/model.safetensors"), pickled / "pytorch_model.bin")
        sources = [paths[0], str(pickled)]
    elif path == "fused":
        WideModel.from_pretrained(sources).save_pretrained(tmp_path / "fused")
        sources = [str(tmp_path / "fused")]
    wide = WideModel.from_pretrained(sources, attn_implementation="eager", allow_pickle=True)
    assert wide.config._attn_implementation == "eager"
    inputs = CASES["bert-seqcls"].inputs(2, padded=True)
    with torch.no_grad():
        got = wide(**inputs, output_attentions=True).attentions
        for i, source in enumerate(paths[:2]):
            alone = transformers.AutoModelForSequenceClassification.from_pretrained(source, attn_implementation="eager")
            want = alone.eval()(**inputs, output_attentions=True).attentions
            assert len(got) == len(want) > 0
            assert all((g[i] - w).abs().max().item() <= TOLERANCE for g, w in zip(got, want))
    with pytest.raises(ValueError, match="not-an-attention"):
        WideModel.from_pretrained(sources, attn_implementation="not-an-attention", allow_pickle=True)


def test_one_revision_per_member(saved_members):
    _, paths = saved_members
    with pytest.raises(ValueError, match="2 revisions for 3 members"):
        WideModel.from_pretrained(paths, revision=["main", "main"])


def test_subfolders_one_for_all_or_one_each_and_a_ranks_slice_of_them(saved_members):
    from hf_wide.hub import _slice_loader

    members, paths = saved_members
    root = str(Path(paths[0]).parent)
    with pytest.raises(ValueError, match="2 subfolders for 3 members"):
        WideModel.from_pretrained([root] * 3, subfolder=["member-0", "member-1"])
    both = WideModel.from_pretrained([root, root], subfolder="member-1")  # one for all
    assert both.member_subfolders == ["member-1"] * 2
    assert max_member_error(both, [members[1]] * 2, CASES["bert-seqcls"].inputs(2, padded=True)) <= TOLERANCE
    # a member-parallel rank loads its slice of the members, each from its own subfolder
    options = dict(dtype=None, device=None, device_map=None, attn_implementation=None, allow_pickle=False,
                   trust_remote_code=False, allow_label_mismatch=False, share_identical=False, validate=False,
                   verify=True, base_model=None, base_revision=None, merge=False)
    n, load = _slice_loader(WideModel, [root] * 3, None, ["member-0", "member-1", "member-2"], options)
    part = load(range(1, 3))
    assert n == 3 and part.member_subfolders == ["member-1", "member-2"]
    assert max_member_error(part, members[1:], CASES["bert-seqcls"].inputs(2, padded=True)) <= TOLERANCE


def test_missing_tensor_in_one_checkpoint_names_the_member(saved_members, tmp_path):
    _, paths = saved_members
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json",):
        (broken / name).write_text((open(f"{paths[1]}/{name}")).read())
    tensors = load_file(f"{paths[1]}/model.safetensors")
    del tensors["classifier.bias"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(IncompatibleMembersError, match=r"member 1 .*broken.*classifier.bias"):
        WideModel.from_pretrained([paths[0], str(broken)])


def test_pickle_only_member_is_refused_unless_allowed(saved_members, tmp_path):
    members, paths = saved_members
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(json.load(open(f"{paths[2]}/config.json"))))
    torch.save(members[2].state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickle weights"):
        WideModel.from_pretrained([paths[0], str(pickled)])
    wide = WideModel.from_pretrained([paths[0], str(pickled)], allow_pickle=True)
    assert max_member_error(wide, [members[0], members[2]], CASES["bert-seqcls"].inputs(2, True)) <= TOLERANCE


def test_a_folder_without_weights_is_refused(saved_members, tmp_path):
    _, paths = saved_members
    (tmp_path / "config.json").write_text(open(f"{paths[0]}/config.json").read())
    with pytest.raises(FileNotFoundError, match="no model weights"):
        WideModel.from_pretrained([paths[0], str(tmp_path)])


# ---------------------------------------------------------------- through the test Hub, over HTTP

from hub_server import TOKEN, hub  # noqa: E402, F401  (the fixture)

from hf_wide.download import MemberLoadError  # noqa: E402


@pytest.fixture
def published(hub, saved_members):
    """Three member repos on the test Hub; member 1's weights live on branch "seed-1" only."""
    members, paths = saved_members
    hub.publish("alice/seed-0", paths[0])
    hub.publish("alice/seed-1", {"README.md": "placeholder on main"})
    sha1 = hub.publish("alice/seed-1", paths[1], revision="seed-1")
    hub.publish("alice/seed-2", paths[2], private=True)
    return members, sha1


def test_from_pretrained_over_http_is_exact_and_records_commits(hub, published):
    members, sha1 = published
    ids = ["alice/seed-0", "alice/seed-1", "alice/seed-2"]
    wide = WideModel.from_pretrained(ids, revision=["main", "seed-1", None], token=TOKEN)
    assert wide.member_ids == ids
    assert wide.member_revisions[1] == sha1
    assert all(len(sha) == 40 for sha in wide.member_revisions)
    assert max_member_error(wide, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE
    downloads = [r.path for r in hub.requests if "/resolve/" in r.path]
    assert not any(p.endswith(".bin") for p in downloads)


def test_private_member_without_token_names_the_member(hub, published):
    with pytest.raises(MemberLoadError, match=r"member 1 \(alice/seed-2\).*RepositoryNotFoundError"):
        WideModel.from_pretrained(["alice/seed-0", "alice/seed-2"])


def test_missing_repo_and_revision_name_the_member(hub, published, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 'alice/nope' reads as a repo id, but may have been meant as a folder under the working directory
    with pytest.raises(MemberLoadError, match=r"member 1 \(alice/nope\)(.|\n)*no local folder "
                                              + re.escape(str(tmp_path / "alice" / "nope")) + " either"):
        WideModel.from_pretrained(["alice/seed-0", "alice/nope"])
    with pytest.raises(MemberLoadError, match=r"member 0 \(alice/seed-0\) at revision 'v9'.*Revision"):
        WideModel.from_pretrained(["alice/seed-0"], revision="v9")


@pytest.mark.parametrize("path", ["./no-such-folder", "/no/such/folder", "no/such/folder"])
def test_a_folder_that_is_not_there_is_named_as_a_folder(hub, published, tmp_path, monkeypatch, path):
    # not the hub client's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MemberLoadError, match=rf"member 1 \({re.escape(path)}\): there is no folder "
                                              rf"{re.escape(os.path.abspath(path))}, and .* not a Hub repo id"):
        WideModel.from_pretrained(["alice/seed-0", path])
