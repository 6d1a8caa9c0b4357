"""from_pretrained on local folders: the same loading path as Hub repos once the files are local."""

import json

import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error
from safetensors.torch import load_file, save_file

from hf_wide import IncompatibleMembersError, WideModel
from hf_wide.hub import resolve_dtype


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


def test_dtype_request(saved_members):
    _, paths = saved_members
    wide = WideModel.from_pretrained(paths[:2], dtype="bfloat16")
    assert {p.dtype for p in wide.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="Unsupported dtype 'float8'"):
        WideModel.from_pretrained(paths[:2], dtype="float8")
    assert resolve_dtype(torch.float16) is torch.float16


def test_one_revision_per_member(saved_members):
    _, paths = saved_members
    with pytest.raises(ValueError, match="2 revisions for 3 members"):
        WideModel.from_pretrained(paths, revision=["main", "main"])


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
