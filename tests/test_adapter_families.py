"""Adapters of other bases (hf_wide/adapters.py, hf_wide/samples.py): models that take other inputs than text (a
contrastive pair of encoders, CLIP; an audio classifier over a base saved without its head, wav2vec2 with PEFT's
SEQ_CLS, whose base's weight-normed positional convolution every member shares; a speech recogniser, Whisper), a
text classifier over a base saved for pre-training, and adapters trained over a vocabulary grown from the base's,
each member against ``PeftModel.from_pretrained(base, adapter)`` run alone."""

import contextlib
import logging
import re

import peft
import pytest
import torch
import transformers as tf
from conftest import CASES
from lora_members import LLAMA
from oracle import TOLERANCE, max_member_error

from hf_wide import IncompatibleMembersError, WideModel
from hf_wide.adapters import peft_quietly

V = 64
FAMILIES = {  # (base, the class it is trained as, its adapters' config, inputs, output to compare)
    "clip": (lambda: tf.CLIPModel(tf.CLIPConfig(
        text_config={"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 2,
                     "pad_token_id": 1}, projection_dim=16,
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                       "image_size": 16, "patch_size": 4})), tf.CLIPModel,
        dict(target_modules=["q_proj", "v_proj", "fc1"]),
        lambda: {"input_ids": torch.randint(5, V, (2, 7)), "pixel_values": torch.randn(2, 3, 16, 16)},
        "logits_per_image"),
    "wav2vec2": (lambda: tf.Wav2Vec2Model(tf.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_labels=3)), tf.Wav2Vec2ForSequenceClassification,
        dict(target_modules=["q_proj", "v_proj", "intermediate_dense"], task_type="SEQ_CLS",
             modules_to_save=["projector"]),  # (with the classifier, which SEQ_CLS saves: the head is new)
        lambda: {"input_values": torch.randn(2, 400)}, "logits"),
    "whisper": (lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)),
        tf.WhisperForConditionalGeneration,  # (no task type: PEFT's SEQ_2_SEQ_LM passes Whisper input_ids)
        dict(target_modules=["q_proj", "v_proj", "fc1", "fc2"]),
        lambda: {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": torch.randint(3, V, (2, 5))},
        "logits"),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_adapters_of_a_model_that_takes_other_inputs(name, tmp_path):
    """CLIP's adapters were traced on texts alone (a PeftModel's forward takes ``**kwargs``, so its images went
    unseen) and failed; wav2vec2's base was looked up in the text auto classes (a KeyError)."""
    factory, trained_as, config, make_inputs, output = FAMILIES[name]
    torch.manual_seed(0)
    factory().eval().save_pretrained(tmp_path / "base")
    adapters = []
    for seed, r in enumerate((2, 4)):
        torch.manual_seed(seed)
        with peft_quietly():
            model = peft.get_peft_model(trained_as.from_pretrained(tmp_path / "base"), peft.LoraConfig(
                r=r, lora_alpha=8, init_lora_weights=False, **config))
        model.save_pretrained(tmp_path / f"a{seed}")
        adapters.append(str(tmp_path / f"a{seed}"))
    wide = WideModel.from_pretrained(adapters)
    # (wav2vec2's weight-normed positional convolution: the base's; CLIP's model, which multiplies its texts by its
    # images, rewritten: its towers fused, where it ran vectorised whole)
    assert not wide.plan.fallbacks, wide.plan
    inputs = make_inputs()
    references = [peft.PeftModel.from_pretrained(trained_as.from_pretrained(tmp_path / "base"), a).eval()
                  for a in adapters]
    with torch.no_grad():
        got = wide(**inputs)[output]
        for i, alone in enumerate(references):
            assert (got[i] - alone(**inputs)[output]).abs().max().item() <= TOLERANCE
    if name == "whisper":  # its generate looked for the encoder at model.model.encoder: a PeftModel's is deeper
        features = inputs["input_features"]
        sequences = wide.generate(input_features=features, max_new_tokens=4, do_sample=False)  # (N, B, S)
        for i, alone in enumerate(references):
            own = alone.generate(input_features=features, max_new_tokens=4, do_sample=False)
            assert torch.equal(sequences[i, :, :own.shape[-1]], own)


@contextlib.contextmanager
def load_reports():
    """The load reports transformers logs meanwhile (its table of missing and unexpected tensors), as text."""
    reports = []
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.getMessage()) if "LOAD REPORT" in record.getMessage() else None
    log = logging.getLogger("transformers.modeling_utils")
    log.addHandler(handler)
    try:
        yield reports
    finally:
        log.removeHandler(handler)


@pytest.mark.parametrize("pretrained_as", [tf.BertForPreTraining, tf.BertForMaskedLM])
def test_classifier_adapters_of_a_base_saved_for_pre_training(pretrained_as, tmp_path):
    """LoRA classifiers of ``bert-base-uncased`` (saved for pre-training: no classifier) were refused, the base
    "missing tensor(s) classifier.bias, classifier.weight", which every adapter saves whole (PEFT's SEQ_CLS). A base
    without the pooler too (saved as a masked LM) is refused still: no adapter holds the pooler, which PEFT's own load
    draws at random. transformers' load report, which calls the classifier newly initialized, is shown only then."""
    bert = CASES["bert-seqcls"]
    torch.manual_seed(0)
    pretrained_as(bert.make_config()).save_pretrained(tmp_path / "base")
    adapters = []
    for seed in range(2):
        torch.manual_seed(seed)
        with peft_quietly():
            model = peft.get_peft_model(tf.BertForSequenceClassification.from_pretrained(
                tmp_path / "base", num_labels=3), peft.LoraConfig(r=4, target_modules=["query", "value"],
                                                                  task_type="SEQ_CLS", init_lora_weights=False))
        model.save_pretrained(tmp_path / f"a{seed}")
        adapters.append(str(tmp_path / f"a{seed}"))
    if pretrained_as is tf.BertForMaskedLM:
        with pytest.raises(IncompatibleMembersError, match=r"missing tensor\(s\) bert\.pooler.*at random"), \
                load_reports() as reports:
            WideModel.from_pretrained(adapters)
        assert len(reports) == 1 and re.search(r"from: .*base\n(.|\n)*bert\.pooler\.dense\.weight", reports[0])
        return
    with load_reports() as reports:
        wide = WideModel.from_pretrained(adapters)
    assert not reports
    references = [peft.PeftModel.from_pretrained(tf.BertForSequenceClassification.from_pretrained(
        tmp_path / "base", num_labels=3), a).eval() for a in adapters]
    with torch.no_grad():
        assert max_member_error(wide, references, bert.inputs(2, padded=True)) <= TOLERANCE


@pytest.mark.parametrize("tied", [True, False])
def test_adapters_over_a_grown_vocabulary(tied, tmp_path):
    """Tokens added before training (``resize_token_embeddings``; PEFT then saves the tables whole): each member's
    view of the base grows as its user grows the base before ``PeftModel.from_pretrained``, its tables its own. It
    failed ("size mismatch for ...embed_tokens.weight"), and so did ``merge=True``."""
    config = LLAMA.make_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")

    def grown():
        model = tf.LlamaForCausalLM.from_pretrained(tmp_path / "base")
        model.resize_token_embeddings(config.vocab_size + 3, mean_resizing=False)
        return model

    adapters = []
    for seed in range(2):
        torch.manual_seed(seed)
        with peft_quietly():
            model = peft.get_peft_model(grown(), peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM",
                                                                 init_lora_weights=False))
        with torch.no_grad():
            model.get_input_embeddings().weight[-3:].normal_()  # the new tokens, trained
        model.save_pretrained(tmp_path / f"a{seed}")
        adapters.append(str(tmp_path / f"a{seed}"))
    references = [peft.PeftModel.from_pretrained(grown(), a).eval() for a in adapters]
    inputs = LLAMA.inputs(2, padded=True)
    inputs["input_ids"][:, -1] = config.vocab_size + 1  # a new token
    with torch.no_grad():
        for merge, tolerance in ((False, TOLERANCE), (True, 1e-4)):  # (merged weights round)
            wide = WideModel.from_pretrained(adapters, merge=merge)
            assert max_member_error(wide, references, inputs) <= tolerance
        for folder, reference in zip(WideModel.from_pretrained(adapters).save_members(tmp_path / "m"), references):
            back = peft.PeftModel.from_pretrained(grown(), str(folder)).eval()  # PEFT's own adapter again
            assert torch.equal(back(**inputs).logits, reference(**inputs).logits)


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_seq2seq_adapters_beam_search_gives_each_members_own_beam_indices(arch):
    # PEFT's seq2seq generate calls its transformers model's: the rows of the beams' forwards went unrecorded, and
    # member i's beam_indices were off by i*B (member 1's [[2, 3, 2, ...]] where alone [[0, 1, 0, ...]])
    from families import randomise_
    from lora_members import adapted

    if arch == "t5":
        base = tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        targets = ["q", "v"]
    else:
        base = tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))
        targets = ["q_proj", "v_proj"]
    randomise_(base, 0)
    members = [adapted(base.eval(), seed, r=4, lora_alpha=8, target_modules=targets, task_type="SEQ_2_SEQ_LM")
               for seed in range(3)]
    wide = WideModel.from_models(members)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=5, num_beams=2, return_dict_in_generate=True, output_scores=True)
    out = wide.generate(input_ids=ids, **options)
    for i, member in enumerate(members):
        alone = member.generate(input_ids=ids, **options)
        assert torch.equal(out.sequences[i], alone.sequences)
        assert torch.equal(out.beam_indices[i], alone.beam_indices)
        assert all((a - b[i]).abs().max() <= 1e-5 for a, b in zip(alone.scores, out.scores, strict=True))
