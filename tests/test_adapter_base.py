"""hf_wide/adapter_base.py: the one base a list of adapters loads over, and what the adapters must agree on of it."""

import peft
import pytest
import torch
from conftest import CASES
from oracle import max_member_error

from hf_wide import IncompatibleMembersError, WideModel

BERT = CASES["bert-seqcls"]


def head_adapter(base_dir, folder, seed: int, labels: int) -> str:
    """A classifier adapter trained with a head of ``labels`` labels, saved whole (PEFT's modules_to_save)."""
    torch.manual_seed(seed)
    model = BERT.model_class.from_pretrained(base_dir, num_labels=labels, ignore_mismatched_sizes=True)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query"],
                                                       task_type="SEQ_CLS", init_lora_weights=False))
    model.save_pretrained(folder)
    return str(folder)


def test_adapters_with_a_head_of_other_labels_than_the_bases_load_as_peft_loads_them(tmp_path):
    # Their base is loaded with their number of labels and its head drawn anew, as PEFT's users load it: transformers
    # refused the base's head of another size ("You set ignore_mismatched_sizes to False")
    BERT.build(0).save_pretrained(tmp_path / "base")
    labels = BERT.build(0).config.num_labels + 2
    adapters = [head_adapter(tmp_path / "base", tmp_path / f"a{i}", i, labels) for i in range(2)]
    wide = WideModel.from_pretrained(adapters)
    references = [peft.PeftModel.from_pretrained(BERT.model_class.from_pretrained(
        tmp_path / "base", num_labels=labels, ignore_mismatched_sizes=True), a).eval() for a in adapters]
    inputs = BERT.inputs(2, padded=True)
    assert wide(**inputs).logits.shape[-1] == labels
    assert max_member_error(wide, references, inputs) <= 1e-5
    # heads of different numbers of labels, and the base (its own head) beside them, are refused by name
    other = head_adapter(tmp_path / "base", tmp_path / "other", 2, labels + 1)
    with pytest.raises(IncompatibleMembersError, match=rf"different numbers of labels: member 0 .*a0.* {labels}, "
                                                       rf"member 2 .*other.* {labels + 1}"):
        WideModel.from_pretrained([*adapters, other])
    with pytest.raises(IncompatibleMembersError, match=rf"saved heads have {labels} labels.*member 2 .*base.*, a full "
                                                       "checkpoint, cannot be a member beside them"):
        WideModel.from_pretrained([*adapters, str(tmp_path / "base")])
