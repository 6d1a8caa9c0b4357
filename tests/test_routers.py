"""A wide mixture of experts asked for router logits (``output_router_logits``): each member's router logits,
load-balancing loss and loss with labels equal checkpoint i's alone; routers that run inside a module run per
member are refused, not left out of the loss."""

import contextlib
import io
import sys

import pytest
import torch
import transformers as tf

from hf_wide import WideModel
from hf_wide.routers import MemberBalancingLoss

NUM_MEMBERS = 3
DECODER = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 64, "pad_token_id": 0}
MOES = {
    "qwen2_moe": lambda flag: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        output_router_logits=flag)),
    "mixtral": lambda flag: tf.MixtralForCausalLM(tf.MixtralConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2, output_router_logits=flag)),
    # its router and experts found by transformers' experts implementation, not by name (hf_wide.primitives.fallback)
    "granitemoe": lambda flag: tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2, output_router_logits=flag)),
}


def members(name: str, flag: bool = False) -> list[torch.nn.Module]:
    built = []
    for seed in range(NUM_MEMBERS):
        torch.manual_seed(seed)
        built.append(MOES[name](flag).eval())
    return built


def fuse(models) -> WideModel:
    with contextlib.redirect_stdout(io.StringIO()):
        return WideModel.from_models(models)


def batch() -> dict:
    torch.manual_seed(1)
    ids = torch.randint(5, 64, (2, 9))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # left padding: the balancing loss counts only the tokens the mask keeps
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", sorted(MOES))
def test_each_members_router_logits_and_balancing_loss(name):
    models = members(name)
    wide = fuse(models)
    inputs = batch()
    with torch.no_grad():
        for extra in ({}, {"labels": inputs["input_ids"]}):
            got = wide(**inputs, **extra, output_router_logits=True)
            assert got.aux_loss.shape == (NUM_MEMBERS,)
            for i, model in enumerate(models):
                want = model(**inputs, **extra, output_router_logits=True)
                torch.testing.assert_close(got.aux_loss[i], want.aux_loss, atol=1e-6, rtol=0)
                assert len(got.router_logits) == len(want.router_logits) == 2
                for wide_layer, layer in zip(got.router_logits, want.router_logits):  # (N, B*T, E) and (B*T, E)
                    torch.testing.assert_close(wide_layer[i], layer, atol=1e-5, rtol=0)
                if extra:  # the cross-entropy plus the router's coefficient times the member's own balancing loss
                    torch.testing.assert_close(got.loss[i], want.loss, atol=1e-5, rtol=0)


def test_a_config_that_asks_for_them_and_the_function_outside_a_wide_forward():
    models = members("qwen2_moe", flag=True)
    wide = fuse(models)
    inputs = batch()
    with torch.no_grad():
        got = wide(**inputs)
        module = sys.modules[type(models[0]).__module__]
        assert isinstance(module.load_balancing_loss_func, MemberBalancingLoss)  # replaced once a wide forward asked
        for i, model in enumerate(models):  # outside a wide forward: transformers' own, one number per model
            want = model(**inputs).aux_loss
            assert want.dim() == 0
            torch.testing.assert_close(got.aux_loss[i], want, atol=1e-6, rtol=0)
            torch.testing.assert_close(wide.member(i)(**inputs).aux_loss, want, atol=1e-6, rtol=0)
        assert wide(**inputs, output_router_logits=False).aux_loss is None


def test_routers_inside_a_module_run_per_member_are_refused():
    models = members("granitemoe")
    moe = "model.layers.0.block_sparse_moe"
    for model in models:  # a hook of each member's own: the block runs as each member's own code, its router inside
        model.get_submodule(moe).register_forward_hook(lambda module, args, output: output)
    wide = fuse(models)
    assert wide.plan.entries[moe].kind.value in ("vectorised", "fallback")  # its router runs inside it
    with torch.no_grad(), pytest.raises(ValueError, match=rf"router_logits .*{moe}\.router .*inside {moe}"):
        wide(**batch(), output_router_logits=True)
    assert wide(**batch()).logits.shape[:2] == (NUM_MEMBERS, 2)
