"""The hf-wide command line."""

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch
import transformers
from conftest import CASES
from hub_server import TOKEN, hub  # noqa: F401  (the fixture)

from hf_wide import WideModel
from hf_wide.cli import COMMANDS, DTYPE_NAMES, main
from hf_wide.placement import DTYPES


def test_trace_prints_the_plan_of_saved_members(tmp_path, capsys):
    paths = []
    for seed in range(2):
        path = tmp_path / f"m{seed}"
        CASES["llama-causallm"].build(seed).save_pretrained(path)
        paths.append(str(path))
    assert main(["trace", *paths]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM x 2 members" in out
    assert "model.layers.0.self_attn" in out and "WideAttention" in out and "WideGatedMLP" in out
    assert "WideLlamaRMSNorm" in out and "WideLinear" in out and "MFLOPs" in out


def test_trace_of_private_members_takes_a_token(hub, tmp_path, capsys):
    for seed in range(2):
        CASES["llama-causallm"].build(seed).save_pretrained(tmp_path / f"m{seed}")
        hub.publish(f"alice/m{seed}", tmp_path / f"m{seed}", private=True)
    assert main(["trace", "alice/m0", "alice/m1"]) == 2
    assert "alice/m0" in capsys.readouterr().err
    assert main(["trace", "alice/m0", "alice/m1", "--token", TOKEN]) == 0
    assert "LlamaForCausalLM x 2 members" in capsys.readouterr().out


def test_trace_of_peft_adapters(tmp_path, capsys):
    """Adapters over one base, loaded as ``from_pretrained`` loads them (it was transformers' "Unrecognized model in
    ...: should have a `model_type` key in its config.json")."""
    from lora_members import LLAMA, save_adapter

    LLAMA.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(LLAMA, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4 * (seed + 1),
                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") for seed in range(2)]
    assert main(["trace", *adapters]) == 0
    out = capsys.readouterr().out
    assert "x 2 members" in out and "WideLoraLinear" in out
    WideModel.from_pretrained(adapters).save_pretrained(tmp_path / "saved")  # the plan it was fused by, read
    assert main(["trace", str(tmp_path / "saved")]) == 0
    assert "the plan it was saved with" in capsys.readouterr().out
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    del config["hf_wide"]["plan"]  # saved by an earlier hf-wide: it was a KeyError's traceback
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    assert main(["trace", str(tmp_path / "saved")]) == 2
    assert "is an ensemble of adapters saved without its plan" in capsys.readouterr().err


def test_trace_of_one_checkpoint_shows_the_architectures_plan(tmp_path, capsys):
    CASES["vit-imgcls"].build(0).save_pretrained(tmp_path)
    assert main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "shared" not in out.split("\n")[0]
    assert "vit.embeddings" in out and "WideViTEmbeddings" in out
    assert "fallback" not in out  # every module of ViT is fused


def test_trace_and_benchmark_say_what_is_wrong_with_the_members(tmp_path, capsys):
    paths = []
    for case in ("bert-seqcls", "distilbert-seqcls"):
        CASES[case].build(0).save_pretrained(tmp_path / case)
        paths.append(str(tmp_path / case))
    missing = str(tmp_path / "nope")
    for command in (["trace"], ["benchmark", "--models"]):
        assert main([*command, paths[0], missing]) == 2  # not a traceback
        assert f"error: member 1 ({missing}): there is no folder" in capsys.readouterr().err
        assert main([*command, *paths]) == 2  # was a KeyError from the planner ('bert.embeddings')
        err = capsys.readouterr().err
        assert "error: member 1" in err and "is a DistilBertForSequenceClassification" in err


def test_a_member_whose_weights_are_cut_short_is_one_line_of_error(tmp_path, capsys):
    # hf-wide's reader raised EOFError, and safetensors' own SafetensorError (member 0, read by transformers):
    # tracebacks, exit 1.
    paths = []
    for seed in range(2):
        CASES["bert-seqcls"].build(seed).save_pretrained(tmp_path / f"m{seed}")
        paths.append(str(tmp_path / f"m{seed}"))
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_bytes((tmp_path / "m1" / "config.json").read_bytes())
    weights = (tmp_path / "m1" / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) - 5000])  # the header whole, the data cut
    capsys.readouterr()  # (saving's progress bars)
    for models, said in (([paths[0], str(cut)], "member 1 ("), ([str(cut), paths[0]], "member 0 (")):
        assert main(["trace", *models]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Error" in line]
        assert len(err) == 1 and err[0].startswith("hf-wide trace: error:") and said in err[0], err


def test_trace_of_a_fused_repo_prints_the_plan_it_was_saved_with(tmp_path, capsys):
    # transformers read its stacked weights as one member's: a traceback (RuntimeError, mismatched sizes)
    from hf_wide import WideModel

    paths = []
    for seed in range(2):
        CASES["bert-seqcls"].build(seed).save_pretrained(tmp_path / f"m{seed}")
        paths.append(str(tmp_path / f"m{seed}"))
    fused = WideModel.from_pretrained(paths)
    fused.save_pretrained(tmp_path / "wide")
    assert main(["trace", str(tmp_path / "wide")]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'wide'} is a fused hf-wide repo of 2 members ({paths[0]}, {paths[1]})" in out
    assert sorted(out.splitlines()[1:]) == sorted(str(fused.plan).splitlines())  # (saved in another order)
    assert main(["trace", paths[0], str(tmp_path / "wide")]) == 2
    assert "error: " + f"{tmp_path / 'wide'} is a fused hf-wide repo: trace it on its own" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--members", "0"], ["demo", "--members", "-2"],
                                  ["make-demo-members", "{tmp}/out", "--members", "0"]])
def test_demo_member_counts_below_one_are_refused(tmp_path, capsys, argv):
    # an IndexError from the demo, a ValueError from the training: tracebacks
    with pytest.raises(SystemExit) as exited:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert exited.value.code == 2
    assert "argument --members: must be a whole number of at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["make-demo-members", "{file}", "--members", "1"],
                                  ["make-demo-members", "{file}/sub", "--members", "1"],
                                  ["demo", "--members-dir", "{file}"]])
def test_demo_members_in_a_file_are_refused_before_any_training(tmp_path, capsys, monkeypatch, argv):
    # the members were trained first (8 of them for the demo), then saving them raised NotADirectoryError
    def train(*args, **kwargs):
        raise AssertionError("the training began")

    monkeypatch.setattr("hf_wide.demo.digits.load_digits_split", train)
    (tmp_path / "afile").write_text("")
    assert main([a.replace("{file}", str(tmp_path / "afile")) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'afile'} is a file: the members are saved in a folder" in err and "Traceback" not in err


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "hf_wide.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "trace" in result.stdout and "demo" in result.stdout
    assert all(line in " ".join(result.stdout.split()) for line, _ in COMMANDS.values())


@pytest.mark.parametrize("argv, imported", [
    (["--help"], []), (["env"], []), (["--default-allocator", "fuse", "--help"], ["hf_wide.cli_fuse"])])
def test_a_command_imports_only_its_own_module(argv, imported):
    # The pipelines, the benchmark and torch take seconds to import: `hf-wide --help` printed after 8 s.
    code = ("import sys\nfrom hf_wide.cli import COMMANDS, main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for _, m in COMMANDS.values() if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == repr(imported)


@pytest.mark.parametrize("command, choices", [
    ("run", "{feature-extraction,image-classification,text-classification,text-generation,token-classification}"),
    ("fuse", "{float32,float16,bfloat16,float64,auto}"), ("benchmark", "{tiny,quick,full,lora}"),
    ("serve", "{feature-extraction,")])
def test_a_commands_help_imports_no_torch(command, choices):
    # Their choices came from the pipelines, the placement and the benchmark's configs: 5-13 s before the help.
    code = (f"import sys\nfrom hf_wide.cli import main\ntry:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n"
            "    pass\nprint([m for m in ('torch', 'hf_wide.pipelines') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert choices in result.stdout
    assert result.stdout.splitlines()[-1] == "[]"


def test_the_dtypes_named_in_the_parser_are_placements():
    assert DTYPE_NAMES == tuple(DTYPES)


def test_trace_of_members_in_subfolders_of_one_folder(tmp_path, capsys):
    for seed in range(2):
        CASES["bert-seqcls"].build(seed).save_pretrained(tmp_path / f"checkpoint-{seed}")
    assert main(["trace", str(tmp_path), str(tmp_path), "--subfolder", "checkpoint-0", "checkpoint-1"]) == 0
    assert "BertForSequenceClassification x 2 members" in capsys.readouterr().out
    assert main(["trace", str(tmp_path), "--subfolder", "checkpoint-7"]) == 2
    assert "subfolder 'checkpoint-7'): there is no folder" in capsys.readouterr().err


def test_version_and_env_for_a_bug_report(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-wide {importlib.metadata.version('hf-wide')}"
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"- torch: {torch.__version__}" in lines and f"- transformers: {transformers.__version__}" in lines
    assert any(line.startswith("- Accelerator: ") for line in lines)
    assert not any("token" in line.lower() for line in lines)
