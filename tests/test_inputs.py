"""hf_wide/inputs.py: the user's inputs folded into the members' rows, whatever the order of the keyword arguments, and
what is no batch left whole."""

import pytest
import torch
import transformers
from conftest import CASES
from families import members_from
from oracle import TOLERANCE

from hf_wide import PerMember, WideModel


def test_the_batch_is_the_main_inputs_whatever_comes_first(fused):
    # position_ids (1, T) given before input_ids made B 1: input_ids' rows were read as one row per member (member i
    # ran on row i alone, silently, where B == N), or raised elsewhere
    members, wide = fused("bert-seqcls")
    ids = CASES["bert-seqcls"].inputs(len(members), padded=False)["input_ids"]
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        got = wide(position_ids=positions, input_ids=ids).logits
        for i, member in enumerate(members):
            assert (got[i] - member(input_ids=ids, position_ids=positions).logits).abs().max() <= TOLERANCE


def test_the_positions_to_keep_logits_of_are_no_batch(fused):
    # a logits_to_keep of B indices was repeated N times, as the batch
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=True)
    keep = torch.tensor([0, 3])
    with torch.no_grad():
        got = wide(**inputs, logits_to_keep=keep).logits
        for i, member in enumerate(members):
            want = member(**inputs, logits_to_keep=keep).logits
            assert got[i].shape == want.shape and (got[i] - want).abs().max() <= TOLERANCE


def test_the_number_of_items_is_no_batch(fused):
    # one count in a tensor of one element, beside a batch of one, was repeated N times as the batch and refused
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(1, padded=False)
    count = torch.tensor([5])
    with torch.no_grad():
        got = wide(**inputs, labels=inputs["input_ids"], num_items_in_batch=count).loss
        for i, member in enumerate(members):
            want = member(**inputs, labels=inputs["input_ids"], num_items_in_batch=count).loss
            assert (got[i] - want).abs() <= TOLERANCE


@pytest.mark.parametrize("length", [5, 2])  # 2: as long as the batch, which read as its rows
def test_one_segment_id_per_position_is_every_rows(fused, length):
    # BERT broadcasts a 1-D token_type_ids (T,) over its rows; the wide model read its T positions as rows and
    # raised a reshape error (or a broadcast error where T == B)
    members, wide = fused("bert-seqcls")
    ids = CASES["bert-seqcls"].inputs(len(members), padded=False)["input_ids"][:2, :length]
    types = (torch.arange(length) >= length // 2).long()
    with torch.no_grad():
        got = wide(input_ids=ids, token_type_ids=types).logits
        for i, member in enumerate(members):
            want = member(input_ids=ids, token_type_ids=types).logits
            assert got[i].shape == want.shape and (got[i] - want).abs().max() <= TOLERANCE
            assert (want - member(input_ids=ids).logits).abs().max() > 1e-4  # the segment ids count


def clip_members() -> list:
    """Three CLIP members whose every tensor differs (their logit_scale too): the wide model runs each whole."""
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                     "intermediate_size": 64, "max_position_embeddings": 16, "eos_token_id": 2},
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64,
                       "image_size": 16, "patch_size": 8}, projection_dim=16)
    return members_from(transformers.CLIPModel, config, range(3))


def test_a_batch_of_its_own_that_reads_as_the_folded_rows_is_refused():
    # CLIP members whose logit_scale differs run whole, per member: one text beside N images, the images (N rows,
    # the N*B folded rows) were split among the members, each scoring one image, silently
    members = clip_members()
    wide = WideModel.from_models(members)
    ids = torch.tensor([[5, 6, 7, 2]])
    with torch.no_grad():
        images = torch.randn(4, 3, 16, 16)  # not N*B: every member sees all four, as alone
        got = wide(input_ids=ids, pixel_values=images).logits_per_text
        for i, member in enumerate(members):
            want = member(input_ids=ids, pixel_values=images).logits_per_text
            assert (got[i] - want).abs().max() <= TOLERANCE
        with pytest.raises(ValueError, match="pixel_values holds 3 rows beside a batch of 1"):
            wide(input_ids=ids, pixel_values=torch.randn(3, 3, 16, 16))


def test_a_whole_model_run_per_member_takes_another_modalitys_batch_whole_at_any_length():
    # Images as many as the texts were folded (N*B) and others not: the model, run whole per member, learnt from a
    # first call of 2 images beside 1 text that they are no rows, and then ran every member on all N copies of 1
    # image (0.97 off, image_embeds (9, 16) for (3, 1, 16)), silently
    members = clip_members()
    wide = WideModel.from_models(members)
    with torch.no_grad():
        for texts, images in [(1, 2), (1, 1), (4, 2), (2, 2)]:
            inputs = {"input_ids": torch.randint(5, 100, (texts, 4)), "pixel_values": torch.randn(images, 3, 16, 16)}
            got = wide(**inputs)
            for i, member in enumerate(members):
                want = member(**inputs)
                for key in ("image_embeds", "text_embeds", "logits_per_image"):
                    assert got[key][i].shape == want[key].shape, (texts, images, key)
                    assert (got[key][i] - want[key]).abs().max() <= TOLERANCE, (texts, images, key)
    # each member's own images: they reached the members' code as a PerMember ("has no attribute 'shape'")
    own = PerMember(torch.randn(len(members), 2, 3, 16, 16))
    with pytest.raises(ValueError, match=r"pixel_values gives each member its own beside input_ids, and this model "
                                         r"runs whole.*give one pixel_values to all"):
        wide(input_ids=torch.randint(5, 100, (2, 4)), pixel_values=own)


def test_encoder_outputs_given_by_the_user_are_folded_as_inputs():
    # (B, T, D) encoder states every member reads, or each member's own as PerMember((N, B, T, D)): were passed
    # unfolded, and raised
    from transformers.modeling_outputs import BaseModelOutput

    from hf_wide import PerMember

    config = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2)
    members = members_from(transformers.BartForConditionalGeneration, config, range(3))
    wide = WideModel.from_models(members)
    ids, decoder_ids = torch.randint(3, 100, (2, 5)), torch.randint(3, 100, (2, 4))
    states = torch.randn(2, 5, 32)
    with torch.no_grad():
        for given in ((states,), BaseModelOutput(last_hidden_state=states)):
            got = wide(encoder_outputs=given, decoder_input_ids=decoder_ids).logits
            for i, member in enumerate(members):
                want = member(encoder_outputs=(states,), decoder_input_ids=decoder_ids).logits
                assert (got[i] - want).abs().max() <= TOLERANCE
        full = wide(input_ids=ids, decoder_input_ids=decoder_ids)
        again = wide(encoder_outputs=(PerMember(full.encoder_last_hidden_state),), decoder_input_ids=decoder_ids)
        assert (again.logits - full.logits).abs().max() <= TOLERANCE
    # generate given the encoder states alone: their rows are the batch (it raised, finding no batched input)
    settings = dict(max_new_tokens=4, do_sample=False)
    out = wide.generate(encoder_outputs=BaseModelOutput(last_hidden_state=states), **settings)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(encoder_outputs=BaseModelOutput(last_hidden_state=states),
                                                   **settings))


def test_a_per_member_input_of_another_batch_is_named_with_the_batch_it_misses():
    from hf_wide import PerMember
    from hf_wide.inputs import fold_inputs

    ids, images = torch.zeros(2, 5, dtype=torch.long), PerMember(torch.zeros(3, 4, 3, 8, 8))  # 4 images, 2 texts
    with pytest.raises(ValueError, match="pixel_values gives each member 4 rows, but the batch of input_ids has 2"):
        fold_inputs(3, (), {"input_ids": ids, "pixel_values": images})
    with pytest.raises(ValueError, match="argument 1 gives each member 4 rows, but the batch of argument 0 has 2"):
        fold_inputs(3, (ids, images), {})


def test_a_cache_of_other_rows_than_the_members_is_refused_and_a_wide_ones_continues(fused):
    # A member's own cache (B rows) failed deep in the attention: "Sizes of tensors must match except in dimension 2"
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=False)
    ids = inputs["input_ids"]
    with torch.no_grad():
        own = members[0](input_ids=ids[:, :-1], use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"past_key_values holds a cache of 2 rows, and the wide model's 3 members"):
            wide(input_ids=ids[:, -1:], past_key_values=own)
        with pytest.raises(ValueError, match="a cache of 2 rows"):
            wide.generate(input_ids=ids, past_key_values=own, max_new_tokens=2, do_sample=False, pad_token_id=0)
        cache = wide(input_ids=ids[:, :-1], use_cache=True).past_key_values  # the wide model's: N*B rows
        got = wide(input_ids=ids[:, -1:], past_key_values=cache).logits
        for i, member in enumerate(members):
            want = member(input_ids=ids).logits[:, -1:]
            assert (got[i] - want).abs().max() <= TOLERANCE
