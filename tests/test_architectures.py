"""The central oracle over a wider sweep of transformers architectures than the family table: three members
with different random weights, one forward (and greedy generation for decoders), member i against checkpoint i.

Each architecture is tiny and tested once (CLIP, Wav2Vec2, Whisper and Swin with the inputs they take); the family table (``families.py``) tests its families in depth. Most of
these run partly per member (fallbacks); what matters here is that none is silently wrong.
"""

import contextlib
import io

import pytest
import torch
import transformers as tf
from families import randomise_

from hf_wide import WideModel
from hf_wide.verify_cache import cache_name

V = 100
TEXT = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 64}
DECODER = {**TEXT, "num_key_value_heads": 2, "pad_token_id": 0}

DECODERS = {
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**DECODER, head_dim=8)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**DECODER, head_dim=8, sliding_window=4)),
    "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(**TEXT, pad_token_id=0)),
    "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**DECODER)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**TEXT, pad_token_id=0)),
    "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                     n_positions=64, pad_token_id=0)),
    "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                                        pad_token_id=0)),
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, pad_token_id=0)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**DECODER)),
    "olmoe": lambda: tf.OlmoeForCausalLM(tf.OlmoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2)),
    "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**DECODER)),
    "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**DECODER)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                                                  word_embed_proj_dim=32, pad_token_id=1)),
    # State-space and hybrid decoders: their mixers run member by member on the cache's conv and recurrent states
    "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(vocab_size=V, hidden_size=32, state_size=4,
                                                        num_hidden_layers=2, pad_token_id=0)),
    "mamba2": lambda: tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=V, hidden_size=32, state_size=8,
                                                           num_hidden_layers=2, num_heads=8, head_dim=8, n_groups=1,
                                                           chunk_size=4, pad_token_id=0)),
    "jamba": lambda: tf.JambaForCausalLM(tf.JambaConfig(**DECODER, num_experts=2, num_experts_per_tok=1,
                                                        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                                        expert_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4,
                                                        use_mamba_kernels=False)),
    "lfm2": lambda: tf.Lfm2ForCausalLM(tf.Lfm2Config(**DECODER, layer_types=["conv", "full_attention"])),
    "qwen3_next": lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
        **DECODER, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    # its recurrent block keeps its state in its own attributes: each member's own module, its state its own
    "recurrent_gemma": lambda: tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, lru_width=32, attention_window_size=4, block_types=["recurrent", "attention"],
        pad_token_id=0)),
}
ENCODERS = {
    "xlm-roberta": lambda: tf.XLMRobertaForSequenceClassification(tf.XLMRobertaConfig(**TEXT, num_labels=3)),
    "modernbert": lambda: tf.ModernBertForSequenceClassification(tf.ModernBertConfig(**TEXT, num_labels=3,
                                                                                      pad_token_id=0)),
    "funnel": lambda: tf.FunnelForSequenceClassification(tf.FunnelConfig(vocab_size=V, d_model=32, n_head=4,
                                                                         d_head=8, d_inner=64, block_sizes=[1, 1],
                                                                         num_labels=3)),
    "convbert": lambda: tf.ConvBertForSequenceClassification(tf.ConvBertConfig(**TEXT, num_labels=3,
                                                                               embedding_size=32)),
    "squeezebert": lambda: tf.SqueezeBertForSequenceClassification(tf.SqueezeBertConfig(
        **TEXT, embedding_size=32, num_labels=3, q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1,
        intermediate_groups=1, output_groups=1)),
    "bigbird": lambda: tf.BigBirdForSequenceClassification(tf.BigBirdConfig(**TEXT, attention_type="original_full",
                                                                            num_labels=3)),
    "esm": lambda: tf.EsmForSequenceClassification(tf.EsmConfig(**TEXT, num_labels=3, pad_token_id=1,
                                                                 position_embedding_type="rotary")),
    "xlm": lambda: tf.XLMForSequenceClassification(tf.XLMConfig(vocab_size=V, emb_dim=32, n_layers=2, n_heads=4,
                                                                num_labels=3, max_position_embeddings=64)),
    "fnet": lambda: tf.FNetForSequenceClassification(tf.FNetConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                                   intermediate_size=64, max_position_embeddings=64,
                                                                   num_labels=3)),
    "rembert": lambda: tf.RemBertForSequenceClassification(tf.RemBertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        input_embedding_size=16, output_embedding_size=16, max_position_embeddings=64, num_labels=3)),
    "ibert": lambda: tf.IBertForSequenceClassification(tf.IBertConfig(**TEXT, num_labels=3)),
    "bert-mlm": lambda: tf.BertForMaskedLM(tf.BertConfig(**TEXT)),
    # export fails on its sliding-window chunks: planned from the module tree, its attention runs member by member
    "longformer": lambda: tf.LongformerForSequenceClassification(tf.LongformerConfig(**TEXT, attention_window=4,
                                                                                     num_labels=3)),
}
IMAGES = {
    "dinov2": lambda: tf.Dinov2Model(tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=64, image_size=32, patch_size=8)),
    "clip-vision": lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2,
                                                                   num_attention_heads=4, intermediate_size=64,
                                                                   image_size=32, patch_size=8)),
    "convnext": lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1],
                                                                            num_stages=2, num_labels=3,
                                                                            image_size=32)),
    # TF-style padding computed from each conv's kernel_size and stride, read off the wide conv
    "mobilenet_v2": lambda: tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(image_size=32, depth_multiplier=0.25,
                                                                                      num_labels=3)),
}
SEQ2SEQ = {
    "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                             num_heads=4, decoder_start_token_id=0, pad_token_id=0)),
    # the decoder runs member by member (its position embeddings see no batch dim), on its rows of both caches
    "marian": lambda: tf.MarianMTModel(tf.MarianConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=0)),
    # its attention checks its shapes with a bare assert: a message-less error, which verification once failed to
    # report (IndexError) instead of running that attention as each member's own code
    "fsmt": lambda: tf.FSMTForConditionalGeneration(tf.FSMTConfig(
        langs=["en", "de"], src_vocab_size=V, tgt_vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, pad_token_id=1, decoder_start_token_id=2)),
}

# Other inputs than text or images alone: (factory, inputs, output to compare).
MIXED = {
    "clip": (lambda: tf.CLIPModel(tf.CLIPConfig(
        text_config={**TEXT, "num_hidden_layers": 2}, projection_dim=16,
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                       "image_size": 32, "patch_size": 8})),
        lambda: {"input_ids": torch.randint(5, V, (2, 7)), "pixel_values": torch.randn(2, 3, 32, 32)},
        "logits_per_image"),
    "wav2vec2": (lambda: tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_labels=3)),
        lambda: {"input_values": torch.randn(2, 400)}, "logits"),
    "whisper": (lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)),
        lambda: {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": torch.randint(3, V, (2, 5))},
        "logits"),
    "swin": (lambda: tf.SwinForImageClassification(tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3)),
        lambda: {"pixel_values": torch.randn(2, 3, 32, 32)}, "logits"),
}


def members(factory) -> list[torch.nn.Module]:
    """Three members: one architecture's initial weights, every parameter perturbed from a seed of its own."""
    built = []
    for seed in range(3):
        torch.manual_seed(0)
        model = factory().eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
        built.append(model)
    return built


def fuse(models, sample=None) -> WideModel:
    with contextlib.redirect_stdout(io.StringIO()):  # some exports print their graph when they fail
        return WideModel.from_models(models, sample)


def text_batch(pad_id: int) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(5, V, (2, 9))  # 9 tokens: not a multiple of the 3 members
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = pad_id, 0  # left padding on row 1
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def worst(wide, models, inputs, key="logits", where=None) -> float:
    got = wide(**inputs)[key]
    return max(((got[i] - m(**inputs)[key])[where] if where is not None else got[i] - m(**inputs)[key])
               .abs().max().item() for i, m in enumerate(models))


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder(name):
    models = members(DECODERS[name])
    wide = fuse(models)
    inputs = text_batch(models[0].config.pad_token_id)
    assert worst(wide, models, inputs, where=inputs["attention_mask"].bool()) <= 1e-5
    tokens = wide.generate(**inputs, max_new_tokens=4, do_sample=False)
    for i, model in enumerate(models):
        assert torch.equal(tokens[i], model.generate(**inputs, max_new_tokens=4, do_sample=False))


def test_a_decoder_keeping_state_in_its_modules_takes_any_batch_size():
    # RecurrentGemma's recurrent state lives in its blocks' attributes, sized by the last call's batch: run as one
    # code for every member, the members kept one state between them (the last member's), a batch of another size
    # than the last call's failed, and so did generate
    models = members(DECODERS["recurrent_gemma"])
    wide = fuse(models)
    for batch in (1, 3, 1):
        torch.manual_seed(batch)
        ids = torch.randint(5, V, (batch, 6))
        assert worst(wide, models, {"input_ids": ids}) <= 1e-5
        tokens = wide.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        for i, model in enumerate(models):
            assert torch.equal(tokens[i], model.generate(input_ids=ids, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("name", list(ENCODERS))
def test_encoder(name):
    models = members(ENCODERS[name])
    wide = fuse(models)
    assert worst(wide, models, {"input_ids": text_batch(0)["input_ids"].clamp(min=5)}) <= 1e-5


def test_nystromformer_on_a_sample_of_its_landmarks_multiple():
    # its landmarks take a length that is a multiple of them, which the sample built from the config (8 tokens) is not
    models = members(lambda: tf.NystromformerForSequenceClassification(tf.NystromformerConfig(
        **TEXT, num_landmarks=3, segment_means_seq_len=9, conv_kernel_size=3, num_labels=3)))
    ids = text_batch(0)["input_ids"].clamp(min=5)  # 9 tokens
    wide = fuse(models, {"input_ids": ids})
    for batch in (ids, ids[:1]):
        assert worst(wide, models, {"input_ids": batch}) <= 1e-5


@pytest.mark.parametrize("name", list(IMAGES))
def test_image(name):
    models = members(IMAGES[name])
    wide = fuse(models)
    key = "logits" if hasattr(models[0], "classifier") else "last_hidden_state"
    assert worst(wide, models, {"pixel_values": torch.randn(2, 3, 32, 32)}, key) <= 1e-5


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_seq2seq(name):
    models = members(SEQ2SEQ[name])
    ids = text_batch(0)["input_ids"].clamp(min=5)
    ids[:, -1] = 2  # BART's classification heads want an end-of-sequence token
    inputs = {"input_ids": ids, "decoder_input_ids": torch.randint(5, V, (2, 5)), "use_cache": False}
    wide = fuse(models, inputs)
    assert worst(wide, models, inputs) <= 1e-5
    for use_cache in (False, True):  # with the cache: an EncoderDecoderCache of N*B rows
        tokens = wide.generate(input_ids=ids, max_new_tokens=4, do_sample=False, use_cache=use_cache)
        for i, model in enumerate(models):
            assert torch.equal(tokens[i], model.generate(input_ids=ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("name", [*SEQ2SEQ, "mamba", "jamba", "qwen3"])
def test_a_cache_the_wide_model_makes_serves_the_next_step(name):
    # Asked for a cache and handed none, the model makes it: under vmap (Marian's decoder, whose members' position
    # tables differ), member by member, or whole. It must hold every member's rows, for a step taken by hand.
    models = members({**SEQ2SEQ, **DECODERS}[name])
    inputs = text_batch(0)
    if name in SEQ2SEQ:
        inputs = {"input_ids": inputs["input_ids"].clamp(min=5), "decoder_input_ids": torch.randint(5, V, (2, 5))}
    ids = "decoder_input_ids" if name in SEQ2SEQ else "input_ids"
    wide = fuse(models, {**inputs, "use_cache": False})
    step = {**inputs, ids: inputs[ids][:, -1:]}
    if "attention_mask" in step:
        step["attention_mask"] = torch.cat([inputs["attention_mask"], inputs["attention_mask"][:, -1:]], -1)
    cache = cache_name(models[0])  # Mamba: cache_params
    with torch.no_grad():
        got = wide(**inputs, use_cache=True)
        got_next = wide(**step, **{cache: got[cache]}, use_cache=True).logits
        for i, model in enumerate(models):
            want = model(**inputs, use_cache=True)
            want_next = model(**step, **{cache: want[cache]}, use_cache=True).logits
            assert (got.logits[i] - want.logits).abs().max() <= 1e-5
            assert (got_next[i] - want_next).abs().max() <= 1e-5


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_inputs(name):
    factory, make_inputs, key = MIXED[name]
    models = members(factory)
    torch.manual_seed(3)
    wide = fuse(models, make_inputs())
    torch.manual_seed(4)  # other inputs than the sample the plan was verified on
    assert worst(wide, models, make_inputs(), key) <= 1e-5
    assert all(entry.reason for entry in wide.plan.loops)  # a loop always says why


@pytest.mark.parametrize("name", ["t5", "marian", "whisper", "wav2vec2", "clip"])
def test_from_pretrained_draws_the_sample_from_the_config(name, tmp_path):
    # Folders fused with no sample given: encoder-decoder models get decoder_input_ids, audio models waveforms or
    # log-mel frames of the length their config says, a contrastive pair of encoders (CLIP) texts and images
    factory, make_inputs, key = (SEQ2SEQ[name], None, "logits") if name in SEQ2SEQ else MIXED[name]
    models = members(factory)
    for i, model in enumerate(models):
        model.save_pretrained(tmp_path / str(i))
    paths = [str(tmp_path / str(i)) for i in range(len(models))]
    with contextlib.redirect_stdout(io.StringIO()):
        wide = WideModel.from_pretrained(paths)
    # read from the files, members 1.. are planned from stand-ins whose tensors have no shape: no loop for that
    # (T5's attention, Whisper's positions and wav2vec2's model vmap, as they do from models in memory)
    assert not wide.plan.loops, wide.plan
    # the members as transformers loads them (Marian's sinusoidal positions are not saved, but made again)
    models = [type(models[0]).from_pretrained(path).eval() for path in paths]
    if make_inputs is None:
        inputs = {"input_ids": text_batch(0)["input_ids"].clamp(min=5), "decoder_input_ids": torch.randint(5, V, (2, 5))}
    else:
        torch.manual_seed(4)
        inputs = make_inputs()
    assert worst(wide, models, inputs, key) <= 1e-5


def test_a_model_the_built_sample_does_not_run_is_told_to_pass_one():
    class NeedsMore(tf.BertModel):  # a forward with an input of its own that the config says nothing of
        def forward(self, input_ids, attention_mask=None, scale=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask * scale, **kwargs)

    models = members(lambda: NeedsMore(tf.BertConfig(**TEXT)))
    with pytest.raises(ValueError, match=r"NeedsMore does not run on the sample inputs hf-wide built from its "
                                         r"config \(input_ids\(2, 8\).*pass sample inputs they run on"):
        fuse(models)
    inputs = {**text_batch(0), "scale": torch.tensor(2)}
    assert worst(fuse(models, inputs), models, inputs, "last_hidden_state") <= 1e-5


@pytest.mark.parametrize("name", ["jamba", "qwen3_next"])
def test_routers_and_experts_of_transformers_experts_implementations_run_on_their_members_tokens(name):
    # Vectorised as if on batch rows, the router routed every member's tokens for every member and the experts then
    # indexed past their member's tokens: an IndexError here, caught by verification, but a device-side assert on
    # CUDA, which loses the device
    models = members(DECODERS[name])
    wide = fuse(models)
    assert not [e.fqn for e in wide.plan.entries.values() if " raised " in e.reason], str(wide.plan)
    routed = [e for e in wide.plan.entries.values() if e.module_class.endswith(("Experts", "TopKRouter"))]
    assert len(routed) >= 2 and all("routes tokens to experts" in e.reason for e in routed)
    inputs = text_batch(models[0].config.pad_token_id)
    assert worst(wide, models, inputs, where=inputs["attention_mask"].bool()) <= 1e-5


def test_a_flop_counter_that_fails_on_a_model_that_runs_costs_only_the_counts(monkeypatch):
    # torch 2.11's counter asserts on grouped-query flash attention (CUDA, half precision), which the model runs
    import hf_wide.sample_trace

    def failing(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setattr(hf_wide.sample_trace, "module_flops", failing)
    models = members(DECODERS["qwen3"])
    with pytest.warns(UserWarning, match="FLOPs not counted: torch's FLOP counter failed on Qwen3ForCausalLM"):
        wide = fuse(models)
    assert wide.plan.total_flops == 0
    inputs = text_batch(0)
    assert worst(wide, models, inputs, where=inputs["attention_mask"].bool()) <= 1e-5


def test_xlnets_memories_are_each_members_and_are_not_taken_back():
    models = members(lambda: tf.XLNetForSequenceClassification(tf.XLNetConfig(
        vocab_size=V, d_model=32, n_layer=2, n_head=4, d_inner=64, num_labels=3)))
    wide = fuse(models)
    inputs = {"input_ids": text_batch(0)["input_ids"]}
    with torch.no_grad():
        got = wide(**inputs, use_mems=True)
        for i, model in enumerate(models):
            want = model(**inputs, use_mems=True)
            assert (got.logits[i] - want.logits).abs().max().item() <= 1e-5
            for layer, mems in zip(got.mems, want.mems, strict=True):  # (N, T, B, D); member i's (T, B, D)
                assert (layer[i] - mems).abs().max().item() <= 1e-5
        with pytest.raises(ValueError, match="mems"):  # a member's memory among all members' would be misread
            wide(**inputs, mems=got.mems)
    assert_tuples_are_each_members(wide, models, {**inputs, "use_mems": True, "output_hidden_states": True,
                                                  "labels": torch.tensor([0, 2])})


def assert_tuples_are_each_members(wide, models, inputs):
    """``return_dict=False``: the wide tuple's every tensor holds member i's at [i], as member i's own tuple. XLNet's
    memories came back folded, (N*T, B, D): a tuple has no names to unfold them by."""
    with torch.no_grad():
        got = wide(**inputs, return_dict=False)
        for i, model in enumerate(models):
            want = model(**inputs, return_dict=False)
            assert isinstance(got, tuple) and len(got) == len(want)
            flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
            assert len(flat_got) == len(flat_want)
            for g, w in zip(flat_got, flat_want):
                assert g[i].shape == w.shape and (g[i] - w).abs().max().item() <= 1e-5


CHOICES = {
    "bert": lambda: tf.BertForMultipleChoice(tf.BertConfig(**TEXT)),
    "xlnet": lambda: tf.XLNetForMultipleChoice(tf.XLNetConfig(vocab_size=V, d_model=32, n_layer=2, n_head=4,
                                                              d_inner=64)),
}


@pytest.mark.parametrize("name", sorted(CHOICES))
@pytest.mark.parametrize("sample_choices", [1, 3])
def test_a_multiple_choice_head_takes_any_number_of_choices(name, sample_choices):
    # The head flattens (B, C, T) into B*C rows for its encoder, whose wide embedding expanded BERT's position_ids,
    # (1, T), to the forward's N*B rows, not N*B*C: every call with two choices or more raised. XLNet's memories,
    # (T, B*C, D) per member, came back (N*T, B*C, D).
    models = members(CHOICES[name])

    def choices(batch, count, length, seed):
        ids = torch.randint(5, V, (batch, count, length), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    wide = fuse(models, choices(2, sample_choices, 8, 0))
    assert name == "xlnet" or not wide.plan.fallbacks  # (XLNet's model is vectorised for its own mask_emb)
    for batch, count, length in [(2, 3, 6), (1, 4, 7)]:
        inputs = choices(batch, count, length, batch * count)
        assert worst(wide, models, inputs) <= 1e-5
        if name == "xlnet":
            with torch.no_grad():
                got = wide(**inputs, use_mems=True).mems
                for i, model in enumerate(models):
                    for layer, mems in zip(got, model(**inputs, use_mems=True).mems, strict=True):
                        assert (layer[i] - mems).abs().max().item() <= 1e-5
        assert_tuples_are_each_members(wide, models, {**inputs, "output_hidden_states": True, "output_attentions": True,
                                                      "use_mems": name == "xlnet"})
    member = wide.member(1)  # without the wide model's hooks
    assert not member.base_model._forward_hooks and not member.base_model._forward_pre_hooks


@pytest.mark.parametrize("head", [tf.GPT2DoubleHeadsModel, tf.OpenAIGPTDoubleHeadsModel], ids=["gpt2", "openai"])
def test_a_double_heads_model_takes_choices_its_decoder_flattens(head):
    # GPT's double heads give the decoder (B, C, T) and it flattens them into B*C rows itself: within it the wide
    # embedding expanded the (1, T) positions to N*B rows, not N*B*C, and every call with choices raised.
    config = (tf.GPT2Config if head is tf.GPT2DoubleHeadsModel else tf.OpenAIGPTConfig)(
        vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    models = members(lambda: head(config))
    wide = fuse(models)
    for batch, count in [(2, 3), (1, 2)]:
        ids = torch.randint(5, V, (batch, count, 6), generator=torch.Generator().manual_seed(count))
        inputs = {"input_ids": ids, "mc_token_ids": torch.full((batch, count), 3), "labels": ids,
                  "mc_labels": torch.zeros(batch, dtype=torch.long)}
        with torch.no_grad():
            got, want = wide(**inputs), [m(**inputs) for m in models]
        for field in ("mc_logits", "logits", "mc_loss", "loss"):
            expected = torch.stack([getattr(w, field) for w in want])
            assert (getattr(got, field) - expected).abs().max().item() <= 1e-5, field


def test_clip_with_as_many_images_as_it_likes_beside_the_texts():
    factory, make_inputs, _ = MIXED["clip"]
    models = members(factory)
    torch.manual_seed(3)
    wide = fuse(models, make_inputs())
    for images in (2, 1):  # 3 texts beside 2 images, or beside 1 (zero-shot: one image, a text per label)
        inputs = {"input_ids": torch.randint(5, V, (3, 7)), "pixel_values": torch.randn(images, 3, 32, 32)}
        with torch.no_grad():
            got = wide(**inputs)
            for i, model in enumerate(models):
                want = model(**inputs)
                for key in ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"):
                    assert got[key].shape == (len(models), *want[key].shape), key  # (N, images, ...), (N, 3, ...)
                    assert (got[key][i] - want[key]).abs().max().item() <= 1e-5, key


@pytest.mark.parametrize("version", ["swin", "swinv2"])
def test_swin_at_other_image_sizes_than_the_samples(version):
    # Fused on 32x32 images, whose last stage is one window; other sizes have more windows there, rows of their own.
    # Swinv2's vectorised attention took them for a broadcast, and at 64x64 with a batch of 2 its shifted windows'
    # mask has the N*B rows of the forward without carrying them; Swin's position bias, planned alone (it takes no
    # input), was expanded to the forward's N*B rows, not the windows'. Both raised.
    model_class, config_class = {"swin": (tf.SwinForImageClassification, tf.SwinConfig),
                                 "swinv2": (tf.Swinv2ForImageClassification, tf.Swinv2Config)}[version]
    config = config_class(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4,
                          num_labels=3)
    models = members(lambda: model_class(config))[:2]
    wide = fuse(models)
    for batch, size in [(2, 48), (2, 64), (1, 40), (3, 32)]:
        torch.manual_seed(size)
        assert worst(wide, models, {"pixel_values": torch.randn(batch, 3, size, size)}) <= 1e-5
    # each stage's attentions, asked for in a call whose flag the trace never passed to the vectorised attention: its
    # windows' N*B*W rows were taken for a broadcast, every member ran all of them, and the stage raised
    eager = fuse(members(lambda: model_class(config_class(**config.to_dict(), attn_implementation="eager")))[:2])
    inputs = {"pixel_values": torch.randn(2, 3, 48, 48), "output_attentions": True, "output_hidden_states": True}
    assert_tuples_are_each_members(eager, [eager.member(i) for i in range(2)], inputs)


def test_an_encoder_decoder_model_of_two_berts_is_verified_without_its_decoders_cache():
    # EncoderDecoderModel's config has no use_cache of its own, and its decoder's asks for one: the sample ran with a
    # cache, whose layout matched no member's, and verification refused the fusion.
    def bert2bert():
        sizes = dict(TEXT, max_position_embeddings=64)
        config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(
            tf.BertConfig(**sizes), tf.BertConfig(**sizes, is_decoder=True, add_cross_attention=True))
        config.decoder_start_token_id, config.pad_token_id = 2, 0
        return tf.EncoderDecoderModel(config=config)

    models = members(bert2bert)
    wide = fuse(models)
    inputs = {**text_batch(0), "decoder_input_ids": torch.randint(5, V, (2, 4))}
    assert worst(wide, models, inputs) <= 1e-5
    with torch.no_grad():
        got = wide.generate(input_ids=inputs["input_ids"][:1], max_new_tokens=4, do_sample=False)
        for i, model in enumerate(models):
            assert torch.equal(got[i], model.generate(input_ids=inputs["input_ids"][:1], max_new_tokens=4,
                                                      do_sample=False))


def test_vit_mae_is_sampled_with_the_noise_that_ranks_its_patches():
    # ViT-MAE masks a random half of its patches unless given the noise to rank them by: the built sample had none,
    # every member masked other patches, and verification refused the fusion (6.9e3 times the tolerance).
    config = tf.ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             image_size=32, patch_size=8, mask_ratio=0.5, decoder_hidden_size=32,
                             decoder_num_hidden_layers=1, decoder_num_attention_heads=4, decoder_intermediate_size=64)
    models = members(lambda: tf.ViTMAEModel(config))
    wide = fuse(models)
    inputs = {"pixel_values": torch.randn(3, 3, 32, 32), "noise": torch.rand(3, 16)}
    assert worst(wide, models, inputs, key="last_hidden_state") <= 1e-5


BUILT_SAMPLE = {  # heads whose inputs the sample hf-wide builds from a config did not fit
    "bert-choices": lambda: tf.BertForMultipleChoice(tf.BertConfig(**TEXT)),
    "bart-seqcls": lambda: tf.BartForSequenceClassification(tf.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, num_labels=3)),
    "t5-seqcls": lambda: tf.T5ForSequenceClassification(tf.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, num_labels=3)),
}


@pytest.mark.parametrize("name", sorted(BUILT_SAMPLE))
def test_heads_that_read_their_eos_or_take_choices_fuse_from_the_sample_built_from_their_config(name):
    # A multiple-choice head takes (B, C, T); BART's classifier needs exactly one eos per text, and builds its
    # decoder's inputs itself (T5's too): from_pretrained, which cannot be given a sample, refused all three.
    models = members(BUILT_SAMPLE[name])
    wide = fuse(models)
    eos = models[0].config.eos_token_id
    ids = torch.randint(5, V, (3, 2, 7) if name.endswith("choices") else (3, 7))
    if name.endswith("seqcls"):
        ids[:, -1] = eos
    assert worst(wide, models, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}) <= 1e-5


def levit_members(randomise) -> list:
    """Three LeViT classifiers, each randomised by ``randomise(model, seed)``, their attentions' bias tables far
    apart (LeViT caches the table in eval mode)."""
    config = tf.LevitConfig(image_size=32, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
                            key_dim=[8, 8, 8], patch_size=16, stride=2, kernel_size=3, num_labels=3,
                            down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]])
    models = []
    for seed in range(3):
        torch.manual_seed(0)
        model = tf.LevitForImageClassification(config).eval()
        gen = randomise(model, seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("attention_biases"):
                    param.add_(3 * torch.randn(param.shape, generator=gen))
        models.append(model)
    return models


def _near_alike(model, seed: int) -> torch.Generator:
    gen = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return gen


def _randomised(model, seed: int) -> torch.Generator:
    randomise_(model, 100 + seed)
    return torch.Generator().manual_seed(7 + seed)


def test_a_member_taken_out_of_code_that_caches_holds_no_other_members_cache():
    # member(i) copied the vectorised code's module, and with it the bias tables member 0's call had cached there
    # (member 1: 5.7e-4 off, in eval mode; its state dict was its own)
    models = levit_members(_randomised)
    wide = fuse(models)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, model in enumerate(models):
            own = wide.member(i)(pixel_values=pixels).logits
            assert (own - model(pixel_values=pixels).logits).abs().max().item() <= 1e-5


def test_a_module_that_caches_what_it_derives_from_its_tensors_gives_each_member_its_own():
    # LeViT's attentions keep their bias table in a dict in eval mode. Run as one code for every member, the copy of
    # that code held member 0's table, filled when the trace ran member 0, and every member read it (member 2: 8.5e-5
    # off, more the more their biases differ)
    models = levit_members(_near_alike)
    wide = fuse(models)
    assert any(type(m).__name__ == "VectorisedFallback" for m in wide.modules())
    for seed in (1, 2, 3):  # each call after the first read what the one before left
        torch.manual_seed(seed)
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32), "output_hidden_states": True}
        assert_tuples_are_each_members(wide, models, inputs)


def test_compiled_code_that_caches_what_it_derives_gives_each_member_its_own():
    # Compiled, member 0's call filled LeViT's bias table for the others: without the graph break that takes it back
    # (code_state.restore_apart), the first stage's attention is 1.2e-4 off and its subsample 3.3e-4. Only those two
    # are compiled: the later stages attend over one position, where a bias changes nothing. (The whole model of
    # near-alike members, compiled, took 147 s of dynamo and stayed within 1e-5 without that break.)
    from torch._dynamo.testing import CompileCounter

    models = levit_members(_randomised)
    wide = fuse(models)
    first_stage = [module for name, module in wide.named_modules()
                   if type(module).__name__ == "VectorisedFallback" and ".stages.0." in name]
    assert len(first_stage) == 2
    for module in first_stage:
        module.compile(backend=CompileCounter())
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert worst(wide, models, {"pixel_values": pixels}) <= 1e-5


def test_a_vision_language_model_generates_each_members_continuation_of_a_batch():
    # transformers' generate computes the image features itself (get_image_features, before any forward): SigLIP's
    # positions, a broadcast, were expanded to N rows beside N*B images, and a batch of two raised a shape error
    models = members(lambda: tf.PaliGemmaForConditionalGeneration(tf.PaliGemmaConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           image_size=16, patch_size=8, projection_dim=32),
        text_config=dict(model_type="gemma", vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=8, intermediate_size=64, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2), image_token_id=3, projection_dim=32)))

    def inputs(batch: int) -> dict:  # the 4 image tokens (16 / 8 patches squared), then the prompt
        ids = torch.cat([torch.full((batch, 4), 3), torch.randint(5, V, (batch, 5))], 1)
        kinds = torch.cat([torch.zeros(batch, 7, dtype=torch.long), torch.ones(batch, 2, dtype=torch.long)], 1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": kinds,
                "pixel_values": torch.randn(batch, 3, 16, 16)}

    torch.manual_seed(5)
    wide = fuse(models, inputs(2))
    for batch in (1, 2):
        given = inputs(batch)
        got = wide.generate(**given, max_new_tokens=3, do_sample=False)
        for i, model in enumerate(models):
            assert torch.equal(got[i], model.generate(**given, max_new_tokens=3, do_sample=False))
