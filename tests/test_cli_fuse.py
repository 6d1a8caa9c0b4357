"""``hf-wide fuse`` (hf_wide/cli_fuse.py): members fused into one repo, saved to a folder or pushed to the test Hub,
and loaded back equal to the members; what it refuses, in one line."""

import json
from pathlib import Path

import peft
import pytest
from conftest import CASES
from hub_server import TOKEN, hub  # noqa: F401  (the fixture)
from lora_members import LLAMA, alone, save_adapter
from oracle import TOLERANCE, max_member_error

from hf_wide import WideModel
from hf_wide.cli import build_parser, main

CASE = CASES["bert-seqcls"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("members")
    members = [CASE.build(seed) for seed in range(2)]
    for seed, model in enumerate(members):
        model.save_pretrained(root / f"seed-{seed}")
    return members, [str(root / f"seed-{seed}") for seed in range(2)]


def test_members_to_a_folder_that_loads_back(saved, tmp_path, capsys):
    members, paths = saved
    assert main(["fuse", *paths, "--output", str(tmp_path / "wide")]) == 0
    out = capsys.readouterr().out
    assert "BertForSequenceClassification x 2 members" in out and f"Saved the fused repo to {tmp_path / 'wide'}" in out
    assert "WideLinear" not in out  # the summary, not the plan's table (--plan prints it)
    back = WideModel.from_pretrained(str(tmp_path / "wide"))
    assert back.member_ids == paths
    assert max_member_error(back, members, CASE.inputs(3, padded=True)) <= TOLERANCE


def test_members_in_subfolders(saved, tmp_path):
    members, paths = saved
    root = str(Path(paths[0]).parent)
    assert main(["fuse", root, root, "--subfolder", "seed-0", "seed-1", "--output", str(tmp_path / "wide")]) == 0
    back = WideModel.from_pretrained(str(tmp_path / "wide"))
    assert back.member_subfolders == ["seed-0", "seed-1"]
    assert max_member_error(back, members, CASE.inputs(3, padded=True)) <= TOLERANCE


def test_pushed_at_pinned_revisions_and_loaded_back_from_a_fresh_cache(hub, saved, tmp_path, capsys):
    members, paths = saved
    hub.publish("alice/seed-0", paths[0])
    sha = hub.publish("alice/seed-1", paths[1], revision="v1")
    assert main(["fuse", "alice/seed-0", "alice/seed-1", "--revision", "main", "v1", "--push-to-hub",
                 "alice/wide", "--private", "--token", TOKEN, "--commit-message", "two seeds", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "WideLinear" in out  # --plan: every module
    repo = hub.repos["alice/wide"]
    assert repo.private and f"/alice/wide/commit/{repo.branches['main']}" in out
    assert repo.commits[repo.branches["main"]].title == "two seeds"
    back = WideModel.from_pretrained("alice/wide", token=TOKEN, cache_dir=tmp_path / "fresh")
    assert back.member_ids == ["alice/seed-0", "alice/seed-1"] and back.member_revisions[1] == sha
    assert max_member_error(back, members, CASE.inputs(3, padded=True)) <= TOLERANCE


def test_adapters_of_a_base_on_the_hub(hub, tmp_path, capsys):
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    base_sha = hub.publish("alice/base", tmp_path / "base")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"lora-{seed}", seed, base_name="alice/base", r=4,
                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") for seed in range(2)]
    for seed, adapter in enumerate(adapters):
        hub.publish(f"alice/lora-{seed}", adapter)
    assert main(["fuse", "alice/lora-0", "alice/lora-1", "--base-revision", base_sha, "--output",
                 str(tmp_path / "wide")]) == 0
    back = WideModel.from_pretrained(str(tmp_path / "wide"))
    references = [alone(LLAMA, tmp_path / "base", adapter) for adapter in adapters]
    inputs = LLAMA.inputs(2, padded=True)
    assert max_member_error(back, references, inputs) <= TOLERANCE
    config = json.loads((tmp_path / "wide" / "config.json").read_text())["hf_wide"]["adapters"]
    assert config["base_model"] == "alice/base" and config["base_revision"] == base_sha
    assert not list((tmp_path / "wide").glob("*.safetensors"))  # the base referenced, not copied


@pytest.mark.parametrize("argv, said", [
    ([], "--output DIR, --push-to-hub REPO_ID, or both"),
    (["--output", "{tmp}/w", "--revision", "a", "b", "c"], "Got 3 revisions for 2 members"),
    (["--output", "{tmp}/w", "--dtype", "int8"], "invalid choice"),
    # refused after loading, fusing and verifying the members (in huggingface_hub's words, "Unit 'US' not
    # supported"), leaving the output folder behind, empty
    (["--output", "{tmp}/w", "--max-shard-size", "bogus"], "argument --max-shard-size: 'bogus' is no size: give one "
                                                          "such as 5GB"),
    (["--output", "{tmp}/w", "--max-shard-size", "0"], "argument --max-shard-size: '0' is no size"),
    # the push's options with no push: the repo was saved to --output, the options silently dropped
    (["--output", "{tmp}/w", "--private"], "no --push-to-hub REPO_ID for --private to apply to"),
    (["--output", "{tmp}/w", "--create-pr", "--commit-message", "m"], "for --create-pr, --commit-message to apply"),
    # refused by the push, after loading, fusing and verifying the members
    (["--push-to-hub", "alice/not a name"], "argument --push-to-hub: Repo id must use alphanumeric chars"),
])
def test_what_it_refuses_is_one_line(saved, tmp_path, capsys, argv, said):
    _, paths = saved
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if said.startswith(("invalid choice", "argument")):  # argparse's own refusal, before anything loads
        with pytest.raises(SystemExit):
            main(["fuse", *paths, *argv])
    else:
        assert main(["fuse", *paths, *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("given, size", [("5GB", 5 * 10 ** 9), ("500mb", 5 * 10 ** 8), ("1.5KB", 1500), ("2048", 2048)])
def test_shard_sizes_as_huggingface_hub_reads_them_or_bytes(given, size):
    assert build_parser().parse_args(["fuse", "a", "--output", "o", "--max-shard-size", given]).max_shard_size == size


def test_an_adapter_hf_wide_does_not_run_is_one_line_naming_the_flag(tmp_path, capsys):
    # a NotImplementedError went out as a traceback, and said "Pass merge=True" where the flag is --merge
    LLAMA.build(0).save_pretrained(tmp_path / "base")
    ia3 = peft.get_peft_model(LLAMA.model_class.from_pretrained(tmp_path / "base"), peft.IA3Config(
        target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    ia3.save_pretrained(tmp_path / "ia3")
    lora = save_adapter(LLAMA, tmp_path / "base", tmp_path / "lora", 1, r=4, target_modules=["q_proj"],
                        task_type="CAUSAL_LM")
    assert main(["fuse", str(tmp_path / "ia3"), lora, "--output", str(tmp_path / "wide")]) == 2
    err = capsys.readouterr().err  # (after the saves' progress bars)
    assert "\nhf-wide fuse: error: member 0" in err and "is a IA3 adapter" in err
    assert "Pass --merge to merge each adapter" in err and "merge=True" not in err and "Traceback" not in err


def test_a_failed_save_leaves_no_folder_it_created(saved, tmp_path, capsys, monkeypatch):
    _, paths = saved

    def save_half(self, folder, **kwargs):  # a save that fails half way (a full disk, say)
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(WideModel, "save_pretrained", save_half)
    assert main(["fuse", *paths, "--output", str(tmp_path / "new" / "wide")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a folder that was there is the user's: left as it is
    assert main(["fuse", *paths, "--output", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir()


def test_an_output_that_is_a_file_is_refused_before_the_members_load(saved, tmp_path, capsys, monkeypatch):
    # the members were loaded, fused and verified first, then the save raised
    def load(*args, **kwargs):
        raise AssertionError("the members were loaded")

    monkeypatch.setattr(WideModel, "from_pretrained", load)
    _, paths = saved
    (tmp_path / "afile").write_text("mine")
    for output in (tmp_path / "afile", tmp_path / "afile" / "wide"):
        assert main(["fuse", *paths, "--output", str(output)]) == 2
        assert f"--output {output}: {tmp_path / 'afile'} is a file, not a folder." in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_missing_member_is_named(saved, tmp_path, capsys):
    _, paths = saved
    missing = str(tmp_path / "nope")
    assert main(["fuse", paths[0], missing, "--output", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # (after the progress bar)
    assert err.startswith("hf-wide fuse: error: member 1 (") and "there is no folder" in err


def test_a_hub_that_does_not_answer_the_push_is_one_line(saved, capsys, monkeypatch):
    # the HTTP library's connection errors are no OSError: a traceback, after the whole fuse had run
    members, paths = saved
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # (a port nothing listens on)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    assert main(["fuse", *paths, "--push-to-hub", "alice/wide", "--token", TOKEN]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]  # (after the progress bars)
    assert said.startswith("hf-wide fuse: error: could not push to alice/wide: ConnectError")
