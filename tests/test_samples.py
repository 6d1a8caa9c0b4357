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
