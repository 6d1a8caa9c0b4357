"""Rewrites (hf_wide.rewrites): MPNet's encoder computes each member's position bias from its stacked table,
and everything else in it runs as wide primitives."""

import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

from hf_wide import Kind, WideModel
from hf_wide.rewrites import WideMPNetEncoder

MPNET = CASES["mpnet-seqcls"]


def test_mpnet_encoder_is_rewritten_not_vectorised():
    members = [MPNET.build(seed) for seed in range(3)]
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, MPNET.inputs(3, padded=True)) <= TOLERANCE
    entry = wide.plan.entries["mpnet.encoder"]
    assert entry.kind == Kind.REWRITTEN and entry.wide_class == "WideMPNetEncoder"
    assert wide.plan.entries["mpnet.encoder.relative_attention_bias"].kind == Kind.PRIMITIVE
    assert not wide.plan.fallbacks
    assert type(wide.model.mpnet.encoder) is WideMPNetEncoder
    assert type(wide.member(1).mpnet.encoder) is MPNetEncoder  # a member runs the source's own code
    for i, member in enumerate(members):
        got = wide.member(i).state_dict()
        assert all(torch.equal(got[k], v) for k, v in member.state_dict().items())


def test_a_shared_bias_table_serves_every_member():
    members = [MPNET.build(seed) for seed in range(3)]
    table = members[0].mpnet.encoder.relative_attention_bias.weight
    for member in members[1:]:
        member.mpnet.encoder.relative_attention_bias.weight.data.copy_(table)
    wide = WideModel.from_models(members)
    assert wide.plan.entries["mpnet.encoder.relative_attention_bias"].kind == Kind.SHARED
    assert wide.plan.entries["mpnet.encoder"].kind == Kind.REWRITTEN
    assert max_member_error(wide, members, MPNET.inputs(2, padded=True)) <= TOLERANCE


def test_a_table_that_cannot_be_stacked_leaves_the_encoder_vectorised():
    # A forward hook on one member's table: it runs as each member's own code, so the rewrite, which reads the
    # stacked weight, must not be used.
    members = [MPNET.build(seed) for seed in range(3)]
    members[1].mpnet.encoder.relative_attention_bias.register_forward_hook(lambda m, a, out: out * 2)
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, MPNET.inputs(2, padded=True)) <= TOLERANCE
    assert wide.plan.entries["mpnet.encoder"].kind in (Kind.VECTORISED, Kind.FALLBACK)
    assert "WideMPNetEncoder needs" in wide.plan.entries["mpnet.encoder"].reason
