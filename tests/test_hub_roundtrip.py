"""The Hub round trip over real HTTP (tests/hub_server.py): members up, fused, pushed, and loaded back elsewhere."""

import pytest
import torch
import transformers
from conftest import CASES
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from hub_server import TOKEN, hub  # noqa: F401  (the fixture)
from oracle import TOLERANCE, main_output, max_member_error
from safetensors.torch import load_file, save_file

from hf_wide import IncompatibleMembersError, WideModel
from hf_wide.download import MemberLoadError

CASE = CASES["bert-seqcls"]
IDS = ["alice/seed-0", "alice/seed-1", "alice/seed-2"]


@pytest.fixture(scope="module")
def member_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("members")
    members, paths = [], []
    for seed in range(3):
        model = CASE.build(seed)
        model.save_pretrained(root / f"seed-{seed}")
        members.append(model)
        paths.append(root / f"seed-{seed}")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad"]) + "\n")
    # (the file positionally: transformers 5.23 reads no vocab_file= keyword, and its tokenizer would know no word)
    transformers.BertTokenizerFast(str(root / "vocab.txt")).save_pretrained(root / "tokenizer")
    return members, paths, root / "tokenizer"


@pytest.fixture
def published(hub, member_folders):
    """Three member repos with the same tokenizer; seed-1's weights live on branch "seed-1" only, seed-2 is private."""
    members, paths, tokenizer = member_folders
    hub.publish("alice/seed-0", tokenizer)
    hub.publish("alice/seed-0", paths[0])
    hub.publish("alice/seed-1", tokenizer)
    sha1 = hub.publish("alice/seed-1", paths[1], revision="seed-1")
    hub.publish("alice/seed-2", tokenizer, private=True)
    hub.publish("alice/seed-2", paths[2])
    return members, sha1


def fuse(**kwargs) -> WideModel:
    return WideModel.from_pretrained(IDS, revision=["main", "seed-1", None], token=TOKEN, **kwargs)


def test_members_to_fused_repo_and_back(hub, published, tmp_path):
    members, sha1 = published
    wide = fuse()
    inputs = CASE.inputs(3, padded=True)
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    commit = wide.push_to_hub("alice/wide-ensemble", token=TOKEN, commit_message="fuse three seeds")
    assert commit.oid == hub.repos["alice/wide-ensemble"].branches["main"]
    files = hub.repos["alice/wide-ensemble"].commits[commit.oid].files
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    card = files["README.md"].decode()
    assert "base_model:\n- alice/seed-0\n- alice/seed-1\n- alice/seed-2" in card and "library_name: hf-wide" in card
    assert f"/alice/seed-1/tree/{sha1}" in card

    back = WideModel.from_pretrained("alice/wide-ensemble", cache_dir=tmp_path / "fresh")
    with torch.no_grad():
        assert torch.equal(main_output(back(**inputs)), main_output(wide(**inputs)))
    assert back.member_ids == IDS and back.member_revisions == wide.member_revisions
    assert back.member_revisions[1] == sha1
    for i, member in enumerate(members):
        got, want = back.member(i).state_dict(), member.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    downloads = [r.path for r in hub.requests if "/resolve/" in r.path]
    assert not any(p.endswith(".bin") for p in downloads)


def test_a_fused_repo_pushed_to_a_branch_of_its_own(hub, published, tmp_path):
    """``push_to_hub(..., revision="dev")``, as transformers takes it: the branch is made from main (it raised
    "save_wide() got an unexpected keyword argument 'revision'"); main is left as it was."""
    members, _ = published
    wide = fuse()
    main = hub.publish("alice/branched", {"README.md": "main's own"})
    wide.push_to_hub("alice/branched", token=TOKEN, revision="dev")
    assert hub.repos["alice/branched"].branches["main"] == main
    back = WideModel.from_pretrained("alice/branched", revision="dev", token=TOKEN, cache_dir=tmp_path / "fresh")
    assert max_member_error(back, members, CASE.inputs(2, padded=True)) <= TOLERANCE


def test_pipeline_on_a_fused_repo_id(hub, published, member_folders):
    from hf_wide.pipelines import pipeline

    wide = fuse()
    wide.push_to_hub("alice/wide-pipe", token=TOKEN)
    tokenizer = transformers.AutoTokenizer.from_pretrained(member_folders[2])
    expected = pipeline("text-classification", model=wide, tokenizer=tokenizer)("good bad good")
    assert pipeline("text-classification", model="alice/wide-pipe")("good bad good") == expected


def test_push_keeps_a_readme_and_replaces_stale_shards(hub, published):
    wide = fuse()
    hub.publish("alice/wide", {"README.md": "my own words"})
    wide.push_to_hub("alice/wide", token=TOKEN, max_shard_size="20KB")
    files = hub.repos["alice/wide"].commits[hub.repos["alice/wide"].branches["main"]].files
    assert files["README.md"] == b"my own words"
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    wide.push_to_hub("alice/wide", token=TOKEN, overwrite_readme=True)
    files = hub.repos["alice/wide"].commits[hub.repos["alice/wide"].branches["main"]].files
    assert b"library_name: hf-wide" in files["README.md"]
    assert sorted(f for f in files if f.startswith("model")) == ["model.safetensors"]


def test_a_push_over_a_fused_repo_takes_its_tokenizer_away(hub, published, member_folders):
    # The earlier members' tokenizer stayed beside members that have none (or whose tokenizers differ), and was the
    # repo's. Another model's repo keeps what it holds.
    fuse().push_to_hub("alice/wide-tok", token=TOKEN)
    hub.publish("alice/theirs", {"tokenizer.json": "{}", "config.json": "{}"})
    plain = WideModel.from_pretrained([str(p) for p in member_folders[1]])
    for repo, kept in (("alice/wide-tok", set()), ("alice/theirs", {"tokenizer.json"})):
        plain.push_to_hub(repo, token=TOKEN)
        files = hub.repos[repo].commits[hub.repos[repo].branches["main"]].files
        assert {f for f in files if f.startswith(("tokenizer", "vocab", "special"))} == kept
        assert "model.safetensors" in files


def test_a_push_keeps_what_the_repos_folders_hold(hub, published, member_folders):
    # huggingface_hub's "*" crosses folders: a push deleted models/seed-2/model.safetensors (leaving its config), an
    # onnx/ folder's tokenizer model, and the member folders save_members wrote beside an ensemble of full members
    plain = WideModel.from_pretrained([str(p) for p in member_folders[1]])
    tokenizer = transformers.AutoTokenizer.from_pretrained(member_folders[2])
    theirs = {"models/seed-2/config.json": "{}", "models/seed-2/model.safetensors": "weights",
              "onnx/spiece.model": "sp", "onnx/preprocessor_config.json": "{}",
              "members/member-0/model.safetensors": "weights"}
    for repo, earlier in (("alice/folders", None), ("alice/wide-folders", plain)):
        if earlier is not None:
            earlier.push_to_hub(repo, token=TOKEN, tokenizer=tokenizer)
        hub.publish(repo, theirs)
        plain.push_to_hub(repo, token=TOKEN)
        files = hub.repos[repo].commits[hub.repos[repo].branches["main"]].files
        assert set(theirs) <= set(files) and "model.safetensors" in files, repo
        assert not any(f.startswith(("tokenizer", "vocab")) for f in files)  # (the earlier fused repo's: replaced)


def test_private_fused_repo_needs_a_token(hub, published):
    fuse().push_to_hub("alice/private-wide", private=True, token=TOKEN)
    message = r"(?s)member 0 \(alice/private-wide\): RepositoryNotFoundError.*pass token="
    with pytest.raises(MemberLoadError, match=message):
        WideModel.from_pretrained("alice/private-wide")
    assert WideModel.from_pretrained("alice/private-wide", token=TOKEN).num_members == 3
    with pytest.raises(HfHubHTTPError):
        fuse().push_to_hub("alice/no-token")


def test_errors_name_the_member(hub, published, tmp_path):
    with pytest.raises(MemberLoadError, match=r"member 1 \(alice/missing\).*RepositoryNotFoundError"):
        WideModel.from_pretrained(["alice/seed-0", "alice/missing"])
    with pytest.raises(MemberLoadError, match=r"member 1 \(alice/seed-1\) at revision 'v2'.*RevisionNotFound"):
        WideModel.from_pretrained(["alice/seed-0", "alice/seed-1"], revision=["main", "v2"])
    bigger = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=100, max_position_embeddings=64, num_hidden_layers=2, num_labels=3, hidden_size=64,
        num_attention_heads=4, intermediate_size=64))
    bigger.save_pretrained(tmp_path / "bigger")
    hub.publish("alice/bigger", tmp_path / "bigger")
    with pytest.raises(IncompatibleMembersError, match=r"member 1 \(alice/bigger\) has config.hidden_size = 64"):
        WideModel.from_pretrained(["alice/seed-0", "alice/bigger"])


def test_interrupted_download_is_retried(hub, published):
    members, _ = published
    hub.fail_next_downloads("model.safetensors", times=1, after_bytes=1000)
    wide = WideModel.from_pretrained(["alice/seed-0"])
    assert max_member_error(wide, members[:1], CASE.inputs(2, padded=True)) <= TOLERANCE
    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
    assert len(gets) == 2


def test_offline_from_the_cache(hub, published, monkeypatch):
    members, _ = published
    online = fuse()
    online.push_to_hub("alice/wide-offline", token=TOKEN)
    WideModel.from_pretrained("alice/wide-offline")
    seen = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = fuse()
    assert offline.member_revisions == online.member_revisions
    assert max_member_error(offline, members, CASE.inputs(3, padded=True)) <= TOLERANCE
    assert WideModel.from_pretrained("alice/wide-offline").member_ids == IDS
    assert len(hub.requests) == seen  # not one request
    # main moved on, and its config alone was fetched since (AutoConfig, say): "has no model weights", it said
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    moved = hub.publish("alice/seed-0", {"README.md": "moved on"})
    hf_hub_download("alice/seed-0", "config.json")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MemberLoadError, match=rf"member 0 \(alice/seed-0\) at revision 'main': the local cache holds "
                                              rf"commit {moved} without its safetensors weights, and the Hub is not "
                                              r"asked"):
        fuse()


def test_pickle_only_member_is_refused(hub, published, tmp_path):
    members, _ = published
    folder = tmp_path / "pickled"
    members[0].config.save_pretrained(folder)
    torch.save(members[0].state_dict(), folder / "pytorch_model.bin")
    hub.publish("alice/pickled", folder)
    with pytest.raises(ValueError, match=r"alice/pickled.*only pickle weights"):
        WideModel.from_pretrained(["alice/seed-0", "alice/pickled"])
    assert WideModel.from_pretrained(["alice/pickled"], allow_pickle=True).num_members == 1


def test_push_members_back_as_ordinary_repos(hub, published):
    members, _ = published
    wide = fuse()
    wide.push_members(["alice/out-0", "alice/out-1", "alice/out-2"], token=TOKEN)
    inputs = CASE.inputs(2, padded=True)
    with torch.no_grad():
        for i, member in enumerate(members):
            loaded = transformers.AutoModelForSequenceClassification.from_pretrained(f"alice/out-{i}").eval()
            assert torch.equal(loaded(**inputs).logits, member(**inputs).logits)
    assert hf_hub_download("alice/out-1", "tokenizer_config.json")
    assert HfApi().file_exists("alice/out-2", "tokenizer.json")


def test_a_repo_sharded_once_and_uploaded_whole_since_is_read_as_transformers_reads_it(hub, member_folders,
                                                                                        tmp_path):
    """Uploads delete nothing: a repo pushed sharded (seed 2), then whole (seed 0), holds the old index and shards
    beside the new model.safetensors. transformers reads model.safetensors; hf-wide read the index's shards, and
    member 0 was seed 2 (0.037 off, without a word)."""
    members, paths, _ = member_folders
    members[2].save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    hub.publish("alice/evolved", tmp_path / "sharded")
    hub.publish("alice/evolved", paths[0])
    wide = WideModel.from_pretrained(["alice/evolved", str(paths[1])])
    assert max_member_error(wide, members[:2], CASE.inputs(2, padded=True)) <= TOLERANCE


def test_push_members_over_sharded_repos_replaces_their_weights(hub, published, tmp_path):
    """``push_members`` deletes the weights of an earlier upload that it does not replace: pushed over a sharded
    member, the new model.safetensors stood beside the old index and shards, which hf-wide then read (0.39 off)."""
    members, _ = published
    members[1].save_pretrained(tmp_path / "old", max_shard_size="20KB")
    hub.publish("alice/out-0", tmp_path / "old")
    wide = fuse()
    wide.push_members(["alice/out-0", "alice/out-1", "alice/out-2"], token=TOKEN)
    assert not HfApi().file_exists("alice/out-0", "model.safetensors.index.json")
    back = WideModel.from_pretrained(["alice/out-0", "alice/out-1"])
    assert max_member_error(back, members[:2], CASE.inputs(2, padded=True)) <= TOLERANCE


def test_a_member_with_a_corrupt_tensor_names_it(hub, published, member_folders, tmp_path):
    _, paths, _ = member_folders
    tensors = load_file(paths[1] / "model.safetensors")
    tensors["classifier.weight"] = tensors["classifier.weight"][:2]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_bytes((paths[1] / "config.json").read_bytes())
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    hub.publish("alice/bad", tmp_path / "bad")
    with pytest.raises(IncompatibleMembersError, match=r"member 1 \(alice/bad\) has 'classifier.weight' of shape"):
        WideModel.from_pretrained(["alice/seed-0", "alice/bad"])


def test_members_in_subfolders_of_one_repo(hub, member_folders, tmp_path):
    # A training run pushed with its checkpoints as folders of one repo (checkpoint-N), as transformers'
    # from_pretrained(repo, subfolder=...) reads them: subfolder= was refused as an unknown option
    members, paths, tokenizer = member_folders
    run = {f"checkpoint-{100 * (i + 1)}/{f.name}": f.read_bytes()  # weights and tokenizer in each, as Trainer saves
           for i, p in enumerate(paths) for f in [*p.iterdir(), *tokenizer.iterdir()]}
    sha = hub.publish("alice/run", {**run, "training_log.txt": "a file of the run's, not a member's"})
    subfolders = ["checkpoint-100", "checkpoint-200", "checkpoint-300"]
    wide = WideModel.from_pretrained(["alice/run"] * 3, subfolder=subfolders, token=TOKEN)
    assert max_member_error(wide, members, CASE.inputs(3, padded=True)) <= TOLERANCE
    assert wide.member_ids == ["alice/run"] * 3 and wide.member_revisions == [sha] * 3
    assert wide.member_subfolders == subfolders
    downloads = {r.path.split("/resolve/")[-1] for r in hub.requests if "/resolve/" in r.path}
    assert not any(p.endswith("training_log.txt") for p in downloads)  # each member's folder, not the whole repo

    wide.push_to_hub("alice/wide-run", token=TOKEN)
    card = hub.repos["alice/wide-run"].commits[hub.repos["alice/wide-run"].branches["main"]].files["README.md"]
    assert f"/alice/run/tree/{sha}/checkpoint-200" in card.decode()
    assert card.decode().count("- alice/run") == 1  # base_model: the repo once
    back = WideModel.from_pretrained("alice/wide-run", cache_dir=tmp_path / "fresh")
    assert back.member_subfolders == subfolders and back.member_revisions == [sha] * 3

    with pytest.raises(MemberLoadError, match=r"member 1 \(alice/run, subfolder 'checkpoint-150'\).*no folder"):
        WideModel.from_pretrained(["alice/run"] * 2, subfolder=["checkpoint-100", "checkpoint-150"], token=TOKEN)
    from hf_wide.pipelines import pipeline

    pipe = pipeline("text-classification", model=["alice/run"] * 3, token=TOKEN, model_kwargs={"subfolder": subfolders})
    expected = pipeline("text-classification", model=wide, tokenizer=transformers.AutoTokenizer.from_pretrained(
        tokenizer))("good bad good")
    assert pipe("good bad good") == expected  # each member's tokenizer, from its own folder
    # a member at the root of the run's repo: huggingface_hub's "*" crosses folders, and it downloaded every
    # checkpoint's weights too
    hub.publish("alice/run", {f.name: f.read_bytes() for f in paths[2].iterdir()})
    seen = len(hub.requests)
    root = WideModel.from_pretrained(["alice/run"], token=TOKEN, cache_dir=tmp_path / "root")
    assert max_member_error(root, members[2:], CASE.inputs(3, padded=True)) <= TOLERANCE
    fetched = {r.path.split("/resolve/")[-1] for r in hub.requests[seen:] if "/resolve/" in r.path}
    assert any(p.endswith("/model.safetensors") for p in fetched) and not any("checkpoint-" in p for p in fetched)
    local = WideModel.from_pretrained([str(paths[0].parent)] * 2, subfolder=["seed-0", "seed-1"])  # folders too
    assert max_member_error(local, members[:2], CASE.inputs(2, padded=True)) <= TOLERANCE
