"""Views of the one base that adapters load over (hf_wide/adapter_views.py): an adapter that writes into the base's
tensors as it loads is refused, and one that only seems to (BatchNorm's count) is not (adapters holding the base's
tensors, and what they share: test_adapters.py)."""

import pytest
import torch
from conftest import CASES
from lora_members import LLAMA, alone, save_adapter
from oracle import TOLERANCE, max_member_error

from hf_wide import IncompatibleMembersError, WideModel
from hf_wide.adapter_views import base_untouched, shared_view


@pytest.mark.parametrize("write", ["in place", "new data"])
def test_an_adapter_that_writes_into_the_shared_base_as_it_loads_is_refused(write):
    """``base_untouched`` sees a base tensor written in place and one given new data (``weight.data = ...``, as PEFT's
    PiSSA initialisation does, which no version counter sees): through a view that holds the base's tensors."""
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
    resnet = CASES["resnet-imgcls"]
    resnet.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(resnet, tmp_path / "base", tmp_path / f"a{seed}", seed, r=2 * (seed + 1),
                             target_modules=["convolution", "classifier.1"]) for seed in range(2)]
    wide = WideModel.from_pretrained(adapters)
    references = [alone(resnet, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, resnet.inputs(2, padded=False)) <= TOLERANCE
