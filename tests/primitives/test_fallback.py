"""The per-member fallback with a KV cache: a fallen-back attention reads and extends its own rows of the
wide model's cache, so forwards and generation equal every member's own."""

import pytest
import torch
from conftest import CASES, NUM_MEMBERS
from oracle import TOLERANCE
from torch import nn
from transformers import StaticCache
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention

from hf_wide import WideModel


def with_gain(attention_class):
    class GainAttention(attention_class):
        """Reads a raw parameter in its forward: no block knows it, so it falls back per member."""

        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.gain = nn.Parameter(torch.ones(()))

        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states * self.gain, *args, **kwargs)

    return GainAttention


def members_with_a_fallen_back_attention(case_id: str, attention_class, **config):
    members = []
    for seed in range(NUM_MEMBERS):
        member = CASES[case_id].build(seed)
        member.config.update(config)
        layer = member.model.layers[1]
        attention = with_gain(attention_class)(member.config, 1)
        attention.load_state_dict(layer.self_attn.state_dict(), strict=False)
        attention.gain.data.fill_(1.0 + 0.1 * seed)
        layer.self_attn = attention
        members.append(member)
    return members


@pytest.mark.parametrize("case_id, attention_class, config", [
    ("llama-causallm", LlamaAttention, {}),
    ("mistral-causallm", MistralAttention, {"sliding_window": 4}),  # sliding-window cache layers
])
def test_forward_and_generation_with_a_cache(case_id, attention_class, config):
    members = members_with_a_fallen_back_attention(case_id, attention_class, **config)
    wide = WideModel.from_models(members)
    assert [e.fqn for e in wide.plan.fallbacks] == ["model.layers.1.self_attn"]
    inputs = CASES[case_id].inputs(2, padded=True)
    with torch.no_grad():
        got = wide(**inputs).logits  # use_cache: a cache of N*B rows is built
        for i, member in enumerate(members):
            assert (got[i] - member(**inputs).logits).abs().max().item() <= TOLERANCE
    tokens = wide.generate(**inputs, max_new_tokens=6, do_sample=False)
    for i, member in enumerate(members):
        assert torch.equal(tokens[i], member.generate(**inputs, max_new_tokens=6, do_sample=False))


def test_a_static_cache_is_refused_clearly():
    members = members_with_a_fallen_back_attention("llama-causallm", LlamaAttention)
    wide = WideModel.from_models(members)
    inputs = CASES["llama-causallm"].inputs(2, padded=True)
    cache = StaticCache(config=members[0].config, max_cache_len=32)
    with pytest.raises(NotImplementedError, match="DynamicCache"), torch.no_grad():
        wide(**inputs, past_key_values=cache)
