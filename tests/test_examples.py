"""examples/: every script a user copies runs here, against local members (the Hub: the test server)."""

import json
import runpy
from pathlib import Path

import pytest
import torch
from hub_server import TOKEN, running_hub

from hf_wide.demo import digit_drawing, load_digits_split, make_demo_members

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str):
    """The ``main`` of examples/{name}.py, loaded without running it."""
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=f"example_{name}")["main"]


@pytest.fixture(scope="module")
def digit_members(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    return [str(p) for p in make_demo_members(root, num_members=3, epochs=1, verbose=False)]


@pytest.fixture(scope="module")
def causal_lm_members(tmp_path_factory):
    """Three tiny Llama members with a word-level tokenizer ([SEP] as eos, left padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[PAD]", "[SEP]", "[UNK]", "the", "capital", "of", "france", "is", "paris", "a", "city"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="[SEP]", padding_side="left")
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    root = tmp_path_factory.mktemp("llama")
    paths = []
    for seed in range(3):
        torch.manual_seed(seed)
        path = root / f"member-{seed}"
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


def test_lora_ensemble(digit_members, tmp_path, capsys):
    """Fine-tunes two adapters of a digit classifier, fuses them (member 0 against its adapter run alone by PEFT),
    then classifies a drawing with the adapters it saved, given back by folder."""
    result = example("lora_ensemble")(["--base", digit_members[0], "--members", "2", "--out", str(tmp_path)])
    assert len(result["members"]) == 2 and 0 <= result["ensemble"]["accuracy"] <= 1 and result["difference"] <= 1e-4
    assert "ensemble" in capsys.readouterr().out

    _, (images, _) = load_digits_split()
    digit_drawing(images[0]).save(tmp_path / "drawn.png")
    adapters = [str(tmp_path / f"lora-{seed}") for seed in range(2)]
    answer = example("lora_ensemble")([*adapters, "--image", str(tmp_path / "drawn.png")])["result"]
    assert answer["label"] in [str(digit) for digit in range(10)] and len(answer["members"]) == 2
    # without --image: a held-out digit, as fuse_and_classify.py takes (it was a TypeError from to_digit_image(None))
    capsys.readouterr()
    answer = example("lora_ensemble")(adapters)["result"]
    assert answer["label"] in [str(digit) for digit in range(10)] and "A held-out digit" in capsys.readouterr().out


def test_lora_ensemble_of_another_image_classifier_needs_an_image(tmp_path, capsys):
    from conftest import CASES
    from lora_members import save_adapter

    case = CASES["vit-imgcls"]
    case.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(case, tmp_path / "base", tmp_path / f"a{seed}", seed, r=2, target_modules=["q_proj"])
                for seed in range(2)]
    with pytest.raises(SystemExit) as exited:
        example("lora_ensemble")(adapters)
    assert exited.value.code == 2 and "adapters of an image classifier need --image" in capsys.readouterr().err


def test_fuse_and_classify(digit_members, tmp_path, capsys):
    result = example("fuse_and_classify")(digit_members)
    assert len(result["members"]) == 3 and 0 <= result["score"] <= 1
    assert "ensemble:" in capsys.readouterr().out

    _, (images, _) = load_digits_split()
    digit_drawing(images[0]).save(tmp_path / "drawn.png")  # dark on white: normalised like the training data
    assert example("fuse_and_classify")([*digit_members, "--image", str(tmp_path / "drawn.png")])["label"]


def test_ensemble_decoding(causal_lm_members, capsys):
    result = example("ensemble_decoding")([*causal_lm_members, "--prompt", "the capital of", "--max-new-tokens", "4"])
    assert result["generated_text"].startswith("the capital of") and len(result["members"]) == 3
    assert set(result["uncertainty"]) >= {"predictive_entropy", "mutual_information", "agreement"}
    assert "ensemble (mean)" in capsys.readouterr().out


def test_ensemble_decoding_of_the_members_alone(causal_lm_members, capsys):
    # combine="none" gives the members' continuations alone: a KeyError ('generated_text')
    result = example("ensemble_decoding")([*causal_lm_members, "--prompt", "the capital of", "--max-new-tokens", "2",
                                           "--combine", "none"])
    assert set(result) == {"members"}
    out = capsys.readouterr().out
    assert "ensemble" not in out and out.count(" alone: 'the capital of") == 3


def test_push_fused_model(digit_members, tmp_path, capsys):
    from huggingface_hub import hf_hub_download, list_repo_files

    with running_hub(tmp_path):
        repo_id = example("push_fused_model")(["alice/digits-wide", *digit_members, "--token", TOKEN])
        assert f"{repo_id} says" in capsys.readouterr().out  # loaded back by its id and used
        files = set(list_repo_files(repo_id, token=TOKEN))
        assert {"config.json", "model.safetensors", "preprocessor_config.json", "README.md"} <= files
        config = json.loads(Path(hf_hub_download(repo_id, "config.json", token=TOKEN)).read_text())
        assert config["hf_wide"]["num_members"] == 3


def test_benchmark(tmp_path, capsys):
    records = example("benchmark")(["--preset", "tiny", "--json", str(tmp_path / "bench.json")])
    assert records and records[0]["max_abs_diff"] <= 1e-4
    assert "as fast as the members in sequence" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench.json").read_text())
