"""The per-member fallback: with a KV cache, a fallen-back attention reads and extends its own rows of the
wide model's cache, so forwards and generation equal every member's own; a submodule that model code calls
through the fallback runs per member too."""

import pytest
import torch
from conftest import CASES, NUM_MEMBERS
from families import fall_back_attention_
from oracle import TOLERANCE
from torch import nn
from transformers import StaticCache
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention

from hf_wide import WideModel
from hf_wide.fold import Fold
from hf_wide.primitives.fallback import PerMemberFallback
from hf_wide.verify_cache import cache_name


def members_with_a_fallen_back_attention(case_id: str, attention_class, **config):
    members = [CASES[case_id].build(seed) for seed in range(NUM_MEMBERS)]
    for member in members:
        member.config.update(config)
    fall_back_attention_(members, 1, attention_class)
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
        wide(**inputs, **{cache_name(members[0]): cache})


def test_a_submodule_called_through_the_fallback_runs_per_member():
    class Holder(nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.norm = nn.LayerNorm(3)
            with torch.no_grad():
                self.norm.weight.fill_(scale)

    holders = [Holder(1.0 + i) for i in range(NUM_MEMBERS)]
    fallback = PerMemberFallback(holders, Fold(NUM_MEMBERS))
    x = torch.randn(NUM_MEMBERS * 2, 3)  # B = 2 rows per member
    got = fallback.norm(x)  # model code calling a fallback's child itself (XMOD's layers do)
    for i, holder in enumerate(holders):
        assert torch.equal(got[2 * i : 2 * i + 2], holder.norm(x[2 * i : 2 * i + 2]))
    assert len(fallback.state_dict()) == 2 * NUM_MEMBERS  # the per-member view is not a child
