"""Fused blocks: chosen by the plan for the families they know, exact end to end (tests/test_model.py),
and each block's member i is the source module i again."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache
from conftest import CASES
from oracle import TOLERANCE, max_member_error

from hf_wide import Kind, WideModel
from hf_wide.blocks import (
    WideAttention,
    WideDebertaAttention,
    WideDebertaV2Attention,
    WideGatedMLP,
    WideMPNetAttention,
    WidePlainMLP,
    WideViTEmbeddings,
)

BLOCKS = {
    "bert-seqcls": {"BertSelfAttention": WideAttention},
    "roberta-tokcls": {"RobertaSelfAttention": WideAttention},
    "xlm-roberta-seqcls": {"XLMRobertaSelfAttention": WideAttention},
    "camembert-tokcls": {"CamembertSelfAttention": WideAttention},
    "electra-seqcls": {"ElectraSelfAttention": WideAttention},
    "distilbert-seqcls": {"DistilBertSelfAttention": WideAttention},
    "albert-seqcls": {"AlbertAttention": WideAttention},
    "mpnet-seqcls": {"MPNetSelfAttention": WideMPNetAttention},
    "deberta-seqcls": {"DisentangledSelfAttention": WideDebertaAttention},
    "deberta-v2-tokcls": {"DisentangledSelfAttention": WideDebertaV2Attention},
    "llama-causallm": {"LlamaAttention": WideAttention, "LlamaMLP": WideGatedMLP},
    "mistral-causallm": {"MistralAttention": WideAttention, "MistralMLP": WideGatedMLP},
    "qwen2-causallm": {"Qwen2Attention": WideAttention, "Qwen2MLP": WideGatedMLP},
    "vit-imgcls": {"ViTAttention": WideAttention, "ViTMLP": WidePlainMLP, "ViTEmbeddings": WideViTEmbeddings},
}


@pytest.mark.parametrize("case_id", list(BLOCKS))
def test_plan_fuses_known_blocks(fused, case_id):
    _, wide = fused(case_id)
    blocks = {e.module_class: e.wide_class for e in wide.plan.entries.values() if e.kind == Kind.BLOCK}
    assert blocks == {k: v.__name__ for k, v in BLOCKS[case_id].items()}
    # nothing inside a block is planned on its own
    roots = [e.fqn for e in wide.plan.entries.values() if e.kind == Kind.BLOCK]
    assert not any(f.startswith(r + ".") for f in wide.plan.entries for r in roots)


@pytest.mark.parametrize("case_id", list(BLOCKS))
def test_block_member_is_the_source_module(fused, case_id):
    members, wide = fused(case_id)
    for fqn, entry in wide.plan.entries.items():
        if entry.kind != Kind.BLOCK:
            continue
        block = wide.model.get_submodule(fqn)
        for i, member in enumerate(members):
            source = member.get_submodule(fqn)
            back = block.to_module(i)
            assert type(back) is type(source)
            for key, value in source.state_dict().items():
                assert torch.equal(back.state_dict()[key], value), (fqn, key)


def test_qkv_is_one_tensor_for_all_members(fused):
    members, wide = fused("llama-causallm")
    attention = wide.model.model.layers[0].self_attn
    q = members[1].model.layers[0].self_attn.q_proj.weight
    k = members[1].model.layers[0].self_attn.k_proj.weight
    assert attention.qkv_weight.shape[0] == len(members)
    assert torch.equal(attention.qkv_weight[1][: q.shape[0]], q)
    assert torch.equal(attention.qkv_weight[1][q.shape[0] : q.shape[0] + k.shape[0]], k)


def test_shared_identical_block_is_not_fused():
    case = CASES["llama-seqcls"]
    members = [case.build(0) for _ in range(2)]  # identical members: everything is shared
    wide = WideModel.from_models(members)
    assert not wide.plan.by_kind(Kind.BLOCK)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_attention_takes_the_cache_under_either_releases_name(fused, name):
    # transformers 5.24 calls a layer's cache `cache`, earlier releases `past_key_values`: a block that missed it
    # would attend to the new token alone, every generated token after the first wrong
    members, wide = fused("llama-causallm")
    attention, inner = wide.model.model.layers[0].self_attn, wide.model.model
    hidden = torch.randn(len(members) * 2, 4, inner.config.hidden_size)  # (N*B, T, D)
    rotary = inner.rotary_emb(hidden, torch.arange(4)[None])
    whole, _ = attention(hidden, rotary, None)  # causal, no cache
    cache = DynamicCache()
    attention(hidden[:, :3], tuple(r[:, :3] for r in rotary), None, **{name: cache})
    step, _ = attention(hidden[:, 3:], tuple(r[:, 3:] for r in rotary), None, **{name: cache})
    assert cache.get_seq_length() == 4
    torch.testing.assert_close(step, whole[:, 3:])
    with pytest.raises(TypeError, match="two names"):
        attention(hidden, rotary, None, cache=cache, past_key_values=DynamicCache())


@pytest.mark.parametrize("case_id", ["bert-seqcls", "distilbert-seqcls", "electra-seqcls"])
def test_dropout_set_off_after_fusion_is_off_in_the_fused_attention_too(case_id):
    # TRL's disable_dropout_in_model sets every nn.Dropout's p to 0: the members then train without dropout, and the
    # fused attention, which had copied its members' p as a number, kept dropping out (as did the vectorised
    # embeddings: tests/primitives/test_vectorised.py)
    case = CASES[case_id]
    members = [case.build(seed) for seed in range(2)]
    assert all(m.p > 0 for m in members[0].modules() if isinstance(m, torch.nn.Dropout))
    wide = WideModel.from_models([copy.deepcopy(m) for m in members], share_identical=False)
    assert any(isinstance(m, WideAttention) for m in wide.modules())
    for model in (wide, *members):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    inputs = case.inputs(2, padded=True)
    with torch.no_grad():
        assert max_member_error(wide.train(), [m.train() for m in members], inputs) <= TOLERANCE
