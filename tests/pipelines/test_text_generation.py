"""Text generation: per-member continuations equal each member's own generate and transformers pipeline;
ensemble decoding (KV cache of N*B rows) equals a reference loop that steps the members separately with no
cache and averages their softmaxes; sampling and bad input."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import transformers
from tokenizers import normalizers
from families import VOCAB, randomise_
from lora_members import adapted
from text_members import build_members, decoder_tokenizer, sentences

from hf_wide import WideModel
from hf_wide.pipelines import pipeline
from hf_wide.pipelines.text_generation import _filter
from hf_wide.verify_cache import cache_name

PROMPTS = [sentences(1, seed=11, min_words=6, max_words=6)[0], sentences(1, seed=12, min_words=2, max_words=2)[0]]
NEW = 6


@pytest.fixture(scope="module", params=["llama-causallm", "gpt2-causallm", "llama-lora"])
def setup(request, tmp_path_factory):
    tokenizer = decoder_tokenizer(tmp_path_factory.mktemp("tok"))
    if request.param == "llama-lora":  # LoRA adapters of one base, ranks 4 and 8 (hf_wide/blocks/lora.py)
        base = build_members("llama-causallm", 1)[0]
        members = [lora_member(base, seed, r) for seed, r in enumerate((4, 8, 8))]
    else:
        members = build_members(request.param, 3)
    return tokenizer, members, WideModel.from_models(members)


def mamba_member(seed: int):
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = transformers.MambaForCausalLM(config).eval()
    randomise_(model, seed)
    return model


def lora_member(base, seed: int, rank: int):
    return adapted(base, seed, scale=0.2, r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "down_proj"],
                   task_type="CAUSAL_LM")


@torch.no_grad()
def reference_decode(members, tokenizer, prompts, steps, eos=1):
    """Every step, every member reads the whole sequence again (no cache); their softmaxes are averaged and
    the argmax appended. Returns each row's new tokens (cut after eos) and per-step member probabilities."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    new, member_probs = [], []
    for _ in range(steps):
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        probs = torch.stack([m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].softmax(-1)
                             for m in members])  # (N, B, V)
        token = probs.mean(0).argmax(-1)
        new.append(token)
        member_probs.append(probs)
        ids = torch.cat([ids, token[:, None]], -1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
    new = torch.stack(new, -1).tolist()
    rows = [row[: row.index(eos) + 1] if eos in row else row for row in new]
    return rows, torch.stack(member_probs, 2)  # (N, B, S, V)


def entropy(p):
    return -(p * p.clamp_min(1e-12).log()).sum(-1)


def test_ensemble_decoding_equals_stepping_the_members_without_cache(setup):
    tokenizer, members, wide = setup
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer)
    results = pipe(PROMPTS, max_new_tokens=NEW, return_full_text=False, batch_size=2)  # left-padded batch
    rows, probs = reference_decode(members, tokenizer, PROMPTS, NEW)
    for b, (row, result) in enumerate(zip(rows, results)):
        assert result["generated_text"] == tokenizer.decode(row, skip_special_tokens=True)
        p = probs[:, b, : len(row)]  # (N, S, V): the steps up to eos
        tokens = torch.tensor(row)
        chosen = p[:, torch.arange(len(row)), tokens]  # (N, S): each member's probability of the token
        u = result["uncertainty"]
        assert u["predictive_entropy"] == pytest.approx(float(entropy(p.mean(0)).mean()), abs=1e-5)
        assert u["expected_entropy"] == pytest.approx(float(entropy(p).mean()), abs=1e-5)
        assert u["member_std"] == pytest.approx(float(chosen.std(0, unbiased=False).mean()), abs=1e-6)
        assert u["agreement"] == pytest.approx(float((p.argmax(-1) == tokens).float().mean()))
    # A sampling temperature without sampling changes nothing, as in transformers' generate (it tempered each
    # member's distribution before the mean, and the mean's argmax moved)
    assert pipe(PROMPTS, max_new_tokens=NEW, return_full_text=False, batch_size=2, temperature=0.05) == results


@torch.no_grad()
def test_ensemble_decoding_of_a_state_space_model_steps_each_members_own_cache(tmp_path):
    # Mamba's cache (cache_params: conv and recurrent states) is stepped one token at a time, which rounds
    # differently from reading the whole sequence again: the reference steps each member's own cache, with the mask
    # on the prompt only, as Mamba's own generate (the mask passed with each new token moved the logits by up to
    # 2e-2, and one-hot weights decoded other tokens than the member's generate)
    tokenizer = decoder_tokenizer(tmp_path)
    members = [mamba_member(seed) for seed in range(3)]
    wide = WideModel.from_models(members)
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer)
    results = pipe(PROMPTS, max_new_tokens=NEW, return_full_text=False, batch_size=2)
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    step, mask, caches, new, entropies = encoded["input_ids"], encoded["attention_mask"], [None] * 3, [], []
    name = cache_name(members[0])  # cache_params, cache from transformers 5.24 on
    for _ in range(NEW):
        outs = [m(input_ids=step, attention_mask=mask, use_cache=True, **{name: c}) for m, c in zip(members, caches)]
        caches = [getattr(out, name) for out in outs]
        probs = torch.stack([out.logits[:, -1].softmax(-1) for out in outs]).mean(0)  # (B, V)
        new.append(probs.argmax(-1))
        entropies.append(entropy(probs))
        step, mask = new[-1][:, None], None
    for b, result in enumerate(results):
        row = torch.stack(new, -1)[b].tolist()
        row = row[: row.index(1) + 1] if 1 in row else row  # up to eos
        assert result["generated_text"] == tokenizer.decode(row, skip_special_tokens=True)
        want = float(torch.stack(entropies, -1)[b, : len(row)].mean())
        assert result["uncertainty"]["predictive_entropy"] == pytest.approx(want, abs=1e-5)
    one_hot = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="weighted", weights=[0, 1, 0])
    for prompt in PROMPTS:
        encoded = tokenizer(prompt, return_tensors="pt")
        alone = members[1].generate(**encoded, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        got = one_hot(prompt, max_new_tokens=NEW, return_full_text=False)["generated_text"]
        assert got == tokenizer.decode(alone[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)


def test_per_member_continuations_equal_each_members_generate(setup):
    tokenizer, members, wide = setup
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="none")
    results = pipe(PROMPTS, max_new_tokens=NEW, return_full_text=False, batch_size=2)
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    for i, member in enumerate(members):
        out = member.generate(**encoded, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        for b, result in enumerate(results):
            assert set(result) == {"members"}
            expected = tokenizer.decode(out[b, encoded["input_ids"].shape[-1]:], skip_special_tokens=True)
            assert result["members"][i] == {"member": i, "generated_text": expected}


def test_per_member_continuations_equal_transformers_pipeline(setup):
    tokenizer, members, wide = setup
    result = pipeline("text-generation", model=wide, tokenizer=tokenizer)(PROMPTS[0], max_new_tokens=NEW,
                                                                         return_members=True)
    assert result["generated_text"].startswith(PROMPTS[0])
    for i, member in enumerate(members):
        reference = transformers.pipeline("text-generation", model=member, tokenizer=tokenizer)
        expected = reference(PROMPTS[0], max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
        assert result["members"][i]["generated_text"] == expected


def test_one_hot_weights_decode_like_that_member_alone(setup):
    tokenizer, members, wide = setup
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="weighted", weights=[0, 1, 0])
    result = pipe(PROMPTS[0], max_new_tokens=NEW, return_full_text=False)
    encoded = tokenizer(PROMPTS[0], return_tensors="pt")
    out = members[1].generate(**encoded, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert result["generated_text"] == tokenizer.decode(out[0, encoded["input_ids"].shape[-1]:],
                                                        skip_special_tokens=True)


def test_decoding_stops_at_eos_and_measures_only_what_it_generated(setup):
    tokenizer, members, wide = setup
    rows, probs = reference_decode(members, tokenizer, PROMPTS[:1], NEW, eos=-1)
    eos = rows[0][2]  # make the third token an eos
    stop = rows[0].index(eos) + 1
    config = wide.model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = eos
    try:
        result = pipeline("text-generation", model=wide, tokenizer=tokenizer)(PROMPTS[0], max_new_tokens=NEW,
                                                                             return_full_text=False)
    finally:
        config.eos_token_id = saved
    assert result["generated_text"] == tokenizer.decode(rows[0][:stop], skip_special_tokens=True)
    expected = entropy(probs[:, 0, :stop].mean(0)).mean()
    assert result["uncertainty"]["predictive_entropy"] == pytest.approx(float(expected), abs=1e-5)


def test_sampling_is_seeded_and_top_k_1_is_greedy(setup):
    tokenizer, _, wide = setup
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer)
    greedy = pipe(PROMPTS[0], max_new_tokens=NEW)
    assert pipe(PROMPTS[0], max_new_tokens=NEW, do_sample=True, top_k=1, seed=3) == greedy
    first = pipe(PROMPTS[0], max_new_tokens=NEW, do_sample=True, temperature=2.0, top_p=0.9, seed=5)
    assert pipe(PROMPTS[0], max_new_tokens=NEW, do_sample=True, temperature=2.0, top_p=0.9, seed=5) == first
    others = {pipe(PROMPTS[0], max_new_tokens=NEW, do_sample=True, temperature=2.0, seed=s)["generated_text"]
              for s in range(4)}
    assert len(others) > 1
    pipe(PROMPTS[0], max_new_tokens=NEW, do_sample=True, seed=2**64 - 1)  # the largest seed torch takes
    with pytest.raises(ValueError, match=r"seed must be a whole number from 0 to 2\*\*64 - 1"):  # (torch's overflow)
        pipe(PROMPTS[0], max_new_tokens=NEW, do_sample=True, seed=2**64)


def test_each_members_draws_are_the_calls_own_whatever_other_threads_do(setup):
    """``combine="none"`` seeded torch's global generator, which transformers' sampling draws from: calls from other
    threads drew each other's numbers (62 of 64 answers differed from the call alone), the process was left
    reseeded, and ``generator=`` was not read."""
    tokenizer, _, wide = setup
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="none")
    options = dict(max_new_tokens=NEW, do_sample=True, temperature=2.0)

    def call(_=None):
        return pipe(PROMPTS, seed=3, **options)

    alone = call()
    with ThreadPoolExecutor(4) as pool:
        assert all(result == alone for result in pool.map(call, range(16)))
    state = torch.get_rng_state()
    call()
    assert torch.equal(torch.get_rng_state(), state)
    drawn = [pipe(PROMPTS, generator=torch.Generator().manual_seed(s), **options) for s in (7, 7, 8, 9)]
    assert drawn[0] == drawn[1] and any(d != drawn[0] for d in drawn[2:])


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    probs = torch.tensor([[0.5, 0.1, 0.25, 0.15]])
    assert _filter(probs, 2, None)[0].tolist() == pytest.approx([0.5 / 0.75, 0, 0.25 / 0.75, 0])
    assert _filter(probs, None, 0.7)[0].tolist() == pytest.approx([0.5 / 0.75, 0, 0.25 / 0.75, 0])
    assert _filter(probs, None, 0.75)[0].tolist() == pytest.approx([0.5 / 0.75, 0, 0.25 / 0.75, 0])
    assert _filter(probs, None, 0.76)[0].tolist() == pytest.approx([0.5 / 0.9, 0, 0.25 / 0.9, 0.15 / 0.9])
    assert _filter(probs, None, 0.1)[0].tolist() == pytest.approx([1, 0, 0, 0])


def test_long_prompts_keep_their_last_tokens_or_are_refused(setup):
    tokenizer, members, wide = setup
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer)
    words = sentences(1, seed=4, min_words=70, max_words=70)[0]  # over the 64 positions
    result = pipe(words, max_new_tokens=4, return_full_text=False)
    kept = tokenizer(words, return_tensors="pt")["input_ids"][:, -60:]
    rows, _ = reference_decode(members, tokenizer, [tokenizer.decode(kept[0])], 4)
    assert tokenizer(tokenizer.decode(kept[0]))["input_ids"] == kept[0].tolist()
    assert result["generated_text"] == tokenizer.decode(rows[0], skip_special_tokens=True)
    with pytest.raises(ValueError, match="room for 60"):
        pipe(words, max_new_tokens=4, truncation=False)


def test_a_prompt_that_is_no_token_starts_from_bos_as_transformers_does(setup, tmp_path):
    # A tokenizer that drops control characters reads "\x07" as no token: transformers' pipeline then generates from
    # BOS; hf-wide raised an IndexError alone, and beside another prompt continued a row of padding.
    _, members, wide = setup
    tokenizer = decoder_tokenizer(tmp_path)
    tokenizer.backend_tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=False, strip_accents=False, lowercase=False)
    assert tokenizer("\x07")["input_ids"] == []
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="none")
    alone = pipe("\x07", max_new_tokens=NEW)
    beside = pipe([PROMPTS[0], "\x07"], max_new_tokens=NEW, batch_size=2)[1]
    assert beside == alone
    for i, member in enumerate(members):
        reference = transformers.pipeline("text-generation", model=member, tokenizer=tokenizer)
        expected = reference("\x07", max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
        assert alone["members"][i]["generated_text"] == expected


@pytest.mark.parametrize("options, call, error, match", [
    ({}, {"inputs": ""}, ValueError, "empty prompt"),
    ({}, {"inputs": []}, ValueError, "empty list"),
    ({}, {"inputs": 3}, TypeError, "Expected a prompt"),
    ({}, {"inputs": "a cat", "max_new_tokens": 0}, ValueError, "max_new_tokens must be a whole number of at least 1"),
    ({}, {"inputs": "a cat", "top_k": "2"}, ValueError, "top_k must be a whole number"),
    ({}, {"inputs": "a cat", "batch_size": -1}, ValueError, "batch_size must be a whole number"),
    ({}, {"inputs": "a cat", "max_new_tokens": 64}, ValueError, "leaves no room"),
    ({}, {"inputs": "a cat", "top_p": 1.5}, ValueError, "top_p"),
    ({}, {"inputs": "a cat", "beams": 2}, TypeError, "unknown options: beams"),
    ({"combine": "vote"}, {"inputs": "a cat", "do_sample": True}, ValueError, "no distribution to sample"),
    ({"combine": "first"}, None, ValueError, "Unknown combine rule"),
    ({"combine": "weighted", "weights": [1]}, None, ValueError, "one number per member"),
])
def test_bad_input_is_refused_clearly(setup, options, call, error, match):
    tokenizer, _, wide = setup
    with pytest.raises(error, match=match):
        pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, **options)
        pipe(**call)


def test_vote_decoding_takes_the_majority_token(setup):
    tokenizer, members, wide = setup
    result = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="vote")(
        PROMPTS[0], max_new_tokens=1, return_full_text=False)
    encoded = tokenizer(PROMPTS[0], return_tensors="pt")
    with torch.no_grad():
        probs = torch.stack([m(**encoded).logits[0, -1].softmax(-1) for m in members])  # (N, V)
    votes = np.bincount(probs.argmax(-1).numpy(), minlength=probs.shape[-1]) + 1e-6 * probs.mean(0).numpy()
    assert result["generated_text"] == tokenizer.decode([int(votes.argmax())], skip_special_tokens=True)


def test_each_members_generation_config_shapes_its_distribution(tmp_path):
    # The members' own settings (max_new_tokens, a repetition penalty, n-grams not to repeat): ensemble decoding
    # dropped the penalties, so even one-hot weights did not decode as that member alone, and every path asked for 20
    # tokens where transformers' pipeline reads the members' max_new_tokens
    tokenizer = decoder_tokenizer(tmp_path)
    members = build_members("llama-causallm", 2)
    for member, penalty in zip(members, (3.0, 1.5)):
        member.generation_config.update(max_new_tokens=5, repetition_penalty=penalty, no_repeat_ngram_size=1)
    wide = WideModel.from_models(members)
    for i, member in enumerate(members):
        expected = transformers.pipeline("text-generation", model=member, tokenizer=tokenizer)(
            PROMPTS[0], do_sample=False)[0]["generated_text"]
        weights = [1.0 if j == i else 0.0 for j in range(2)]
        one_hot = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="weighted", weights=weights)
        assert one_hot(PROMPTS[0])["generated_text"] == expected
    pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="none")
    with pytest.raises(ValueError, match=r"differ \(repetition_penalty: member 0 3\.0, member 1 1\.5\): each member's "
                                         r"own continuation.*assigned to pipe\.model\.generation_config"):
        pipe(PROMPTS[0])  # (generate's advice, to give it the settings, named no option the pipeline takes)
    members[1].generation_config.repetition_penalty = 3.0  # one generate runs one config: the members' must agree
    wide = WideModel.from_models(members)
    result = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="none")(PROMPTS[0])
    for i, member in enumerate(members):
        expected = transformers.pipeline("text-generation", model=member, tokenizer=tokenizer)(
            PROMPTS[0], do_sample=False)[0]["generated_text"]
        assert result["members"][i]["generated_text"] == expected


def test_members_that_end_at_different_tokens_are_refused_unless_the_call_gives_one_eos(tmp_path):
    # Ensemble decoding stopped at member 0's eos: one-hot weights on a member whose own eos is another token ran past
    # its end ('hated' alone; 'hated hated hated ...' wide)
    tokenizer = decoder_tokenizer(tmp_path)
    members = build_members("llama-causallm", 2)
    encoded = tokenizer(PROMPTS[0], return_tensors="pt")
    start = encoded["input_ids"].shape[-1]
    greedy = members[1].generate(**encoded, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    new = greedy[0, start:].tolist()
    eos = new[1]  # member 1 ends at its second token (or its first, the same)
    members[1].generation_config.eos_token_id = eos
    wide = WideModel.from_models(members)
    expected = transformers.pipeline("text-generation", model=members[1], tokenizer=tokenizer)(
        PROMPTS[0], max_new_tokens=NEW, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert expected == tokenizer.decode(new[:new.index(eos) + 1], skip_special_tokens=True)
    one_hot = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="weighted", weights=[0, 1])
    with pytest.raises(ValueError, match=rf"end at different tokens \(eos_token_id: member 0 \[1\], member 1 \[{eos}\]"):
        one_hot(PROMPTS[0], max_new_tokens=NEW)
    given = one_hot(PROMPTS[0], max_new_tokens=NEW, eos_token_id=eos, return_full_text=False, return_members=True)
    assert given["generated_text"] == expected
    assert given["members"][1]["generated_text"] == expected  # transformers' generate, given the eos


def test_the_members_max_length_bounds_each_prompt_as_transformers_does(tmp_path):
    # A generation config with max_length and no max_new_tokens: transformers' generate stops each prompt at max_length
    # tokens in all (and refuses a prompt of that length); the pipeline made 20 new tokens whatever the prompt
    tokenizer = decoder_tokenizer(tmp_path)
    members = build_members("llama-causallm", 2)
    for member in members:
        member.generation_config.update(max_length=12, eos_token_id=None)
    wide = WideModel.from_models(members)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[0].rsplit(" ", 2)[0]]
    expected = [[transformers.pipeline("text-generation", model=m, tokenizer=tokenizer)(
        p, do_sample=False, return_full_text=False)[0]["generated_text"] for p in prompts] for m in members]
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert len(set(lengths)) == 3 and max(lengths) < 12
    for combine in ("none", "weighted"):
        options = {"weights": [0, 1]} if combine == "weighted" else {}
        pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine=combine, **options)
        results = pipe(prompts, return_full_text=False, batch_size=3)  # one left-padded batch of three budgets
        for b, result in enumerate(results):
            if combine == "none":
                assert [m["generated_text"] for m in result["members"]] == [e[b] for e in expected]
            else:
                assert result["generated_text"] == expected[1][b]
        assert pipe(prompts[0], max_new_tokens=2, return_full_text=False) != results[0]  # the call's own wins
    long_prompt = " ".join([PROMPTS[0]] * 2)
    with pytest.raises(ValueError, match=r"end every sequence at max_length=12 tokens: pass max_new_tokens="):
        pipe(long_prompt)
    with pytest.raises(ValueError, match="max_length"):
        transformers.pipeline("text-generation", model=members[0], tokenizer=tokenizer)(long_prompt, do_sample=False)


# Member 1 (greedy, no end token) continues PROMPTS[1] (2 tokens) with 75 75 75 65 ..., and the third prompt (5 tokens)
# with 42 42 ...: ends the settings below make it meet early alone, and not in the batch (or the other way round)
@pytest.mark.parametrize("settings", [
    dict(max_length=14, forced_eos_token_id=1),  # each prompt's end token at its own budget's last step
    dict(max_new_tokens=8, min_length=7, eos_token_id=65),  # min_length counts a prompt's own tokens, not its padding
    dict(max_new_tokens=6, repetition_penalty=1.5, eos_token_id=42, pad_token_id=42),  # the padding, the end token,
], ids=["forced-eos", "min-length", "penalty"])                                        # penalised in the batch
def test_prompts_of_other_lengths_in_one_batch_continue_as_each_alone(tmp_path, settings):
    # transformers' processors read the left-padded batch whole: a prompt with a shorter budget lost its end token
    # (forced at the longest's end), min_length counted the padding as prompt, a repetition penalty penalised the
    # padding, here the end token: each prompt continued otherwise in the batch than alone (both paths)
    tokenizer = decoder_tokenizer(tmp_path)
    members = build_members("llama-causallm", 2)
    for member in members:
        member.generation_config.update(**settings)
        member.config.pad_token_id = settings.get("pad_token_id", member.config.pad_token_id)  # what a batch pads with
    wide = WideModel.from_models(members)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0].rsplit(" ", 2)[0]]
    expected = [[transformers.pipeline("text-generation", model=m, tokenizer=tokenizer)(
        p, do_sample=False, return_full_text=False)[0]["generated_text"] for p in prompts] for m in members]
    for combine in ("none", "weighted"):
        options = {"weights": [0, 1]} if combine == "weighted" else {}
        pipe = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine=combine, **options)
        results = pipe(prompts, return_full_text=False, batch_size=3)
        if combine == "none":
            assert [[r["members"][i]["generated_text"] for r in results] for i in range(2)] == expected
        else:
            assert [r["generated_text"] for r in results] == expected[1]


def test_each_members_continuation_ends_where_its_generate_does(tmp_path):
    # cut at an end token generate never stopped at (the model config's, where the generation configs have none):
    # 'movie' where transformers' pipeline gives eight tokens
    tokenizer = decoder_tokenizer(tmp_path)
    members = build_members("llama-causallm", 2)
    encoded = tokenizer(PROMPTS[0], return_tensors="pt")
    greedy = members[0].generate(**encoded, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    for member in members:
        member.generation_config.update(eos_token_id=None, max_new_tokens=8)
        member.config.eos_token_id = int(greedy[0, encoded["input_ids"].shape[-1] + 2])  # the model config names one
    wide = WideModel.from_models(members)
    expected = [transformers.pipeline("text-generation", model=m, tokenizer=tokenizer)(
        PROMPTS[0], do_sample=False, return_full_text=False)[0]["generated_text"] for m in members]
    got = pipeline("text-generation", model=wide, tokenizer=tokenizer, combine="none")(PROMPTS[0],
                                                                                      return_full_text=False)
    assert [m["generated_text"] for m in got["members"]] == expected and len(expected[0].split()) > 3  # past it


def test_members_that_ask_for_beam_search_are_refused_by_ensemble_decoding(tmp_path):
    tokenizer = decoder_tokenizer(tmp_path)
    members = build_members("llama-causallm", 2)
    members[1].generation_config.num_beams = 3
    wide = WideModel.from_models(members)
    with pytest.raises(ValueError, match=r"Member 1's generation config asks for beam search \(num_beams=3\)"):
        pipeline("text-generation", model=wide, tokenizer=tokenizer)(PROMPTS[0], max_new_tokens=NEW)
    members[0].generation_config.num_beams = 3  # each member's own beam search, as transformers' pipeline runs it
    result = pipeline("text-generation", model=WideModel.from_models(members), tokenizer=tokenizer, combine="none")(
        PROMPTS[0], max_new_tokens=NEW)
    for i, member in enumerate(members):
        expected = transformers.pipeline("text-generation", model=member, tokenizer=tokenizer)(
            PROMPTS[0], max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
        assert result["members"][i]["generated_text"] == expected
