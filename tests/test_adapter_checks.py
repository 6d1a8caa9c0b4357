"""hf_wide/adapter_checks.py: what an adapter must be to be fused, and ``merge=True``'s merges checked against the
adapters unmerged."""

import peft
import pytest
import torch
from lora_members import LLAMA, alone, save_adapter, save_llama_adapters
from oracle import max_member_error

from hf_wide import IncompatibleMembersError, WideModel


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    return save_llama_adapters(tmp_path_factory.mktemp("llama"))


def test_a_merge_into_tied_embeddings_is_refused_and_the_adapter_fuses_unmerged(llama_adapters, tmp_path):
    # The test Llama ties its input and output embeddings: PEFT's merge of a LoRA on embed_tokens wrote the update into
    # the table lm_head shares, and the merged member was 16.8 off the adapter's PeftModel, the fusion checked against
    # the merged members and silent
    base, adapters = llama_adapters
    assert LLAMA.model_class.from_pretrained(base).config.tie_word_embeddings
    tied = save_adapter(LLAMA, base, tmp_path / "tied", 3, r=4, lora_alpha=8,
                        target_modules=["embed_tokens", "q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(IncompatibleMembersError, match=r"member 1 \(.*tied\) merged into its base is not the adapter "
                                                       r"\(its base ties its input and output embeddings\).*without "
                                                       r"merge=True"):
        WideModel.from_pretrained([adapters[0], tied], merge=True)
    wide = WideModel.from_pretrained([adapters[0], tied])  # fused as LoRA: exact
    references = [alone(LLAMA, base, adapters[0]), alone(LLAMA, base, tied)]
    assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= 1e-5


def test_what_peft_cannot_merge_is_refused_without_offering_a_merge(llama_adapters, tmp_path):
    # Prompt tuning was refused with merge=True offered, which then raised "'LlamaForCausalLM' object has no attribute
    # 'merge_and_unload'"; lora_bias on a layer without a bias raised PEFT's own error, naming no member
    base, adapters = llama_adapters
    prompt = peft.get_peft_model(LLAMA.model_class.from_pretrained(base), peft.PromptTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4))
    prompt.save_pretrained(tmp_path / "prompt")
    for merge in (False, True):
        with pytest.raises(NotImplementedError, match=r"member 1 .*PROMPT_TUNING adapter.*PEFT cannot merge it"):
            WideModel.from_pretrained([adapters[0], str(tmp_path / "prompt")], merge=merge)
    biased = save_adapter(LLAMA, base, tmp_path / "biased", 4, r=4, lora_bias=True, target_modules=["q_proj"],
                          task_type="CAUSAL_LM")
    with pytest.raises(IncompatibleMembersError, match=r"member 1 \(.*biased\) cannot be merged into its base: .*bias"):
        WideModel.from_pretrained([adapters[0], biased], merge=True)


def test_a_merge_that_is_the_adapter_fuses(llama_adapters):
    base, adapters = llama_adapters
    wide = WideModel.from_pretrained(adapters[:2], merge=True)
    references = [alone(LLAMA, base, a) for a in adapters[:2]]
    with torch.no_grad():
        assert max_member_error(wide, references, LLAMA.inputs(2, padded=True)) <= 1e-4  # merged weights round
