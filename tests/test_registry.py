"""Builder lookup along the MRO: a subclass finds its ancestor's wide builder only if it keeps its forward."""

import subprocess
import sys

import torch
import transformers as tf
from torch import nn

from hf_wide import WideModel
from hf_wide.primitives.embedding import WideEmbedding, WideScaledWordEmbedding
from hf_wide.primitives.linear import WideLinear
from hf_wide.registry import find_wide


class TaggedLinear(nn.Linear):
    """A subclass that keeps nn.Linear's forward."""


class ScaledEmbedding(nn.Embedding):
    """A subclass that changes the forward (Gemma's and BART's scaled word embeddings do this)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


def test_a_subclass_keeping_the_forward_finds_the_builder():
    assert find_wide(TaggedLinear) is WideLinear
    assert find_wide(nn.modules.linear.NonDynamicallyQuantizableLinear) is WideLinear
    assert find_wide(nn.Embedding) is WideEmbedding


def test_a_subclass_changing_the_forward_finds_none():
    assert find_wide(ScaledEmbedding) is None  # so it falls back, member by member


def test_gemmas_scaled_embedding_is_not_fused_as_a_plain_one():
    def member(seed):
        torch.manual_seed(seed)
        config = tf.Gemma3TextConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                     max_position_embeddings=64, pad_token_id=0, sliding_window=16)
        return tf.Gemma3ForCausalLM(config).eval()

    members = [member(seed) for seed in range(2)]
    wide = WideModel.from_models(members)
    embed_tokens = wide.model.model.embed_tokens
    assert isinstance(embed_tokens, WideScaledWordEmbedding)  # its own builder, not WideEmbedding's forward
    assert wide.model.lm_head.weight is embed_tokens.weight  # still tied
    ids = torch.randint(2, 100, (2, 6))
    with torch.no_grad():
        got = wide(input_ids=ids).logits
        for i, m in enumerate(members):
            assert (got[i] - m(input_ids=ids).logits).abs().max().item() <= 1e-5  # was 7e-2: the scale was lost


def test_a_users_builder_registered_before_any_lookup_replaces_hf_wides_own():
    """hf-wide's own builders register when a lookup first needs them (``import hf_wide`` no longer imports them):
    a user's registration made before that still wins, as it did when they were all imported first. In a fresh
    process: the registry is process-wide."""
    code = """
from torch import nn
from hf_wide.registry import find_wide, register_wide

@register_wide(nn.Linear)
class Mine:
    pass

print(find_wide(nn.Linear) is Mine, find_wide(nn.Embedding).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "WideEmbedding"]
