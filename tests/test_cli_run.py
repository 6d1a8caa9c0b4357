"""``hf-wide run TASK --model ID ... --input FILE_OR_TEXT`` and ``hf-wide benchmark --pipeline``."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import CASES
from hub_server import TOKEN, hub  # noqa: F401  (the fixture)
from lora_members import LLAMA, save_adapter
from PIL import Image
from pipelines.text_members import bert_tokenizer, build_members, decoder_tokenizer, save_members, sentences

from hf_wide import cli, cli_run
from hf_wide.pipelines import TASKS, pipeline
from hf_wide.pipelines.token_classification import AggregationStrategy

TEXTS = sentences(3, seed=31)
TASK_MEMBERS = {  # task -> (family case, tokenizer, labels)
    "text-classification": ("bert-seqcls", bert_tokenizer, None),
    "token-classification": ("bert-tokcls", bert_tokenizer, {0: "O", 1: "B-X", 2: "I-X"}),
    "feature-extraction": ("bert-base", bert_tokenizer, None),
    "text-generation": ("llama-causallm", decoder_tokenizer, None),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """task -> two saved member folders, each with its tokenizer."""
    folders = {}
    for task, (case, make_tokenizer, labels) in TASK_MEMBERS.items():
        root = tmp_path_factory.mktemp(task)
        folders[task] = save_members(root, build_members(case, 2, labels), make_tokenizer(root))
    return folders


def test_the_choices_named_in_the_parser_are_the_pipelines_own():
    # Named in cli_run rather than read from the pipelines, whose import `hf-wide run --help` would wait for
    assert cli_run.TASK_NAMES == tuple(sorted(TASKS))
    assert cli_run.AGGREGATIONS == tuple(s.value for s in AggregationStrategy)
    assert set(cli_run.TEXT_TASKS) == set(TASKS) - {"image-classification"}


def run_json(capsys, *argv):
    assert cli.main(["run", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert "items/s" in captured.err
    return [json.loads(line) for line in captured.out.splitlines()]


def test_a_literal_text_gives_the_pipelines_answer_as_json(saved, capsys):
    lines = run_json(capsys, "text-classification", "--model", *saved["text-classification"], "--input", TEXTS[0],
                     "--top-k", "2")
    expected = pipeline("text-classification", model=saved["text-classification"])(TEXTS[0], top_k=2)
    assert lines == [{"input": TEXTS[0], **json.loads(json.dumps(expected))}]


def test_members_in_subfolders_of_one_folder(saved, capsys):
    folders = saved["text-classification"]
    root = str(Path(folders[0]).parent)
    got = run_json(capsys, "text-classification", "--model", root, root, "--subfolder", "m0", "m1",
                   "--input", TEXTS[0])
    assert got == run_json(capsys, "text-classification", "--model", *folders, "--input", TEXTS[0])


@pytest.mark.parametrize("task", ["token-classification", "feature-extraction", "text-generation"])
def test_a_file_gives_one_answer_per_line(saved, capsys, tmp_path, task):
    path = tmp_path / "inputs.txt"
    path.write_text("\ufeff" + "\n".join(TEXTS) + "\n\n", encoding="utf-8")  # a byte-order mark is no text's
    short = ["--max-new-tokens", "3"] if task == "text-generation" else []
    lines = run_json(capsys, task, "--model", *saved[task], "--input", str(path), *short)
    assert [line["input"] for line in lines] == TEXTS
    for line in lines:
        assert len(line["members"]) == 2
        assert {"entities", "embedding", "generated_text"} & set(line)


def test_a_folder_of_images_gives_one_answer_per_image(capsys, tmp_path):
    processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    members = save_members(tmp_path, [CASES["vit-imgcls"].build(seed) for seed in range(2)], processor)
    (tmp_path / "images").mkdir()
    rng = np.random.default_rng(0)
    for name in ("b.png", "a.jpg"):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "images" / name)
    (tmp_path / "images" / "notes.txt").write_text("not an image")
    lines = run_json(capsys, "image-classification", "--model", *members, "--input", str(tmp_path / "images"))
    assert [line["input"] for line in lines] == [str(tmp_path / "images" / n) for n in ("a.jpg", "b.png")]
    expected = pipeline("image-classification", model=members)(str(tmp_path / "images" / "a.jpg"))
    assert lines[0]["label"] == expected["label"] and lines[0]["score"] == pytest.approx(expected["score"])


def test_the_plain_table_shows_ensemble_members_and_uncertainty(saved, capsys, monkeypatch):
    monkeypatch.setattr(cli_run, "_has_rich", lambda: False)
    members = saved["text-classification"]
    assert cli.main(["run", "text-classification", "--model", *members, "--input", TEXTS[1]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["input", "ensemble", "members", "uncertainty"]
    result = pipeline("text-classification", model=members)(TEXTS[1])
    row = out[2]
    assert row.startswith(TEXTS[1]) and f"{result['label']} ({result['score']:.2f})" in row
    assert "m0: " in row and " | m1: " in row and "MI " in row and "agree " in row


def test_the_table_lists_the_k_best_labels_of_top_k(saved, capsys, monkeypatch):
    # --top-k changed the JSON lines only: the table showed the best label alone
    monkeypatch.setattr(cli_run, "_has_rich", lambda: False)
    members = saved["text-classification"]
    assert cli.main(["run", "text-classification", "--model", *members, "--input", TEXTS[1], "--top-k", "2"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    best = pipeline("text-classification", model=members)(TEXTS[1], top_k=2)["top_k"]
    assert "top 2: " + ", ".join(f"{x['label']} ({x['score']:.2f})" for x in best) in row


def test_the_rich_table_where_rich_is_installed(saved, capsys):
    pytest.importorskip("rich")
    assert cli.main(["run", "text-generation", "--model", *saved["text-generation"], "--input", TEXTS[0],
                     "--max-new-tokens", "2", "--combine", "none"]) == 0
    out = capsys.readouterr().out
    assert "ensemble" in out and "m0:" in out and "m1:" in out


@pytest.mark.parametrize("argv, message", [
    (["text-generation", "--top-k", "2"], "--top-k applies to text- and image-classification"),
    (["text-classification", "--combine", "best"], "Unknown combine rule 'best'"),
    (["text-classification", "--combine", "weighted", "--weights", "1"], "one number per member"),
    (["text-classification", "--weights", "1", "2"], "--weights apply to --combine weighted, not to --combine mean"),
    (["image-classification", "--input", "no/such/folder"], "No image file or folder"),
    (["text-classification", "--input", ""], "empty text"),
    (["text-classification", "--input", "no-such-inputs.txt"], "No file no-such-inputs.txt"),  # not run as a text
    (["text-generation", "--input", "the.csv"], "No file the.csv"),
    # another task's options were ignored, the command answering as without them
    (["text-classification", "--max-new-tokens", "5"], "--max-new-tokens applies to text-generation, not to "
                                                      "text-classification"),
    (["feature-extraction", "--aggregation", "max"], "--aggregation applies to token-classification, not to "
                                                     "feature-extraction"),
    (["token-classification", "--top-k", "3"], "--top-k applies to text- and image-classification, not to "
                                               "token-classification"),
    (["text-classification", "--image-processor", "x"], "--image-processor applies to image-classification, not to "
                                                        "text-classification"),
    (["image-classification", "--input", "x.png", "--tokenizer", "x"], "--tokenizer applies to the text tasks, not "
                                                                        "to image-classification"),
])
def test_errors_are_reported_with_exit_code_2(saved, capsys, argv, message):
    task, *rest = argv
    members = saved.get(task, saved["text-classification"])
    if "--input" not in rest:
        rest += ["--input", TEXTS[0]]
    assert cli.main(["run", task, "--model", *members, *rest]) == 2
    assert message in capsys.readouterr().err


def test_private_members_with_a_token_then_offline(hub, saved, capsys):
    # hf-wide run took no --token (private members needed HF_TOKEN set) and no --offline
    folders = saved["text-classification"]
    ids = [f"alice/cls-{i}" for i in range(len(folders))]
    for repo_id, folder in zip(ids, folders):
        hub.publish(repo_id, folder, private=True)
    expected = run_json(capsys, "text-classification", "--model", *folders, "--input", TEXTS[0])
    assert cli.main(["run", "text-classification", "--model", *ids, "--input", TEXTS[0]]) == 2
    assert "alice/cls-0" in capsys.readouterr().err
    assert run_json(capsys, "text-classification", "--model", *ids, "--input", TEXTS[0], "--token", TOKEN) == expected
    asked = len(hub.requests)
    assert run_json(capsys, "text-classification", "--model", *ids, "--input", TEXTS[0], "--offline") == expected
    assert len(hub.requests) == asked  # the cache alone


def test_adapters_on_the_base_named(saved, capsys, tmp_path):
    # hf-wide run took no --base-model: adapters naming a base that is not there (moved, or private) could not run
    base = saved["text-generation"][0]
    adapters = [save_adapter(LLAMA, base, tmp_path / f"lora-{seed}", seed, base_name="gone/base", r=4,
                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") for seed in range(2)]
    argv = ["text-generation", "--model", *adapters, "--input", TEXTS[0], "--max-new-tokens", "3"]
    assert cli.main(["run", *argv]) == 2
    assert "gone/base" in capsys.readouterr().err
    pipe = pipeline("text-generation", model=adapters, model_kwargs={"base_model": base})
    expected = pipe(TEXTS[0], max_new_tokens=3, return_members=True)
    assert run_json(capsys, *argv, "--base-model", base) == [{"input": TEXTS[0], **json.loads(json.dumps(expected))}]


def test_members_in_another_dtype(saved, capsys):
    got = run_json(capsys, "feature-extraction", "--model", *saved["feature-extraction"], "--input", TEXTS[0],
                   "--dtype", "bfloat16")
    pipe = pipeline("feature-extraction", model=saved["feature-extraction"], dtype=torch.bfloat16)
    assert next(pipe.model.parameters()).dtype == torch.bfloat16
    assert got == [{"input": TEXTS[0], **json.loads(json.dumps(pipe(TEXTS[0])))}]


def test_members_without_tokenizer_files_read_with_the_tokenizer_named(saved, capsys, tmp_path):
    folders = saved["text-classification"]
    bare = []
    for i, folder in enumerate(folders):
        copy = shutil.copytree(folder, tmp_path / f"m{i}")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            (copy / name).unlink(missing_ok=True)
        bare.append(str(copy))
    assert cli.main(["run", "text-classification", "--model", *bare, "--input", TEXTS[0]]) == 2
    assert "has no vocabulary" in capsys.readouterr().err  # what transformers makes of no tokenizer files
    expected = run_json(capsys, "text-classification", "--model", *folders, "--input", TEXTS[0])
    assert run_json(capsys, "text-classification", "--model", *bare, "--input", TEXTS[0],
                    "--tokenizer", folders[0]) == expected
    assert cli.main(["run", "text-classification", "--model", *bare, "--input", TEXTS[0],
                     "--tokenizer", str(tmp_path / "none")]) == 2
    assert f"Could not load the tokenizer {tmp_path / 'none'}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["text-generation", "--max-new-tokens", "-3"], "argument --max-new-tokens: must be a whole number of at least 1, "
                                                    "got '-3'"),
    (["text-classification", "--top-k", "0"], "argument --top-k: must be a whole number of at least 1, got '0'"),
    (["token-classification", "--aggregation", "bogus"], "argument --aggregation: invalid choice: 'bogus'"),
    (["text-classification", "--aggregation", "bogus"], "argument --aggregation: invalid choice: 'bogus'"),
])
def test_bad_values_are_refused_before_anything_loads(capsys, argv, message):
    # an unknown aggregation was accepted (and ignored) for other tasks, and a negative count went to the pipeline
    task, *rest = argv
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", task, "--model", "no/such-member", "--input", TEXTS[0], *rest])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_text_generation_takes_the_members_max_new_tokens_unless_told(saved, capsys, tmp_path):
    # --max-new-tokens was 20 unless given, over the members' own generation config (which the pipeline reads)
    members = []
    for i, folder in enumerate(saved["text-generation"]):
        copy = shutil.copytree(folder, tmp_path / f"m{i}")
        own = transformers.GenerationConfig.from_pretrained(copy)
        transformers.GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                      pad_token_id=own.pad_token_id, max_new_tokens=3).save_pretrained(copy)
        members.append(str(copy))
    pipe = pipeline("text-generation", model=members)
    expected = pipe(TEXTS[0], return_members=True)
    assert expected["generated_text"] != pipe(TEXTS[0], max_new_tokens=20)["generated_text"]  # 3 tokens, not 20
    (line,) = run_json(capsys, "text-generation", "--model", *members, "--input", TEXTS[0])
    assert line == {"input": TEXTS[0], **json.loads(json.dumps(expected))}
    (line,) = run_json(capsys, "text-generation", "--model", *members, "--input", TEXTS[0], "--max-new-tokens", "5")
    assert line["generated_text"] == pipe(TEXTS[0], max_new_tokens=5)["generated_text"]


def test_members_whose_labels_are_in_another_order(capsys, tmp_path):
    # The load's refusal says "Pass allow_label_mismatch=True", which hf-wide run could not take.
    members = build_members("bert-seqcls", 2)
    for member, order in zip(members, [{0: "neg", 1: "pos", 2: "mixed"}, {0: "pos", 1: "mixed", 2: "neg"}]):
        member.config.id2label, member.config.label2id = order, {v: k for k, v in order.items()}
    paths = save_members(tmp_path, members, bert_tokenizer(tmp_path / "tok"))
    assert cli.main(["run", "text-classification", "--model", *paths, "--input", TEXTS[0]]) == 2
    assert "allow_label_mismatch" in capsys.readouterr().err
    lines = run_json(capsys, "text-classification", "--model", *paths, "--input", TEXTS[0], "--top-k", "3",
                     "--allow-label-mismatch")
    expected = pipeline("text-classification", model=paths, allow_label_mismatch=True)(TEXTS[0], top_k=3)
    assert lines == [{"input": TEXTS[0], **json.loads(json.dumps(expected))}]


def test_benchmark_pipeline_runs_the_pipeline_benchmark(monkeypatch, tmp_path):
    # What it runs and checks: tests/benchmark/test_pipeline_benchmark.py (the same small run here took a minute).
    calls = []
    monkeypatch.setattr("hf_wide.benchmark.pipeline.run_pipeline_benchmark", lambda **kw: calls.append(kw) or [])
    path = str(tmp_path / "bench.json")
    assert cli.main(["benchmark", "--pipeline", "--threads", "1", "--json", path]) == 0
    assert calls == [{"threads": 1, "json_path": path}]
