"""Keyword arguments of ``from_pretrained`` (:func:`hf_wide.download.check_hub_kwargs`): transformers' options that
hf-wide cannot honour are refused saying why, those transformers 5 ignores are taken alike, and anything else is a
``TypeError`` that names it."""

import pytest
from conftest import CASES
from oracle import TOLERANCE, max_member_error

from hf_wide import WideModel
from hf_wide.download import MemberLoadError, check_hub_kwargs


def test_hub_options_pass_through():
    assert check_hub_kwargs({"token": "t", "cache_dir": "c"}) == {"token": "t", "cache_dir": "c"}


@pytest.mark.parametrize("name, value, match", [
    ("max_memory", {0: "10GiB"}, "max_memory=.*one device"),
    ("offload_folder", "offload", "offload_folder=.*one device"),
    ("tp_plan", "auto", "tp_plan=.*member_parallel=True"),
    ("load_in_8bit", True, "quantized members"),
    ("quantization_config", object(), "quantized members"),
    ("use_safetensors", False, "allow_pickle=True"),
    ("variant", "fp16", "not a variant's"),
])
def test_options_hf_wide_cannot_honour_say_why(name, value, match):
    with pytest.raises(ValueError, match=match):
        check_hub_kwargs({name: value})


def test_options_that_ask_for_nothing_are_taken():
    """Their defaults, and ``use_safetensors=True`` (hf-wide's own default: pickle only with ``allow_pickle``)."""
    assert check_hub_kwargs({"max_memory": None, "load_in_8bit": False, "use_safetensors": True}) == {}


def test_a_misspelt_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'cahce_dir' \(and 'tokn'\)"):
        check_hub_kwargs({"cahce_dir": "c", "tokn": "t"})


def test_low_cpu_mem_usage_is_taken_as_transformers_takes_it(tmp_path):
    """transformers 5 takes ``low_cpu_mem_usage`` and no longer uses it; code written for it loads here too (it raised
    "unexpected keyword argument")."""
    case = CASES["bert-seqcls"]
    members = [case.build(seed) for seed in range(2)]
    for i, member in enumerate(members):
        member.save_pretrained(tmp_path / f"m{i}")
    wide = WideModel.from_pretrained([str(tmp_path / f"m{i}") for i in range(2)], low_cpu_mem_usage=True)
    inputs = case.inputs(batch=2, padded=True)
    assert max_member_error(wide, members, inputs) <= TOLERANCE


def test_a_member_folder_without_a_config_is_named(tmp_path):
    """transformers' "Unrecognized model in <folder>" named neither the member nor the file missing."""
    CASES["bert-seqcls"].build(0).save_pretrained(tmp_path / "m0")
    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "model.safetensors").write_bytes((tmp_path / "m0" / "model.safetensors").read_bytes())
    with pytest.raises(MemberLoadError, match=r"member 1 \(.*m1\): there is no config.json in"):
        WideModel.from_pretrained([str(tmp_path / "m0"), str(tmp_path / "m1")])
