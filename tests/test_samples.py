"""hf_wide/samples.py: the sample inputs built from a config, on which fusion traces and verifies the members."""

import torch
import transformers as tf

from hf_wide import WideModel
from hf_wide.samples import sample_inputs


def test_a_list_of_end_of_sequence_ids_is_kept_out_of_the_sample():
    # Llama 3 Instruct (and GLM) end a text at any of several ids: building the sample raised "unhashable type:
    # 'list'", so that such checkpoints could not be fused without a sample
    config = tf.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, pad_token_id=0, bos_token_id=1,
                            eos_token_id=[2, 3])
    members = []
    for seed in range(2):
        torch.manual_seed(seed)
        members.append(tf.LlamaForCausalLM(config).eval())
    ids = sample_inputs(members[0])["input_ids"]
    assert not torch.isin(ids, torch.tensor([0, 1, 2, 3])).any()
    wide = WideModel.from_models(members)
    prompt = torch.randint(5, 100, (2, 6))
    tokens = wide.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    for i, member in enumerate(members):
        assert torch.equal(tokens[i], member.generate(input_ids=prompt, max_new_tokens=4, do_sample=False))


def test_raw_audio_is_as_long_as_the_feature_extractor_makes_a_second_of_wav2vec2():
    # The sample was a second of audio whatever the config: 1,600 frames from a small one that downsamples 10x,
    # over which WavLM's and SEW-D's relative attention made fusing take tens of seconds
    for conv, samples in [({}, 15_760), ({"conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3)}, 500)]:
        config = tf.WavLMConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, num_labels=3, num_conv_pos_embeddings=16,
                                num_conv_pos_embedding_groups=4, **({"conv_dim": (16,) * 7} | conv))
        members = []
        for seed in range(2):
            torch.manual_seed(seed)
            members.append(tf.WavLMForSequenceClassification(config).eval())
        sample = sample_inputs(members[0])["input_values"]
        assert sample.shape == (2, samples)
        with torch.no_grad():
            assert members[0].wavlm(sample).last_hidden_state.shape[1] == 49
    wide = WideModel.from_models(members)
    audio = torch.randn(3, 1234)
    with torch.no_grad():
        logits = wide(input_values=audio).logits
        for i, member in enumerate(members):
            torch.testing.assert_close(logits[i], member(input_values=audio).logits, rtol=0, atol=1e-5)
