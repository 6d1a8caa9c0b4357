"""Fusion (:mod:`hf_wide.fuse`, :mod:`hf_wide.forward_state`) leaves the members as they were given, even where their
forward updates a buffer or a setting, and builds the wide model from them as given; a forward that swaps a module or
changes a parameter in place is refused."""

import pytest
import torch
import transformers as tf
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


def seeded(make, n: int = 2) -> list[nn.Module]:
    """``n`` models in eval mode, each made after seeding torch with its index."""
    models = []
    for seed in range(n):
        torch.manual_seed(seed)
        models.append(make().eval())
    return models


def members(add_count: bool) -> list[Counted]:
    return seeded(lambda: Counted(add_count), 3)


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


def test_a_setting_the_samples_forward_changes_is_put_back():
    """Swin sets a layer's shift to 0 for good on an image no bigger than its window (the sample's, at the config's
    size): the wide model (and the members given) then ran without the shift at 64x64, 6.9e-3 off checkpoints
    never run."""
    config = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4,
                           num_labels=3)

    models = seeded(lambda: tf.SwinForImageClassification(config))
    wide = WideModel.from_models(models)
    never_run = seeded(lambda: tf.SwinForImageClassification(config))
    shifts = [layer.shift_size for layer in models[0].swin.encoder.layers[1].blocks]
    assert shifts == [layer.shift_size for layer in never_run[0].swin.encoder.layers[1].blocks]  # as given: [0, 2]
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out = wide(pixel_values=images).logits
        for i, model in enumerate(never_run):
            assert (out[i] - model(pixel_values=images).logits).abs().max() <= 1e-5


def test_a_module_the_samples_forward_swaps_is_refused_and_put_back(tmp_path):
    """BigBird switches itself to full attention for good on a sequence shorter than its block-sparse minimum (the
    built sample's 8 tokens): the plan followed full attention, and block-sparse checkpoints were 4.9e-3 off at 400
    tokens."""
    config = tf.BigBirdConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=128, attention_type="block_sparse",
                              block_size=4, num_random_blocks=2, num_labels=3)
    models = seeded(lambda: tf.BigBirdForSequenceClassification(config))
    with pytest.raises(WideValidationError, match=r"swapped its module .*attention.self.*'original_full'"):
        WideModel.from_models(models)
    assert {type(m.bert.encoder.layer[0].attention.self).__name__ for m in models} == {"BigBirdBlockSparseAttention"}
    assert {m.bert.attention_type for m in models} == {"block_sparse"}
    for i, model in enumerate(models):  # loaded from checkpoints (hf_wide.loading: member 0 traced alone)
        model.save_pretrained(tmp_path / f"m{i}")
    with pytest.raises(WideValidationError, match=r"member 0 .* swapped its module"):
        WideModel.from_pretrained([str(tmp_path / "m0"), str(tmp_path / "m1")])


def test_a_parameter_the_forward_changes_in_place_is_refused():
    """RWKV rescales its layers' weights in place in eval mode: member(i) and a saved repo held the rescaled weights
    (0.26-0.42 off the checkpoint's), and in training members past the first were 0.4 off."""
    config = tf.RwkvConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                           intermediate_size=64, rescale_every=1, context_length=64)
    models = seeded(lambda: tf.RwkvForCausalLM(config))
    with pytest.raises(WideValidationError, match=r"changes its parameter .* in place .*rescale_every=0"):
        WideModel.from_models(models)
