"""WideLoraEmbedding (hf_wide/blocks/lora_embedding.py): PEFT LoRA members of an embedding fused with from_models,
each member against its PeftModel run alone."""

import lora_members
import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error

from hf_wide import Kind, WideModel

LLAMA, BERT = CASES["llama-causallm"], CASES["bert-seqcls"]
EMBED = "base_model.model.model.embed_tokens"


def adapted(base, seed: int, **config):
    return lora_members.adapted(base, seed, task_type="CAUSAL_LM", **config)


def test_ranks_alphas_and_rslora_that_differ_are_one_lookup_in_the_base_table():
    """The tiny Llama ties its output layer to the embedding: the block holds the base's one table, which the
    output layer reads too (tied again in the wide model)."""
    base, inputs = LLAMA.build(0), LLAMA.inputs(3, padded=True)
    members = [adapted(base, 0, r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
               adapted(base, 1, r=8, lora_alpha=4, target_modules=["embed_tokens", "q_proj"]),
               adapted(base, 2, r=2, lora_alpha=8, use_rslora=True, target_modules=["embed_tokens", "q_proj"])]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    assert wide.plan.entries[EMBED].kind == Kind.BLOCK and wide.plan.entries[EMBED].wide_class == "WideLoraEmbedding"
    assert not wide.plan.fallbacks
    block = wide.model.get_submodule(EMBED)
    assert type(block.base_layer) is torch.nn.Embedding  # the base's one table serves every member
    assert wide.model.get_submodule("base_model.model.lm_head").weight is block.base_layer.weight
    assert block.lora_embedding_A.shape == (3, LLAMA.build(0).config.vocab_size, 8)
    assert block.scaling.tolist() == pytest.approx([2.0, 0.5, 8 / 2 ** 0.5])
    shared = wide.member(1, share=True).get_submodule(EMBED).lora_embedding_A["default"]  # a view, held once
    assert shared.untyped_storage().data_ptr() == block.lora_embedding_A.untyped_storage().data_ptr()
    tokens = wide.generate(**inputs, max_new_tokens=4, do_sample=False)
    for i, member in enumerate(members):
        assert torch.equal(tokens[i], member.generate(**inputs, max_new_tokens=4, do_sample=False))
        got, want = wide.member(i).state_dict(), member.state_dict()  # each member's own rank back, PEFT's layout
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_one_scaling_and_members_with_their_own_tables():
    """Members fine-tuned from different bases (BERT, whose word embeddings nothing else reads): their tables
    stacked, one lookup over them as over the low-rank rows."""
    inputs = BERT.inputs(2, padded=True)
    members = [lora_members.adapted(BERT.build(seed), seed, task_type="SEQ_CLS", r=4, lora_alpha=8,
                                    target_modules=["word_embeddings", "query"]) for seed in range(2)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, inputs) <= TOLERANCE
    block = wide.model.get_submodule("base_model.model.bert.embeddings.word_embeddings")
    assert type(block).__name__ == "WideLoraEmbedding" and block.base_layer.weight.shape[0] == 2  # a WideEmbedding


def test_an_embedding_with_dora_is_declined_and_runs_as_each_members_own_code():
    base = LLAMA.build(0)
    members = [adapted(base, seed, r=4, lora_alpha=8, use_dora=True, target_modules=["embed_tokens"])
               for seed in range(2)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert wide.plan.entries[EMBED].wide_class != "WideLoraEmbedding"


def test_no_gradient_reaches_the_padding_row_of_a_members_table():
    """PEFT looks the low-rank rows up with the base's ``padding_idx``, so training leaves A's row of the padding
    token as it is; each member's gradient of A in the wide model is the PeftModel's (the padding row zero)."""
    base, inputs = LLAMA.build(0), LLAMA.inputs(2, padded=True)
    assert (inputs["input_ids"] == base.config.pad_token_id).any()  # the padding token is looked up
    members = [adapted(base, seed, r=2 + 2 * seed, lora_alpha=8, target_modules=["embed_tokens"]) for seed in range(2)]
    wide = WideModel.from_models(members, share_identical=False).train()
    block = wide.model.get_submodule(EMBED)
    wide(**inputs).logits.sum().backward()
    for i, member in enumerate(members):
        member.train()
        member(**inputs).logits.sum().backward()
        want = member.get_submodule(EMBED).lora_embedding_A["default"].grad  # (r_i, V)
        got = block.lora_embedding_A.grad[i, :, : want.shape[0]].T
        assert torch.allclose(got, want, atol=1e-5) and not want[:, base.config.pad_token_id].any()
