"""WideViTEmbeddings: every path of ViTEmbeddings (plain, masked patches, interpolated positions) equals
each member's own embeddings, and wrong inputs get the source's errors."""

import pytest
import torch
import transformers
from transformers.models.vit.modeling_vit import ViTEmbeddings

from hf_wide.blocks import WideViTEmbeddings
from hf_wide.fold import Fold

N, B = 3, 2
CONFIG = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32)


@pytest.fixture(scope="module")
def members():
    mods = []
    for seed in range(N):
        torch.manual_seed(seed)
        mods.append(ViTEmbeddings(CONFIG, use_mask_token=True).eval())
        torch.nn.init.normal_(mods[-1].mask_token)  # zeros by default: make masking visible
    return mods


def run_wide(block, pixels, **kwargs):
    block.fold.anchor = pixels.new_empty(N * pixels.shape[0], 0)
    try:
        folded = {k: torch.cat([v] * N) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return block(torch.cat([pixels] * N), **folded).view(N, pixels.shape[0], *block_shape(block, pixels))
    finally:
        block.fold.reset()


def block_shape(block, pixels):
    patches = (pixels.shape[2] // CONFIG.patch_size) * (pixels.shape[3] // CONFIG.patch_size)
    return patches + 1, CONFIG.hidden_size


@pytest.mark.parametrize("size, options", [
    (16, {}),
    (16, {"bool_masked_pos": "random"}),
    (24, {"interpolate_pos_encoding": True}),
    (16, {"interpolate_pos_encoding": True}),  # same size: the positions as they are
])
@torch.no_grad()
def test_every_path_equals_each_member(members, size, options):
    block = WideViTEmbeddings.from_modules(members, Fold(N)).eval()
    pixels = torch.randn(B, 3, size, size)
    if options.get("bool_masked_pos") == "random":
        options = {"bool_masked_pos": torch.rand(B, (size // CONFIG.patch_size) ** 2) > 0.5}
    wide = run_wide(block, pixels, **options)
    for i, member in enumerate(members):
        torch.testing.assert_close(wide[i], member(pixels, **options), rtol=0, atol=1e-6)


def test_member_state_round_trips_and_errors_match_the_source(members):
    block = WideViTEmbeddings.from_modules(members, Fold(N))
    for i, member in enumerate(members):
        back = block.to_module(i)
        assert type(back) is ViTEmbeddings
        for key, value in member.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), key
    with pytest.raises(ValueError, match="doesn't match model"):
        run_wide(block, torch.randn(1, 3, 20, 20))
    with pytest.raises(ValueError, match="channel dimension"):
        run_wide(block, torch.randn(1, 1, 16, 16))
