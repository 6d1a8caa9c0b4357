"""hf_wide/generation.py: WideModel.generate gives each member's own continuation, and transformers' output with
every member's when asked (more cases: tests/test_architectures.py, tests/primitives/, tests/test_routers.py; which
generation config each member runs: tests/test_generation_configs.py)."""

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
    # a short audio whose segment ends before the window's end goes on to the next window with the rows not done: the
    # rows of the folded batch that were done are dropped (member 0's rows continued with member 1's weights)
    for dropping in (dict(return_timestamps=True, language="en"), dict(no_repeat_ngram_size=1)):
        with pytest.raises(ValueError, match=r"another window with 2 of its 4 rows.*wide\.member\(i\)\.generate"):
            wide.generate(input_features=features, max_new_tokens=4, **dropping)
        alone = wide.member(1).generate(input_features=features, max_new_tokens=4, **dropping)  # (the way out: its
        assert torch.equal(alone, members[1].generate(input_features=features, max_new_tokens=4, **dropping))  # own)
    settings = dict(return_timestamps=True, language="en", no_repeat_ngram_size=1, max_new_tokens=4)
    out = wide.generate(input_features=features, **settings)  # (every row on to the next window, or none)
    for i, member in enumerate(members):
        alone = member.generate(input_features=features, **settings)
        assert torch.equal(out[i, :, :alone.shape[-1]], alone) and (out[i, :, alone.shape[-1]:] == 0).all()
    # beam search's logits and hidden states: Whisper gives each sequence those of its row among the beams' rows, and
    # member 1's sequences read member 0's beams (2.1 off in the logits); its scores take their beam indices
    beams = dict(num_beams=2, max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(ValueError, match=r"Whisper's beam search \(2 beams, 1 returned\) gives each sequence's logits"):
        wide.generate(input_features=features, output_logits=True, **beams)
    with pytest.raises(ValueError, match=r"Whisper's beam search \(2 beams, 2 returned\)"):  # (2.8 off member 1's)
        wide.generate(input_features=features, output_logits=True, **beams, num_return_sequences=2)
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


class StopAfter(transformers.StoppingCriteria):
    """Done where a row's last token is one of ``tokens`` (a user's criterion: no end-of-sequence token)."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


@pytest.mark.parametrize("stop", ["stop_strings", "stopping_criteria"])
def test_members_done_early_without_an_end_of_sequence_token_are_padded_past_their_end(stop, tmp_path):
    # transformers pads a row that is done only where an eos token is a criterion: a member whose rows were all done
    # went on with the others, holding tokens past its own end that it never generates alone
    from pipelines.text_members import decoder_tokenizer, sentences

    members = [CASES["llama-causallm"].build(seed) for seed in range(3)]
    wide = WideModel.from_models(members)
    tokenizer = decoder_tokenizer(tmp_path)
    texts = [sentences(1, seed=s, min_words=w, max_words=w)[0] for s, w in ((11, 6), (12, 2), (13, 4))]
    inputs = dict(tokenizer(texts, return_tensors="pt", padding=True))
    inputs.pop("token_type_ids", None)
    options = dict(max_new_tokens=8, pad_token_id=0, eos_token_id=None, do_sample=False)
    if stop == "stop_strings":
        options.update(stop_strings=["a", "b", "good", "hated", "movie", "not"], tokenizer=tokenizer)
    else:
        options.update(stopping_criteria=transformers.StoppingCriteriaList([StopAfter([2, 42, 62, 74, 75])]))
    out = wide.generate(**inputs, **options)
    lengths = set()
    for i, member in enumerate(members):
        alone = member.generate(**inputs, **options)
        lengths.add(alone.shape[-1])
        assert torch.equal(out[i, :, :alone.shape[-1]], alone) and (out[i, :, alone.shape[-1]:] == 0).all()
    assert len(lengths) > 1  # some members end sooner than others


def test_members_done_early_are_padded_with_the_pad_a_passed_config_runs_with_even_inside_a_members_generate():
    # A generation_config= passed without a pad runs the model's (transformers fills it): the members were padded with
    # 0, not their 7. A criterion that itself runs wide.member(0).generate (a copy, which keeps the recorder) reset the
    # outer generate's record, and member 0 ran on with real tokens.
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(3)]
    inputs = {k: v for k, v in case.inputs(2, padded=True).items() if k in ("input_ids", "attention_mask")}
    start = inputs["input_ids"].shape[-1]
    greedy = members[0].generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    stops = sorted({int(greedy[0, start + 1]), int(greedy[1, start + 2])})  # member 0's rows end at 2 and 3 tokens
    for member in members:
        member.generation_config.update(pad_token_id=7, eos_token_id=None)
    wide = WideModel.from_models(members)

    class Nested(StopAfter):
        def __call__(self, input_ids, scores, **kwargs):
            helper.generate(**inputs, max_new_tokens=1, do_sample=False)  # a judge consulted at each step, say
            return super().__call__(input_ids, scores, **kwargs)

    wide.generate(**inputs, max_new_tokens=1)  # (the recorder installed, and copied by member(i) from now on)
    helper = wide.member(0)
    for criterion in (StopAfter(stops), Nested(stops)):
        options = dict(generation_config=transformers.GenerationConfig(max_new_tokens=8, do_sample=False),
                       stopping_criteria=transformers.StoppingCriteriaList([criterion]))
        out = wide.generate(**inputs, **options)
        for i, member in enumerate(members):
            alone = member.generate(**inputs, **options)
            assert torch.equal(out[i, :, :alone.shape[-1]], alone) and (out[i, :, alone.shape[-1]:] == 7).all()
        assert out.shape[-1] > start + 3  # member 0 ended before the others
