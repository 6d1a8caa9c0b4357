"""The structure of adapter members (hf_wide/adapter_layers.py): PEFT's trainable tokens, alike in every member or
refused (the no-ops of differing targets and saved modules: test_adapters.py)."""

import peft
import pytest
import torch
from lora_members import LLAMA, alone
from oracle import TOLERANCE, max_member_error

from hf_wide import IncompatibleMembersError, WideModel


def save_token_adapters(folder, indices: list[list[int] | None]) -> list[str]:
    """Adapters of the base at ``folder / "base"``, LoRA on q and v, each training the tokens at its ``indices``
    (None: none), with random updates and tokens of their own."""
    LLAMA.build(0).save_pretrained(folder / "base")
    adapters = []
    for seed, tokens in enumerate(indices):
        model = peft.get_peft_model(LLAMA.model_class.from_pretrained(folder / "base"), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], trainable_token_indices=tokens,
            task_type="CAUSAL_LM"))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name or "trainable_tokens_delta" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(folder / f"a{seed}")
        adapters.append(str(folder / f"a{seed}"))
    return adapters


def inputs_with_tokens(tokens: list[int]) -> dict:
    inputs = LLAMA.inputs(2, padded=True)
    inputs["input_ids"][:, 1:1 + len(tokens)] = torch.tensor(tokens)
    return inputs


def test_adapters_with_trainable_tokens(tmp_path):
    """PEFT's ``trainable_token_indices``: each member's own rows of the (tied) embedding and output layer, run as
    each member's code, the LoRA layers fused. The inputs hold the trained tokens."""
    adapters = save_token_adapters(tmp_path, [[5, 7], [5, 7]])
    wide = WideModel.from_pretrained(adapters)
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, inputs_with_tokens([5, 7])) <= TOLERANCE
    lora = [e for e in wide.plan.entries.values() if e.wide_class == "WideLoraLinear"]
    assert len(lora) == 2 * 2  # not one fallback of the whole model (the trace names its layers by a slice)


def test_adapters_that_train_other_tokens(tmp_path):
    adapters = save_token_adapters(tmp_path, [[5, 7], [3, 9]])
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    inputs = inputs_with_tokens([3, 5, 7, 9])
    assert max_member_error(WideModel.from_pretrained(adapters), references, inputs) <= TOLERANCE


def test_adapters_that_train_different_numbers_of_tokens_are_refused_and_merge_is_the_way_out(tmp_path):
    """One trains two tokens, the other none: their embeddings differ in structure (was: "member 1 has no tensor
    '...embed_tokens.token_adapter.base_layer.weight'"). The refusal names the option; merged, each is exact."""
    adapters = save_token_adapters(tmp_path, [[5, 7], None])
    with pytest.raises(IncompatibleMembersError, match=r"member 1 trains no tokens .*trainable_token_indices.* member "
                       r"0 2 tokens of model\.embed_tokens.*merge=True"):
        WideModel.from_pretrained(adapters)
    references = [alone(LLAMA, tmp_path / "base", a) for a in adapters]
    with pytest.raises(IncompatibleMembersError, match="trainable_token_indices"):
        WideModel.from_models(references)
    wide = WideModel.from_pretrained(adapters, merge=True)
    assert max_member_error(wide, references, inputs_with_tokens([5, 7])) <= TOLERANCE


@pytest.mark.parametrize("write", ["in place", "new data"])
def test_an_adapter_that_writes_into_the_shared_base_as_it_loads_is_refused(write):
    """``base_untouched`` sees a base tensor written in place and one given new data (``weight.data = ...``, as PEFT's
    PiSSA initialisation does, which no version counter sees): through a view that holds the base's tensors."""
    from hf_wide.adapter_layers import base_untouched, shared_view

    base = LLAMA.build(0)
    view = shared_view(base)
    with pytest.raises(IncompatibleMembersError, match=r"member 1 writes into .*layers\.1\.self_attn\.q_proj\.weight"):
        with base_untouched(base, "member 1"), torch.no_grad():
            weight = view.model.layers[1].self_attn.q_proj.weight
            if write == "in place":
                weight.mul_(0.5)
            else:
                weight.data = weight.data * 0.5
    own = shared_view(base, own=lambda name: name.endswith("q_proj.weight"))
    with base_untouched(base, "member 1"):  # a copy's tensor is its own
        own.model.layers[1].self_attn.q_proj.weight.data = own.model.layers[1].self_attn.q_proj.weight.data * 0.5


def test_adapters_of_a_model_with_batch_norm(tmp_path):
    """Loading an adapter over a base with BatchNorm (ResNet) copies each norm's own ``num_batches_tracked`` into it
    (PyTorch's loading of a state dict without it), which moved its version: every such adapter was refused as
    writing into the base. Here LoRA on every convolution, at ranks that differ."""
    from conftest import CASES
    from lora_members import save_adapter

    resnet = CASES["resnet-imgcls"]
    resnet.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(resnet, tmp_path / "base", tmp_path / f"a{seed}", seed, r=2 * (seed + 1),
                             target_modules=["convolution", "classifier.1"]) for seed in range(2)]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(resnet, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, resnet.inputs(2, padded=False)) <= TOLERANCE
