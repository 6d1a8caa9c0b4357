"""WideDebertaV2Attention: DeBERTa-v2/v3 fuse without a per-member fallback, and every member of the
wide model equals its checkpoint run alone, over the attention's variants (shared keys, layer-normed and
bucketed relative positions, c2p or p2c alone, the conv layer, no relative attention), a table identical
in every member (stacked all the same) and returned attentions. Where a consumer of the stacked table
is not fused, the encoder falls back, as before."""

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
VARIANTS = {
    "v2": dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16),
    "v3": dict(relative_attention=True, pos_att_type="p2c|c2p", position_buckets=8, share_att_key=True,
               norm_rel_ebd="layer_norm"),
    "c2p-only": dict(relative_attention=True, pos_att_type=["c2p"], max_relative_positions=8),
    "p2c-only": dict(relative_attention=True, pos_att_type=["p2c"], position_buckets=4, max_relative_positions=16),
    "conv": dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8, conv_kernel_size=3,
                 norm_rel_ebd="layer_norm"),
    "absolute": dict(relative_attention=False, position_biased_input=True),
}


def build(variant: str, model_class=tf.DebertaV2ForSequenceClassification, seeds=range(N)):
    return members_from(model_class, tf.DebertaV2Config(**SMALL, **VARIANTS[variant]), seeds)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_fuses_and_equals_each_member(variant):
    members = build(variant)
    wide = WideModel.from_models(members).eval()
    assert wide.plan.fallbacks == []
    blocks = [e.wide_class for e in wide.plan.by_kind(Kind.BLOCK)]
    assert blocks == ["WideDebertaV2Attention"] * SMALL["num_hidden_layers"]
    for batch, padded in [(2, True), (1, False)]:
        assert max_member_error(wide, members, text_batch(batch, padded=padded)) < TOLERANCE


@pytest.mark.parametrize("variant", ["v3", "c2p-only", "p2c-only"])
def test_long_inputs_reach_the_log_buckets_and_the_clamp(variant):
    members = build(variant)  # 50 tokens: past the buckets' linear range, and past c2p-only's span of 8
    wide = WideModel.from_models(members).eval()
    assert max_member_error(wide, members, text_batch(length=50)) < TOLERANCE


def test_only_the_reached_rows_of_the_table_are_projected():
    wide = WideModel.from_models(build("c2p-only")).eval()  # no buckets, span 8: rows 8 +- (length - 1)
    block = wide.model.deberta.encoder.layer[0].attention.self
    assert block._rows_reached(3, 8) == (6, 11)
    assert block._rows_reached(50, 8) == (0, 16)
    block = WideModel.from_models(build("v3")).eval().model.deberta.encoder.layer[0].attention.self
    assert block._rows_reached(5, 8) == (4, 13)  # buckets of 8: linear up to 4, each distance its own bucket
    assert block._rows_reached(7, 8) == (2, 15)  # log-spaced past 4: 6 -> bucket 5, + 1 of margin


@pytest.mark.parametrize("variant, length", [("v3", SEQ_LEN), ("v3", 3), ("c2p-only", SEQ_LEN)])
@torch.no_grad()
def test_compiled_graphs_agree_with_eager(variant, length):
    """v3 at 7 tokens is past its buckets' linear range: the compiled graph projects the whole table."""
    members = build(variant)
    wide = WideModel.from_models(members).eval()
    inputs = text_batch(length=length)
    eager = wide(**inputs).logits
    torch._dynamo.reset()
    try:
        compiled = wide.compile(backend="eager")(**inputs).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=TOLERANCE)


def test_token_classification_and_returned_attentions():
    members = build("v3", tf.DebertaV2ForTokenClassification)
    wide = WideModel.from_models(members).eval()
    inputs = text_batch()
    assert max_member_error(wide, members, inputs) < TOLERANCE
    with torch.no_grad():
        got = wide(**inputs, output_attentions=True).attentions
        for i, member in enumerate(members):
            for layer, alone in zip(got, member(**inputs, output_attentions=True).attentions):
                torch.testing.assert_close(layer[i], alone, rtol=0, atol=TOLERANCE)


def test_a_table_identical_in_every_member_is_stacked_all_the_same():
    members = build("v3")  # the encoder's LayerNorm over the table differs between members
    with torch.no_grad():
        for member in members[1:]:
            member.deberta.encoder.rel_embeddings.weight.copy_(members[0].deberta.encoder.rel_embeddings.weight)
    wide = WideModel.from_models(members).eval()
    assert wide.plan.entries["deberta.encoder.rel_embeddings"].kind == Kind.PRIMITIVE  # not shared: read stacked
    assert wide.plan.fallbacks == []
    assert max_member_error(wide, members, text_batch()) < TOLERANCE


def test_members_that_differ_only_in_their_heads_share_the_encoder():
    members = build("v3")  # a frozen backbone: the encoder identical in every member
    for member in members[1:]:
        member.deberta.load_state_dict(members[0].deberta.state_dict())
    wide = WideModel.from_models(members).eval()
    assert wide.plan.fallbacks == [] and wide.plan.by_kind(Kind.BLOCK) == []
    assert wide.plan.entries["deberta.encoder.rel_embeddings"].kind == Kind.SHARED
    assert max_member_error(wide, members, text_batch()) < TOLERANCE


def test_a_shared_table_through_a_wide_norm_to_shared_attentions_falls_back():
    members = build("v3")  # the backbone frozen but for the norm over the relative table
    for member in members[1:]:
        member.deberta.load_state_dict(members[0].deberta.state_dict())
    with torch.no_grad():
        for seed, member in enumerate(members):
            member.deberta.encoder.LayerNorm.weight.add_(0.1 * seed)
    wide = WideModel.from_models(members).eval()
    assert [e.fqn for e in wide.plan.fallbacks] == ["deberta.encoder"]
    assert max_member_error(wide, members, text_batch()) < TOLERANCE


@torch.no_grad()
def test_the_block_takes_one_table_for_all_members():
    members = build("v2")
    block = WideModel.from_models(members).model.deberta.encoder.layer[0].attention.self
    query, key = torch.randn(2 * N * 4, SEQ_LEN, 8), torch.randn(2 * N * 4, SEQ_LEN, 8)  # (N*B*H, T, d)
    table = torch.randn(32, SMALL["hidden_size"])
    one = block.disentangled_attention_bias(query, key, None, table, 3)
    stacked = block.disentangled_attention_bias(query, key, None, table.expand(N, *table.shape), 3)
    torch.testing.assert_close(one, stacked, rtol=0, atol=0)


def test_an_unfused_consumer_falls_back_at_the_encoder():
    members = build("v2")
    with torch.no_grad():  # layer 0's attention identical in every member (a frozen layer): shared, not a block
        for member in members[1:]:
            member.deberta.encoder.layer[0].attention.self.load_state_dict(
                members[0].deberta.encoder.layer[0].attention.self.state_dict())
    wide = WideModel.from_models(members).eval()
    (entry,) = wide.plan.fallbacks
    assert entry.fqn == "deberta.encoder"
    assert "read stacked" in entry.reason and "layer.0.attention.self" in entry.reason
    assert max_member_error(wide, members, text_batch()) < TOLERANCE


def test_members_round_trip_and_save_load(tmp_path):
    members = build("v3")
    wide = WideModel.from_models(members).eval()
    for i in range(N):
        back = wide.member(i)
        for (name, got), want in zip(back.state_dict().items(), members[i].state_dict().values()):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    wide.save_pretrained(tmp_path)
    loaded = WideModel.from_pretrained(str(tmp_path)).eval()
    assert [e.wide_class for e in loaded.plan.by_kind(Kind.BLOCK)] == ["WideDebertaV2Attention"] * 2
    assert max_member_error(loaded, members, text_batch()) < TOLERANCE


@torch.no_grad()
def test_separate_query_states_equal_each_member():
    members = build("v2")
    wide = WideModel.from_models(members).eval()
    block = wide.model.deberta.encoder.layer[0].attention.self
    hidden, queries = torch.randn(2, N * 2, SEQ_LEN, SMALL["hidden_size"])  # (N*B, T, D) each, B = 2
    mask = torch.ones(N * 2, 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool)
    relative_pos = members[0].deberta.encoder.get_rel_pos(hidden[:2])
    table = wide.model.deberta.encoder.get_rel_embedding()  # (N, 2S, D)
    got, _ = block(hidden, mask, query_states=queries, relative_pos=relative_pos, rel_embeddings=table)
    for i, member in enumerate(members):
        rows = slice(2 * i, 2 * i + 2)
        alone, _ = member.deberta.encoder.layer[0].attention.self(
            hidden[rows], mask[rows], query_states=queries[rows], relative_pos=relative_pos,
            rel_embeddings=member.deberta.encoder.get_rel_embedding())
        torch.testing.assert_close(got[rows], alone, rtol=0, atol=TOLERANCE)
