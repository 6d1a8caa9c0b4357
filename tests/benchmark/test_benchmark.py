"""``hf-wide benchmark``: the tiny preset through the API and its CLI entry, saved checkpoints through
``--models``, the FLOP budget and the compile policies."""

import json

import pytest
import torch
from conftest import CASES

from hf_wide.benchmark import run_benchmark
from hf_wide.benchmark.configs import BenchConfig, ModelSpec, apply_compile_policy, preset_configs
from hf_wide.benchmark.methods import METHOD_NAMES, synchronized
from hf_wide.benchmark.report import ATOL
from hf_wide.cli import build_parser

METHOD_KEYS = {"ms", "runs", "gflops", "build_s", "first_call_s", "max_abs_diff", "error", "skipped"}


def check_records(records):
    assert records
    for record in records:
        assert set(record["methods"]) == set(METHOD_NAMES)
        for name, method in record["methods"].items():
            assert set(method) == METHOD_KEYS, name
        for name in ("sequential", "wide", "ideal"):
            method = record["methods"][name]
            assert method["error"] is None and method["ms"] > 0 and method["runs"] >= 5, (name, method)
            assert method["gflops"] > 0
        assert 0 <= record["max_abs_diff"] < ATOL
        assert record["flops_total"] == record["n"] * record["flops_member"] > 0
        assert record["sequential_over_wide"] > 0 and record["wide_over_ideal"] > 0


def test_tiny_preset_through_the_api(tmp_path, capsys):
    path = tmp_path / "bench.json"
    records = run_benchmark("tiny", json_path=str(path))
    check_records(records)
    saved = json.loads(path.read_text())
    assert saved["records"] == json.loads(json.dumps(records))
    machine = saved["machine"]
    assert machine["threads"] >= 1 and machine["matmul_gflops"] > 0 and machine["torch"] and machine["date"]
    out = capsys.readouterr().out
    assert "seq/wide" in out and "wide/ideal" in out and "bert-h64-l1" in out


def test_tiny_preset_through_the_cli_entry(tmp_path, capsys):
    parser = build_parser(["benchmark"])
    path, plot = tmp_path / "bench.json", tmp_path / "speedup.png"
    args = parser.parse_args(["benchmark", "--preset", "tiny", "--device", "cpu", "--json", str(path),
                              "--plot", str(plot)])
    assert args.func(args) == 0
    saved = json.loads(path.read_text())
    check_records(saved["records"])
    assert saved["machine"]["device"] == "cpu"
    out = capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert plot.read_bytes().startswith(b"\x89PNG")


def test_times_on_an_accelerator_are_taken_when_its_work_is_done(monkeypatch):
    # CUDA runs asynchronously: a host clock around the bare call would time the launches
    done = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: done.append(device))
    run = synchronized(lambda: "out", torch.device("cuda", 1))
    assert run() == "out" and done == [torch.device("cuda", 1)]
    on_cpu = lambda: "out"  # noqa: E731
    assert synchronized(on_cpu, torch.device("cpu")) is on_cpu


@pytest.mark.parametrize("policy, compiled", [("all", [True] * 4), ("none", [False] * 4),
                                              ("subset", [False, True, True, False])])
def test_compile_policy(policy, compiled):
    configs = [BenchConfig(ModelSpec("bert", 128), 2, 1, 16), BenchConfig(ModelSpec("bert", 128), 8, 1, 16),
               BenchConfig(ModelSpec("llama", 128), 8, 1, 16), BenchConfig(ModelSpec("llama", 256), 8, 1, 16)]
    assert [c.compile for c in apply_compile_policy(configs, policy)] == compiled


def test_quick_preset_compiles_one_config_per_family():
    quick = preset_configs("quick")
    chosen = [c for c in apply_compile_policy(quick.configs, quick.compile) if c.compile]
    assert sorted(c.spec.family for c in chosen) == ["bert", "llama"]


def test_lora_preset_times_the_lora_configs_of_both_presets_longer():
    lora, quick, full = preset_configs("lora"), preset_configs("quick"), preset_configs("full")
    assert lora.configs and all(c.spec.lora and not c.compile for c in lora.configs)
    assert all(c in quick.configs and c in full.configs for c in lora.configs)
    assert lora.target_s > max(quick.target_s, full.target_s)


def test_configs_over_the_flop_budget_are_skipped_and_said(capsys):
    assert run_benchmark("tiny", max_gflop=0) == []
    assert "skipped 1 config(s), over the budget of 0 GFLOP" in capsys.readouterr().out


def test_saved_checkpoints_through_models(tmp_path, capsys):
    paths = []
    for seed in range(2):
        paths.append(str(tmp_path / f"m{seed}"))
        CASES["llama-causallm"].build(seed).save_pretrained(paths[-1])
    records = run_benchmark(models=paths, batch=1, seq=8, compile="none")
    check_records(records)
    assert records[0]["config"] == "LlamaForCausalLM" and records[0]["models"] == paths
    assert "LlamaForCausalLM" in capsys.readouterr().out


def test_lora_configs_time_the_base_as_the_ideal_and_peft_mixed_batches():
    from hf_wide.benchmark.runner import _preset_records

    (record,), _ = _preset_records([BenchConfig(ModelSpec("llama-lora", 64, 1), 2, 1, 8, compile=False)], 0.02, 1.0)
    methods = record["methods"]
    assert methods["wide"]["max_abs_diff"] <= 1e-5 and methods["peft_mixed"]["max_abs_diff"] <= 1e-5
    assert methods["peft_mixed"]["ms"] is not None and record["peft_mixed_over_wide"] is not None
    assert methods["ideal"]["ms"] is not None and methods["ideal"]["max_abs_diff"] is None  # the base: no member
    assert {c.spec.family for c in preset_configs("quick").configs} >= {"llama-lora", "bert-lora"}


def _cli_args(*argv):
    parser = build_parser(["benchmark"])
    return parser.parse_args(["benchmark", *argv])


@pytest.mark.parametrize("argv, said", [
    (["--batch", "0"], "argument --batch: must be a whole number of at least 1, got '0'"),
    (["--seq", "0"], "argument --seq: must be a whole number of at least 1, got '0'"),
    (["--threads", "0"], "argument --threads: must be a whole number of at least 1, got '0'"),
    (["--device", "bogus"], "argument --device: 'bogus' is no torch device"),
    (["--device", "cuda"], "argument --device: torch " + torch.__version__ + " sees no cuda device here"),
])
def test_bad_options_are_refused_before_anything_runs(capsys, monkeypatch, argv, said):
    # each was a traceback from torch once the timing began (an empty batch, set_num_threads(0), a device string)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build, wherever the test runs
    with pytest.raises(SystemExit) as exited:
        _cli_args("--models", "a", "b", *argv)
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_a_sequence_past_the_members_positions_is_refused(tmp_path, capsys):
    # a RuntimeError from the position embeddings ("The expanded size of the tensor (100) must match ... (64)")
    paths = []
    for seed in range(2):
        paths.append(str(tmp_path / f"m{seed}"))
        CASES["bert-seqcls"].build(seed).save_pretrained(paths[-1])
    args = _cli_args("--models", *paths, "--batch", "1", "--seq", "65")
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "hf-wide benchmark: error: seq 65 is longer than the 64 positions of BertForSequenceClassification" in err
    assert "Traceback" not in err
