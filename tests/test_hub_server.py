"""Tests of the in-process test Hub (hub_server.py), through the real huggingface_hub and transformers clients.

They pin down what other tests rely on: uploads round-trip byte for byte, revisions resolve by branch, tag and sha,
errors map to the client's exception classes, an interrupted download resumes, and the cache works offline.
"""

import os

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from hub_server import GITATTRIBUTES, TOKEN, USER, git_blob_sha, hub, running_hub  # noqa: F401, F811 (fixture)


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=TOKEN)


def read_tree(folder):
    """{posix path: bytes} of every file under ``folder`` (following the cache's symlinks)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.relpath(f.name, folder).replace(os.sep, "/")] = f.read()
    return files


def test_upload_folder_then_download_same_bytes(hub, api, tmp_path):
    folder = tmp_path / "upload"
    (folder / "sub" / "deeper").mkdir(parents=True)
    files = {"a.txt": b"hello", "sub/b.bin": os.urandom(50_000), "sub/deeper/c.json": b"{}", "empty": b""}
    for path, data in files.items():
        (folder / path).write_bytes(data)

    repo_url = api.create_repo("tiny")  # no namespace: the token's user
    assert repo_url.repo_id == f"{USER}/tiny"
    commit = api.upload_folder(repo_id=repo_url.repo_id, folder_path=folder, commit_message="add files")

    assert sorted(api.list_repo_files(repo_url.repo_id)) == sorted([".gitattributes", *files])
    info = api.model_info(repo_url.repo_id, files_metadata=True)
    assert info.id == repo_url.repo_id and info.sha == commit.oid and info.private is False
    assert {s.rfilename: s.blob_id for s in info.siblings}["sub/b.bin"] == git_blob_sha(files["sub/b.bin"])
    for path, data in files.items():
        with open(hf_hub_download(repo_url.repo_id, path), "rb") as f:
            assert f.read() == data
    snapshot = snapshot_download(repo_url.repo_id)
    assert os.path.basename(snapshot) == commit.oid
    assert read_tree(snapshot) == {".gitattributes": GITATTRIBUTES, **files}
    # A second upload of unchanged files makes no commit: preupload tells the client their oids.
    assert api.upload_folder(repo_id=repo_url.repo_id, folder_path=folder).oid == commit.oid


def test_create_repo_conflict_and_exist_ok(api):
    api.create_repo(f"{USER}/twice", private=True)
    with pytest.raises(HfHubHTTPError) as error:
        api.create_repo(f"{USER}/twice")
    assert error.value.response.status_code == 409
    assert api.create_repo(f"{USER}/twice", exist_ok=True).repo_id == f"{USER}/twice"
    assert api.model_info(f"{USER}/twice").private is True
    with pytest.raises(HfHubHTTPError) as error:
        api.create_repo("bob/not-mine")
    assert error.value.response.status_code == 403


def test_list_repo_tree_folders_and_last_commit(hub, api):
    first = hub.publish("alice/tree", {"top.txt": "1", "sub/a.txt": "a", "sub/inner/b.txt": "b"})
    second = hub.publish("alice/tree", {"sub/a.txt": "changed"})

    top = {entry.path: type(entry).__name__ for entry in api.list_repo_tree("alice/tree")}
    assert top == {".gitattributes": "RepoFile", "top.txt": "RepoFile", "sub": "RepoFolder"}
    nested = {entry.path for entry in api.list_repo_tree("alice/tree", path_in_repo="sub", recursive=True)}
    assert nested == {"sub/a.txt", "sub/inner", "sub/inner/b.txt"}
    last = {e.path: e.last_commit.oid for e in api.list_repo_tree("alice/tree", recursive=True, expand=True)
            if hasattr(e, "size")}
    assert last["top.txt"] == first and last["sub/a.txt"] == second
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree("alice/tree", path_in_repo="nope"))


def test_revisions_by_branch_tag_and_sha(hub, api):
    v1 = hub.publish("alice/revs", {"weights.txt": "v1", "old.txt": "old"}, tag="v1.0")
    v2 = hub.publish("alice/revs", {"weights.txt": "v2"})
    api.create_branch("alice/revs", branch="stable", revision=v1)
    api.create_tag("alice/revs", tag="v2.0", revision="main")
    dev = api.create_commit(
        "alice/revs",
        [CommitOperationAdd("weights.txt", b"dev"), CommitOperationDelete("old.txt")],
        commit_message="dev work",
        revision="stable",
    )

    def read(revision):
        with open(hf_hub_download("alice/revs", "weights.txt", revision=revision)) as f:
            return f.read()

    assert [read(rev) for rev in ("main", "v1.0", v1, "v2.0", v2, "stable", dev.oid)] == [
        "v2", "v1", "v1", "v2", "v2", "dev", "dev"
    ]
    assert api.model_info("alice/revs", revision="v1.0").sha == v1
    assert "old.txt" not in api.list_repo_files("alice/revs", revision="stable")
    refs = api.list_repo_refs("alice/revs")
    assert {b.name: b.target_commit for b in refs.branches} == {"main": v2, "stable": dev.oid}
    assert {t.name: t.target_commit for t in refs.tags} == {"v1.0": v1, "v2.0": v2}
    assert [c.commit_id for c in api.list_repo_commits("alice/revs", revision="stable")][:2] == [dev.oid, v1]
    with pytest.raises(HfHubHTTPError):  # a stale parent commit is refused, as on the Hub
        api.create_commit("alice/revs", [CommitOperationAdd("x", b"x")], commit_message="x", parent_commit=v1)


def test_private_repo_needs_the_owners_token(hub):
    hub.publish("alice/secret", {"config.json": "{}"}, private=True)
    anonymous, owner = HfApi(endpoint=hub.url), HfApi(endpoint=hub.url, token=TOKEN)

    with pytest.raises(RepositoryNotFoundError):
        anonymous.model_info("alice/secret")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("alice/secret", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("alice/secret")
    hub.add_token("hf_bob", "bob")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("alice/secret", "config.json", token="hf_bob")
    with pytest.raises(HfHubHTTPError) as error:  # an unknown token is an auth error, not a missing repo
        hf_hub_download("alice/secret", "config.json", token="hf_wrong")
    assert error.value.response.status_code == 401

    assert owner.model_info("alice/secret").private is True
    assert open(hf_hub_download("alice/secret", "config.json", token=TOKEN)).read() == "{}"
    assert owner.whoami()["name"] == USER
    with pytest.raises(HfHubHTTPError):
        HfApi(endpoint=hub.url, token="hf_wrong").whoami()


def test_missing_repo_revision_and_file(hub, api):
    hub.publish("alice/there", {"config.json": "{}"})
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("alice/nowhere", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("alice/nowhere")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("alice/there", "config.json", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        api.model_info("alice/there", revision="0" * 40)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("alice/there", "missing.json")
    assert api.file_exists("alice/there", "config.json") and not api.file_exists("alice/there", "missing.json")


def test_interrupted_download_resumes_with_a_range_request(hub):
    # httpx hands the client whole DOWNLOAD_CHUNK_SIZE chunks, so a cut after one full chunk leaves bytes on disk
    # and the retry must ask for the rest with a Range header.
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    data = os.urandom(chunk + 300_000)
    hub.publish("alice/big", {"model.bin": data})
    hub.fail_next_downloads("*.bin", times=1, after_bytes=chunk + 1000)

    with open(hf_hub_download("alice/big", "model.bin"), "rb") as f:
        assert f.read() == data
    gets = [r for r in hub.requests if r.method == "GET" and r.path.endswith("/model.bin")]
    assert [r.headers.get("Range") for r in gets] == [None, f"bytes={chunk}-"]


def test_interrupted_small_download_restarts(hub):
    hub.publish("alice/small", {"config.json": "x" * 5000})
    hub.fail_next_downloads("config.json", after_bytes=100)
    assert open(hf_hub_download("alice/small", "config.json")).read() == "x" * 5000
    assert sum(r.method == "GET" for r in hub.requests) == 2


def test_offline_mode_reads_the_cache(hub, monkeypatch):
    sha = hub.publish("alice/cached", {"config.json": "{}", "extra.txt": "e"})
    online_file = hf_hub_download("alice/cached", "config.json")
    online_snapshot = snapshot_download("alice/cached")
    seen = len(hub.requests)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hf_hub_download("alice/cached", "config.json") == online_file
    assert hf_hub_download("alice/cached", "config.json", revision=sha) == online_file
    assert snapshot_download("alice/cached") == online_snapshot
    with pytest.raises(LocalEntryNotFoundError):
        hf_hub_download("alice/cached", "never-downloaded.txt")
    assert len(hub.requests) == seen  # not one request reached the server


def test_transformers_from_pretrained(hub, api, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.BertModel(config).eval()
    model.save_pretrained(tmp_path / "bert")
    api.create_repo("alice/tiny-bert")
    api.upload_folder(repo_id="alice/tiny-bert", folder_path=tmp_path / "bert")

    assert transformers.AutoConfig.from_pretrained("alice/tiny-bert").hidden_size == 16
    loaded = transformers.BertModel.from_pretrained("alice/tiny-bert").eval()
    expected, actual = model.state_dict(), loaded.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[key], actual[key]) for key in expected)


def test_publish_a_folder_on_a_new_branch(hub, api, tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (tmp_path / "config.json").write_text('{"v": 2}')
    main = hub.publish("alice/branchy", {"config.json": '{"v": 1}'})
    dev = hub.publish("alice/branchy", tmp_path, revision="dev", message="v2")

    assert api.model_info("alice/branchy").sha == main
    assert api.list_repo_files("alice/branchy", revision="dev") == [".gitattributes", "config.json"]  # no .git/
    assert [c.title for c in api.list_repo_commits("alice/branchy", revision=dev)] == ["v2", "Upload folder",
                                                                                         "initial commit"]


def test_running_hub_restores_the_client(tmp_path):
    def state():
        return constants.ENDPOINT, constants.HUGGINGFACE_CO_URL_TEMPLATE, constants.HF_HUB_CACHE, os.getenv("HF_HOME")

    before = state()
    with running_hub(tmp_path) as server:
        assert constants.ENDPOINT == server.url and constants.HF_HUB_CACHE.startswith(str(tmp_path))
        server.publish("alice/x", {"f": "1"})
        assert open(hf_hub_download("alice/x", "f")).read() == "1"
    assert state() == before
