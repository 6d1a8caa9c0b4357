"""Rewrites (hf_wide.rewrites): MPNet's encoder computes each member's position bias from its stacked table, and
CLIP's model (SigLIP's) scores each member's texts against its own images; everything else in them runs as planned
(wide primitives, fused blocks)."""

import pytest
import torch
from conftest import CASES
from contrastive_pairs import PAIRS, adapter_alone, pair, pair_adapters, pair_error, texts_and_images
from oracle import TOLERANCE, max_member_error
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

from hf_wide import Kind, WideModel
from hf_wide.rewrites import WideCLIPModel, WideMPNetEncoder

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


@pytest.mark.parametrize("name, verify", [("clip", True), ("clip", False), ("siglip", True)])
def test_adapters_of_a_contrastive_pair_score_each_members_texts_against_its_own_images(name, verify, tmp_path):
    """CLIP's forward (and SigLIP's) multiplies its texts by its images: LoRA members of one base ran vectorised
    whole, the base's towers stacked N times and run per member (and SigLIP's, whose adapters' ranks differ, in a
    loop that failed on images as many as the texts). Rewritten, the towers are fused over the one base, each
    member's texts scored against its own images; texts and images in numbers of their own, each member's loss."""
    model_class, _, rewrite = PAIRS[name]
    adapters = pair_adapters(name, tmp_path, (2, 4, 4))
    wide = WideModel.from_pretrained(adapters, verify=verify)
    entry = wide.plan.entries["base_model.model"]
    assert entry.kind == Kind.REWRITTEN and entry.wide_class == rewrite.__name__ and "mixes batch rows" in entry.reason
    assert not wide.plan.fallbacks and wide.plan.by_kind(Kind.BLOCK)
    base = sum(p.numel() for p in pair(name, 0).parameters())
    assert sum(p.numel() for p in wide.parameters()) < 1.5 * base  # the base once (vectorised: 3x)
    references = [adapter_alone(name, tmp_path, a) for a in adapters]
    for texts, images in ((2, 2), (3, 2), (2, 1)):
        assert pair_error(wide, references, texts_and_images(texts, images)) <= TOLERANCE
    square = {**texts_and_images(2, 2), "return_loss": True}
    assert pair_error(wide, references, square, ("loss",)) <= TOLERANCE  # each member's, (N,)
    member = wide.member(1)
    assert type(member.base_model.model) is model_class and "fold" not in vars(member.base_model.model)
    assert pair_error(wide, references, texts_and_images(3, 2)) <= TOLERANCE


def test_clip_checkpoints_with_one_logit_scale_are_rewritten_and_round_trip(tmp_path):
    """Full checkpoints that keep one ``logit_scale`` (the rewrite reads the model's own tensor shared); their towers
    hold wide modules that split members and expand broadcasts by the rows of the tower's own input (the images,
    B' of them beside B texts), and the image tower's hidden states come back per member as its outputs do (they
    came back folded, (N*B', ...)). Where the members' logit scales differ, the model runs vectorised whole still."""
    members = [pair("clip", seed) for seed in range(3)]
    for member in members[1:]:
        member.logit_scale.data.copy_(members[0].logit_scale.data)
    wide = WideModel.from_models(members)
    assert wide.plan.entries[""].kind == Kind.REWRITTEN and type(wide.model) is WideCLIPModel
    assert wide.plan.by_kind(Kind.PRIMITIVE)
    for texts, images in ((3, 2), (1, 3), (2, 1)):  # (1, 3): as many images as the folded texts
        assert pair_error(wide, members, texts_and_images(texts, images)) <= TOLERANCE
    hidden = {**texts_and_images(3, 2), "output_hidden_states": True}  # each tower's layers, (N, B or B', ...)
    with torch.no_grad():
        got, wanted = wide(**hidden), [member(**hidden) for member in members]
    for tower in ("text_model_output", "vision_model_output"):
        for layer, states in enumerate(got[tower].hidden_states):
            assert states.shape == (3, *wanted[0][tower].hidden_states[layer].shape)
            assert max((states[i] - want[tower].hidden_states[layer]).abs().max().item()
                       for i, want in enumerate(wanted)) <= TOLERANCE
    wide.save_pretrained(tmp_path / "fused")
    back = WideModel.from_pretrained(str(tmp_path / "fused"))
    assert back.plan.entries[""].kind == Kind.REWRITTEN
    assert pair_error(back, members, texts_and_images(3, 2)) <= TOLERANCE
    with torch.no_grad():
        members[2].logit_scale.add_(0.5)
    apart = WideModel.from_models(members)
    assert [(e.fqn, e.kind) for e in apart.plan.fallbacks] == [("", Kind.VECTORISED)]
    assert pair_error(apart, members, texts_and_images(3, 2)) <= TOLERANCE


def _features_error(wide, references, inputs: dict) -> float:
    """The largest difference of any member's text and image features (``get_text_features``,
    ``get_image_features``: their projected ``pooler_output`` and their tower's last hidden state) from its own."""
    texts, images = {"input_ids": inputs["input_ids"]}, {"pixel_values": inputs["pixel_values"]}
    errors = []
    with torch.no_grad():
        for method, given in (("get_text_features", texts), ("get_image_features", images)):
            got = getattr(wide, method)(**given)
            for i, reference in enumerate(references):
                want = getattr(reference, method)(**given)
                for key in ("pooler_output", "last_hidden_state"):
                    assert got[key].shape == (len(references), *want[key].shape), (method, key)
                    errors.append((got[key][i] - want[key]).abs().max().item())
    return max(errors)


def test_text_and_image_features_are_each_members(tmp_path):
    """``wide.get_text_features`` and ``wide.get_image_features`` (what retrieval calls, outside the forward): each
    member's, ``(N, B, ...)``, over adapters of one base, full checkpoints rewritten, and a model run vectorised
    whole (its methods per member); a model without them has none."""
    adapters = pair_adapters("clip", tmp_path, (2, 4))
    inputs = texts_and_images(3, 2)
    assert _features_error(WideModel.from_pretrained(adapters), [adapter_alone("clip", tmp_path, a) for a in adapters],
                           inputs) <= TOLERANCE
    members = [pair("clip", seed) for seed in range(3)]
    for member in members[1:]:
        member.logit_scale.data.copy_(members[0].logit_scale.data)
    rewritten = WideModel.from_models(members)
    assert type(rewritten.model) is WideCLIPModel
    assert _features_error(rewritten, members, inputs) <= TOLERANCE
    with torch.no_grad():
        members[2].logit_scale.add_(0.5)
    apart = WideModel.from_models(members)
    assert [(e.fqn, e.kind) for e in apart.plan.fallbacks] == [("", Kind.VECTORISED)]
    assert _features_error(apart, members, inputs) <= TOLERANCE
    bert = WideModel.from_models([CASES["bert-seqcls"].build(seed) for seed in range(2)])
    assert not hasattr(bert, "get_text_features") and not hasattr(bert, "get_anything_else")
