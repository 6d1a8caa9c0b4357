"""WideDebertaAttention: DeBERTa (v1) fuses without a per-member fallback, and every member of the wide
model equals its checkpoint run alone, over the attention's variants (talking heads, c2p or p2c alone, no
relative attention), inputs longer than the relative span, a table identical in every member, and
returned attentions; the DeBERTa layer norm is a wide primitive. Where a consumer of the stacked table is
not fused, the encoder falls back."""

import pytest
import torch
import transformers as tf
from families import SEQ_LEN, members_from, text_batch
from oracle import TOLERANCE, max_member_error

from hf_wide import WideModel
from hf_wide.plan import Kind

N = 3
SMALL = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64, num_labels=3)
RELATIVE = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16)
VARIANTS = {
    "relative": RELATIVE,
    "talking-heads": dict(RELATIVE, talking_head=True),
    "c2p-only": dict(RELATIVE, pos_att_type=["c2p"]),
    "p2c-only": dict(RELATIVE, pos_att_type=["p2c"]),
    "absolute": dict(relative_attention=False),
}


def build(variant: str, model_class=tf.DebertaForSequenceClassification):
    return members_from(model_class, tf.DebertaConfig(**SMALL, **VARIANTS[variant]), range(N))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_fuses_and_equals_each_member(variant):
    members = build(variant)
    wide = WideModel.from_models(members).eval()
    assert wide.plan.fallbacks == []
    assert [e.wide_class for e in wide.plan.by_kind(Kind.BLOCK)] == ["WideDebertaAttention"] * 2
    norms = {e.wide_class for e in wide.plan.by_kind(Kind.PRIMITIVE) if e.module_class == "DebertaLayerNorm"}
    assert norms == {"WideDebertaLayerNorm"}
    for inputs in (text_batch(), text_batch(batch=1), text_batch(length=40)):  # 40 tokens: past the span
        assert max_member_error(wide, members, inputs) < TOLERANCE


@torch.no_grad()
def test_token_classification_and_returned_attentions():
    members = build("talking-heads", tf.DebertaForTokenClassification)
    wide = WideModel.from_models(members).eval()
    inputs = text_batch()
    assert max_member_error(wide, members, inputs) < TOLERANCE
    got = wide(**inputs, output_attentions=True).attentions
    for i, member in enumerate(members):
        for layer, alone in zip(got, member(**inputs, output_attentions=True).attentions):
            torch.testing.assert_close(layer[i], alone, rtol=0, atol=TOLERANCE)


def test_a_table_identical_in_every_member_is_stacked_all_the_same():
    members = build("relative")
    with torch.no_grad():
        for member in members[1:]:
            member.deberta.encoder.rel_embeddings.weight.copy_(members[0].deberta.encoder.rel_embeddings.weight)
    wide = WideModel.from_models(members).eval()
    assert wide.plan.entries["deberta.encoder.rel_embeddings"].kind == Kind.PRIMITIVE
    assert max_member_error(wide, members, text_batch()) < TOLERANCE


def test_an_unfused_consumer_falls_back_at_the_encoder():
    members = build("relative")
    frozen = members[0].deberta.encoder.layer[1].attention.self.state_dict()
    for member in members[1:]:
        member.deberta.encoder.layer[1].attention.self.load_state_dict(frozen)
    wide = WideModel.from_models(members).eval()
    assert [e.fqn for e in wide.plan.fallbacks] == ["deberta.encoder"]
    assert max_member_error(wide, members, text_batch()) < TOLERANCE


def test_members_round_trip_and_separate_query_states_are_refused():
    members = build("talking-heads")
    wide = WideModel.from_models(members).eval()
    for i in range(N):
        for (name, got), want in zip(wide.member(i).state_dict().items(), members[i].state_dict().values()):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    block = wide.model.deberta.encoder.layer[0].attention.self
    hidden = torch.randn(N, SEQ_LEN, SMALL["hidden_size"])
    with pytest.raises(NotImplementedError, match="query_states"):
        block(hidden, torch.ones(N, 1, SEQ_LEN, SEQ_LEN), query_states=hidden)
