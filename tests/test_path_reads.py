"""Reads on paths the sample does not take (hf_wide.path_reads): a vision model asked to interpolate its position
embeddings, and a child's tensor whose shape a module reads."""

import pytest
import torch
import transformers
from oracle import TOLERANCE, max_member_error
from torch import nn

from hf_wide import Kind, WideModel
from hf_wide.path_reads import probe_reads


def members(build, n=3):
    built = []
    for seed in range(n):
        torch.manual_seed(seed)
        model = build().eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.05)
        built.append(model)
    return built


def siglip():
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    config = transformers.SiglipConfig(vision_config=vision, text_config=text, num_labels=3)
    return transformers.SiglipForImageClassification(config)


@pytest.mark.parametrize("verify", [True, False])
def test_siglip_interpolates_each_members_position_embeddings_at_other_image_sizes(verify):
    # Its embeddings read self.position_embedding.weight to interpolate it. Planned from the sample (no interpolation)
    # the table became a wide embedding, (N, P, D): SigLIP took N for its number of positions and raised, even at
    # its own image size.
    models = members(siglip)
    wide = WideModel.from_models(models, verify=verify)
    assert wide.plan.entries["vision_model.embeddings"].kind == Kind.VECTORISED
    for size in (32, 48, 64):
        inputs = {"pixel_values": torch.randn(2, 3, size, size), "interpolate_pos_encoding": True}
        assert max_member_error(wide, models, inputs) <= TOLERANCE


def test_a_dtype_read_is_no_read():
    # ViT's model reads its patch projection's weight.dtype: every member's answers the same, and its blocks stay.
    config = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    image_size=32, patch_size=8, num_labels=3)
    models = members(lambda: transformers.ViTForImageClassification(config))
    wide = WideModel.from_models(models)
    assert not wide.plan.fallbacks and wide.plan.by_kind(Kind.BLOCK)
    inputs = {"pixel_values": torch.randn(2, 3, 48, 48), "interpolate_pos_encoding": True}
    assert max_member_error(wide, models, inputs) <= TOLERANCE


class Clipped(nn.Module):
    """Reads its table's length (a shape, which no exported op shows) to clip the positions."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(6, 4)

    def forward(self, x):  # (B, T, 4)
        positions = torch.arange(x.shape[1]).clamp(max=self.table.weight.shape[0] - 1).expand(x.shape[0], -1)
        return x + self.table(positions)  # (B, T): the rows


def test_a_modules_read_of_its_childs_shape_is_a_read():
    model = Clipped()
    assert probe_reads(model, (torch.randn(2, 9, 4),), {}) == {"table.weight": {"", "table"}}
    models = members(Clipped)
    wide = WideModel.from_models(models, (torch.randn(2, 9, 4),), verify=False)
    assert "table" not in wide.plan.entries or wide.plan.entries["table"].kind != Kind.PRIMITIVE
    x = torch.randn(3, 8, 4)
    with torch.no_grad():
        assert max((wide(x)[i] - m(x)).abs().max().item() for i, m in enumerate(models)) <= TOLERANCE
