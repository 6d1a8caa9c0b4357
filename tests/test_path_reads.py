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


def reformer():
    config = transformers.ReformerConfig(
        vocab_size=100, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=32,
        attn_layers=["local", "lsh"], axial_pos_embds_dim=[16, 16], axial_pos_shape=[4, 4], max_position_embeddings=16,
        local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2, num_hashes=1, hash_seed=7, is_decoder=True,
        hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=2)
    return transformers.ReformerModelWithLMHead(config)


def test_a_read_on_the_cache_path_is_a_read():
    # Reformer's LSH attention reads its child's query_key.weight itself when it decodes with a cache, and nowhere
    # else: planned from the sample (no cache), the child became a wide linear, and a wide generate with a cache
    # raised inside transformers (the weight, every member's, reshaped as one's)
    model = reformer().eval()
    ids = torch.randint(5, 100, (2, 8))
    reads = probe_reads(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False})
    lsh = "reformer.encoder.layers.1.attention.self_attention"
    assert lsh in reads[f"{lsh}.query_key.weight"]
    models = members(reformer)
    wide = WideModel.from_models(models)
    assert wide.plan.entries[lsh].kind in (Kind.VECTORISED, Kind.FALLBACK)  # one code reading its own tensors
    assert max_member_error(wide, models, {"input_ids": ids, "use_cache": False}) <= TOLERANCE


def test_reformer_decodes_each_members_continuation_with_its_own_rows_of_the_cache():
    # Its LSH attention, run member by member, reads its past buckets and states from Reformer's own cache (no
    # transformers Cache): each member is handed its rows of it (hf_wide.primitives.member_cache.ROW_LISTS)
    models = members(reformer)
    wide = WideModel.from_models(models)
    ids = torch.randint(5, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    out = wide.generate(input_ids=ids, max_new_tokens=6, do_sample=False, use_cache=True)
    for i, model in enumerate(models):
        assert torch.equal(out[i], model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, use_cache=True))


def test_members_that_draw_random_numbers_in_eval_mode_are_not_held_to_their_cache_path():
    # Reformer's hashing unseeded (hash_seed=None, its default) draws new random rotations at every call: a member
    # differs from itself on the decoding step, and the check of the cache path at fusion refused these members (run
    # once more alone, a member agreed with its first run by chance from this random state, once in six)
    models = members(reformer)
    for model in models:
        model.config.hash_seed = None
        for module in model.modules():
            if hasattr(module, "hash_seed"):
                module.hash_seed = None
    torch.manual_seed(2002)
    wide = WideModel.from_models(models)
    ids = torch.randint(5, 100, (2, 8))
    assert max_member_error(wide, models, {"input_ids": ids, "use_cache": False}) <= TOLERANCE
