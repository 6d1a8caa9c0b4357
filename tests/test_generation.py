"""hf_wide/generation.py: WideModel.generate gives each member's own continuation, and transformers' output with
every member's when asked (more cases: tests/test_architectures.py, tests/primitives/, tests/test_routers.py)."""

import copy

import pytest
import torch
import transformers
from conftest import CASES, NUM_MEMBERS
from oracle import TOLERANCE

from hf_wide import WideModel


@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c].causal_lm])
def test_generate_gives_each_members_own_greedy_continuation(fused, case_id):
    members, wide = fused(case_id)
    inputs = CASES[case_id].inputs(2, padded=True)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = wide.generate(**inputs, **settings)
    assert out.shape[:2] == (NUM_MEMBERS, 2)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(**inputs, **settings))


@pytest.mark.parametrize("search", [{}, {"num_beams": 2, "num_return_sequences": 2}])
def test_generate_returns_each_members_scores_and_beams_as_transformers_does(fused, search):
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=True)
    settings = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                    output_scores=True, output_logits=True, **search)
    out = wide.generate(**inputs, **settings)
    rows = 2 * search.get("num_return_sequences", 1)
    assert out.sequences.shape[:2] == (NUM_MEMBERS, rows)
    for i, member in enumerate(members):
        alone = member.generate(**inputs, **settings)
        assert torch.equal(out.sequences[i], alone.sequences)
        for key in ("scores", "logits"):  # a step's: (N, B, V), member i's (B, V)
            assert len(out[key]) == len(alone[key]) == 4
            for step, want in zip(out[key], alone[key]):
                assert (step[i] - want).abs().max().item() <= TOLERANCE
        if search:  # the beams' rows are member i's own, as if it had run alone
            assert torch.equal(out.beam_indices[i], alone.beam_indices)
            assert (out.sequences_scores[i] - alone.sequences_scores).abs().max().item() <= TOLERANCE


def test_members_whose_generation_configs_differ_are_refused_unless_the_call_gives_the_settings():
    """Members saved with generation settings of their own: one generate ran member 0's for every member, and member
    1's continuation was not its own (shorter, without its repetition penalty), silently."""
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    for member, own in zip(members, (dict(max_new_tokens=3), dict(max_new_tokens=5, repetition_penalty=1.8))):
        member.generation_config.update(pad_token_id=0, eos_token_id=None, do_sample=False, **own)
    wide = WideModel.from_models(members)
    inputs = case.inputs(2, padded=True)
    with pytest.raises(ValueError, match=r"max_new_tokens: member 0 3, member 1 5; repetition_penalty: member 0 "
                                         r"1\.0, member 1 1\.8\).*member 1 would not continue as it does alone"):
        wide.generate(**inputs)
    given = dict(max_new_tokens=4, repetition_penalty=1.3)  # every member with these
    out = wide.generate(**inputs, **given)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(**inputs, **given))
    config = copy.deepcopy(members[1].generation_config)
    out = wide.generate(**inputs, generation_config=config)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(**inputs, generation_config=config))
    for i, member in enumerate(members):  # each member's own settings: its own model
        assert torch.equal(wide.member(i).generate(**inputs), member.generate(**inputs))


def test_a_generation_config_given_must_set_what_the_members_differ_in():
    # transformers fills what a config given to generate leaves unset from the model's: member 0's. Member 1, whose
    # own eos differs, ran past it with member 0's, silently. Settings unset in one and off in another agree.
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    for member, eos in zip(members, (None, 7)):
        member.generation_config.update(pad_token_id=0, eos_token_id=eos)
    members[1].generation_config.do_sample = None  # member 0's False
    wide = WideModel.from_models(members)
    inputs = case.inputs(2, padded=True)
    with pytest.raises(ValueError, match=r"\(eos_token_id: member 0 None, member 1 7\)"):
        wide.generate(**inputs, generation_config=transformers.GenerationConfig(max_new_tokens=3))
    config = transformers.GenerationConfig(max_new_tokens=3, eos_token_id=5, pad_token_id=0)
    out = wide.generate(**inputs, generation_config=config)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(**inputs, generation_config=config))


def test_a_member_saved_without_a_generation_config_generates_with_its_own(tmp_path):
    # transformers builds it from the member's config.json; the low-memory load gave it member 0's (its
    # max_new_tokens and repetition penalty), silently
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    members[0].generation_config.update(max_new_tokens=5, repetition_penalty=3.0)
    folders = [tmp_path / f"m{i}" for i in range(2)]
    for member, folder in zip(members, folders):
        member.save_pretrained(folder)
    (folders[1] / "generation_config.json").unlink()
    wide = WideModel.from_pretrained([str(f) for f in folders])
    alone = transformers.AutoModelForCausalLM.from_pretrained(folders[1])
    assert wide.member_generation_configs[1].to_dict() == alone.generation_config.to_dict()
    with pytest.raises(ValueError, match="repetition_penalty: member 0 3.0, member 1 1.0"):
        wide.generate(**case.inputs(2, padded=True))


def test_a_prefix_constraint_is_called_with_the_users_batch_ids():
    # transformers calls it with each row's index among the N*B folded rows: a table of one constraint per input
    # raised KeyError, and a callback with a default constrained member 1 by the default, silently
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    wide = WideModel.from_models(members)
    inputs = case.inputs(2, padded=True)
    allowed = {0: list(range(2, 30)), 1: list(range(50, 90))}
    for search in ({}, {"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2, "top_k": 1}):
        settings = dict(max_new_tokens=3, eos_token_id=None, pad_token_id=0,
                        prefix_allowed_tokens_fn=lambda batch_id, ids: allowed[batch_id], **search)
        out = wide.generate(**inputs, **settings)
        for i, member in enumerate(members):
            assert torch.equal(out[i], member.generate(**inputs, **settings)), (search, i)


@pytest.mark.parametrize("option", ["assistant_model", "prompt_lookup_num_tokens", "streamer"])
def test_what_transformers_runs_on_one_sequence_is_refused_with_the_way_out(option):
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    wide = WideModel.from_models(members)
    value = {"assistant_model": members[0], "prompt_lookup_num_tokens": 2,
             "streamer": transformers.TextStreamer(tokenizer=None)}[option]
    with pytest.raises(ValueError, match=rf"\({option}=\) runs one sequence at a time.*wide\.member\(i\)\.generate"):
        wide.generate(**case.inputs(1, padded=False), max_new_tokens=2, **{option: value})


def whispers(count: int = 2) -> list:
    config = transformers.WhisperConfig(
        vocab_size=100, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=3,
        begin_suppress_tokens=None, suppress_tokens=None)
    built = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = transformers.WhisperForConditionalGeneration(config).eval()
        for key, value in dict(lang_to_id={"<|en|>": 5, "<|de|>": 6}, task_to_id={"transcribe": 7},
                               no_timestamps_token_id=9, is_multilingual=True, max_initial_timestamp_index=5).items():
            setattr(model.generation_config, key, value)  # (update() sets only the attributes a config has)
        built.append(model)
    return built


def test_whisper_takes_a_language_per_input_and_refuses_what_drops_rows():
    members = whispers()
    wide = WideModel.from_models(members)
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    settings = dict(language=["en", "de"], max_new_tokens=4)  # one per input: transformers wanted one per N*B rows
    out = wide.generate(input_features=features, **settings)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(input_features=features, **settings))
    for length in (2, 3):  # a prompt as long as the batch was folded as its rows: each member continued another
        prompted = dict(prompt_ids=torch.arange(11, 11 + length), max_new_tokens=4)
        out = wide.generate(input_features=features, **prompted)
        for i, member in enumerate(members):
            assert torch.equal(out[i], member.generate(input_features=features, **prompted))
    long = torch.randn(1, 8, 80, generator=torch.Generator().manual_seed(0))  # two and a half windows of 32 frames
    with pytest.raises(ValueError, match="long-form transcription"):  # (it raised inside, or ran a row as another
        wide.generate(input_features=long, attention_mask=torch.ones(1, 80, dtype=torch.long), language="en",
                      return_timestamps=True, max_new_tokens=4)  # member's, as rows finished)
    with pytest.raises(ValueError, match="temperature fallback"):
        wide.generate(input_features=features, temperature=(0.0, 0.5), max_new_tokens=4)
    # beam search's logits and hidden states: Whisper gives each sequence those of its row among the beams' rows, and
    # member 1's sequences read member 0's beams (2.1 off in the logits); its scores take their beam indices
    beams = dict(num_beams=2, max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(ValueError, match=r"Whisper's beam search \(2 beams, 1 returned\) gives each sequence's logits"):
        wide.generate(input_features=features, output_logits=True, **beams)
    out = wide.generate(input_features=features, **beams)
    for i, member in enumerate(members):
        alone = member.generate(input_features=features, **beams)
        assert torch.equal(out.sequences[i], alone.sequences)
        assert all((a - b[i]).abs().max() <= 1e-5 for a, b in zip(alone.scores, out.scores, strict=True))
    greedy = dict(max_new_tokens=3, return_dict_in_generate=True, output_logits=True)
    out = wide.generate(input_features=features, **greedy)
    for i, member in enumerate(members):
        alone = member.generate(input_features=features, **greedy)
        assert all((a - b[i]).abs().max() <= 1e-5 for a, b in zip(alone.logits, out.logits, strict=True))
