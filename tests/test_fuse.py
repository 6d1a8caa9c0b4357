"""Fusion (:mod:`hf_wide.fuse`) leaves the members as they were given, even where their forward updates a buffer, and
builds the wide model from them as given."""

import pytest
import torch
from torch import nn

from hf_wide import WideModel, WideValidationError


class Counted(nn.Module):
    """A linear that counts the rows it has seen in a buffer; ``add_count`` puts the count into its output."""

    def __init__(self, add_count: bool):
        super().__init__()
        self.linear, self.add_count = nn.Linear(4, 4), add_count
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):  # x: (B, 4)
        self.seen += x.shape[0]
        return self.linear(x) + (self.seen if self.add_count else 0)


def members(add_count: bool) -> list[Counted]:
    out = []
    for seed in range(3):
        torch.manual_seed(seed)
        out.append(Counted(add_count))
    return out


def test_a_buffer_the_forward_updates_is_left_as_given():
    """Fusion runs the members and the wide model on the sample (trace, records, checks, ``validate``): the members'
    counts came back at 4 to 6 where they were 0, and the wide model's at what its checks had left."""
    models = members(add_count=False)
    wide = WideModel.from_models(models, torch.randn(2, 4), validate=True)
    assert [m.seen.item() for m in models] == [0.0] * 3
    assert [wide.member(i).seen.item() for i in range(3)] == [0.0] * 3
    x = torch.randn(5, 4)
    with torch.no_grad():
        out = wide(x)
        for i, model in enumerate(models):
            torch.testing.assert_close(out[i], model(x), rtol=0, atol=1e-6)
    assert [wide.member(i).seen.item() for i in range(3)] == [model.seen.item() for model in models] == [5.0] * 3


def test_a_refused_fusion_leaves_a_forward_updated_buffer_as_given():
    models = members(add_count=True)
    with pytest.raises(WideValidationError):  # a count in the output: the wide forward's is not each member's
        WideModel.from_models(models, torch.randn(2, 4))
    assert [m.seen.item() for m in models] == [0.0] * 3
