"""hf_wide/configs.py: a wide model's modules read the wide model's own config objects, as transformers' modules
read their model's: set_attn_implementation switches every attention, fused, vectorised or run per member."""

import pytest
import torch
import transformers
from conftest import CASES, NUM_MEMBERS
from families import fall_back_attention_, with_gain
from oracle import TOLERANCE
from transformers.models.llama.modeling_llama import LlamaAttention

from hf_wide import Kind, WideModel
from hf_wide.configs import config_tree, module_configs

CASE = CASES["llama-causallm"]


def members_with(attention: Kind) -> list:
    """Llama members whose first attention the plan makes ``attention``."""
    members = [CASE.build(seed) for seed in range(NUM_MEMBERS)]
    if attention == Kind.FALLBACK:  # a class of its own in each member: each member's own code
        fall_back_attention_(members, 0, LlamaAttention)
    elif attention == Kind.VECTORISED:  # one class no block knows: vectorised
        gained = with_gain(LlamaAttention)
        for i, member in enumerate(members):
            layer = member.model.layers[0]
            layer.self_attn, old = gained(member.config, 0), layer.self_attn
            layer.self_attn.load_state_dict(old.state_dict(), strict=False)
            layer.self_attn.gain.data.fill_(1.0 + 0.1 * i)
    return members


def reads_only(model, config) -> bool:
    tree = [id(c) for c in config_tree(config).values()]
    return all(id(c) in tree for c in module_configs(model))


def attentions(model, inputs) -> tuple:
    with torch.no_grad():
        return model(**inputs, output_attentions=True).attentions


@pytest.mark.parametrize("attention", [Kind.BLOCK, Kind.VECTORISED, Kind.FALLBACK])
def test_set_attn_implementation_reaches_every_attention(attention):
    members = members_with(attention)
    wide = WideModel.from_models(members)
    assert wide.plan.entries["model.layers.0.self_attn"].kind == attention
    assert reads_only(wide.model, wide.model.config)
    assert not any(c is m.config for m in members for c in module_configs(wide.model))  # not the user's objects
    inputs = CASE.inputs(2, padded=True)
    assert attentions(wide, inputs) == attentions(members[0], inputs) == ()  # sdpa returns none, as transformers

    wide.model.set_attn_implementation("eager")
    got = attentions(wide, inputs)
    assert len(got) == 2
    for i, member in enumerate(members):
        member.set_attn_implementation("eager")
        for layer, want in zip(got, attentions(member, inputs)):  # (N, B, H, T, T), member i's (B, H, T, T)
            assert (layer[i] - want).abs().max().item() <= TOLERANCE

    members[0].set_attn_implementation("sdpa")  # the members are the user's: the wide model does not follow them
    assert len(attentions(wide, inputs)) == 2


@pytest.mark.parametrize("attention", [Kind.BLOCK, Kind.FALLBACK])
def test_a_member_taken_out_reads_its_own_config(attention):
    wide = WideModel.from_models(members_with(attention))
    member = wide.member(1)
    assert reads_only(member, member.config) and member.config is not wide.model.config
    inputs = CASE.inputs(2, padded=True)
    member.set_attn_implementation("eager")
    assert len(attentions(member, inputs)) == 2
    assert attentions(wide, inputs) == ()  # the wide model is left as it was


def tiny_clip(seed: int) -> transformers.CLIPModel:
    torch.manual_seed(seed)
    tower = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(vocab_size=99, max_position_embeddings=16, **tower),
        vision_config=dict(image_size=16, patch_size=8, **tower), projection_dim=16)).eval()


@pytest.mark.parametrize("build", [CASE.build, tiny_clip], ids=["llama", "clip"])
def test_a_member_taken_out_runs_the_attention_the_wide_model_was_switched_to(build):
    # member(i) read its config as loaded: after wide.model.set_attn_implementation("eager") it still ran sdpa
    wide = WideModel.from_models([build(seed) for seed in range(2)])
    wide.model.set_attn_implementation("eager")
    member = wide.member(1)
    want = {path: c._attn_implementation for path, c in config_tree(wide.model.config).items()}
    assert {path: c._attn_implementation for path, c in config_tree(member.config).items()} == want
    assert set(want.values()) == {"eager"}
    assert reads_only(member, member.config)
