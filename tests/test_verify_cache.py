"""The cache path checked at fusion: a prefill and a decoding step with the cache, the wide model against every
member alone. Verification runs without a cache, so a state shared wrongly between members shows only here."""

import pytest
import torch
import transformers as tf
from packaging.version import Version
from families import randomise_
from lora_members import adapted

from hf_wide import WideModel
from hf_wide.model import WideValidationError
from hf_wide.primitives import member_cache
from hf_wide.verify_cache import cache_name

RENAMED = Version(tf.__version__).release[:2] >= (5, 24)  # transformers 5.24 calls every model's cache `cache`
MAMBA_CACHE = "cache" if RENAMED else "cache_params"


def mamba_members(count: int = 3) -> list:
    config = tf.MambaConfig(vocab_size=100, hidden_size=32, state_size=4, num_hidden_layers=2, pad_token_id=0)
    members = []
    for seed in range(count):
        model = tf.MambaForCausalLM(config).eval()
        randomise_(model, seed)
        members.append(model)
    return members


def test_a_cache_shared_wrongly_between_members_refuses_the_fusion(monkeypatch):
    # What hf-wide once did: every member's mixer handed the one cache, so member 1 read member 0's state as its
    # past. Exact without a cache; the check sees it and refuses, naming the member and the cache.
    monkeypatch.setattr(member_cache, "split", lambda cache, n, batch: [cache] * n)
    monkeypatch.setattr(member_cache, "merge", lambda cache, views: None)
    with pytest.raises(WideValidationError, match=rf"member-\d: with a cache \({MAMBA_CACHE}\).*differs"):
        WideModel.from_models(mamba_members())
    WideModel.from_models(mamba_members(), verify=False)  # unverified, nothing is checked


def test_members_read_from_files_are_checked_too(monkeypatch, tmp_path):
    # The streaming loader fills the wide model from the files and verifies it without from_models: same check
    paths = []
    for i, member in enumerate(mamba_members()):
        member.save_pretrained(tmp_path / str(i))
        paths.append(str(tmp_path / str(i)))
    WideModel.from_pretrained(paths)
    monkeypatch.setattr(member_cache, "split", lambda cache, n, batch: [cache] * n)
    monkeypatch.setattr(member_cache, "merge", lambda cache, views: None)
    with pytest.raises(WideValidationError, match=rf"with a cache \({MAMBA_CACHE}\).*differs"):
        WideModel.from_pretrained(paths)


def test_each_member_reads_its_own_state_with_a_cache():
    members = mamba_members()
    wide = WideModel.from_models(members)  # the check passed
    ids = torch.randint(2, 100, (2, 6))
    with torch.no_grad():
        got = wide(input_ids=ids, use_cache=True)
        step = wide(input_ids=ids[:, -1:], use_cache=True, **{MAMBA_CACHE: getattr(got, MAMBA_CACHE)}).logits
        for i, member in enumerate(members):
            own = member(input_ids=ids, use_cache=True)
            want = member(input_ids=ids[:, -1:], use_cache=True, **{MAMBA_CACHE: getattr(own, MAMBA_CACHE)}).logits
            assert (step[i] - want).abs().max().item() <= 1e-5


def test_the_cache_keyword_is_the_models_own():
    assert cache_name(mamba_members(1)[0]) == MAMBA_CACHE
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, intermediate_size=64))
    llama_cache = "cache" if RENAMED else "past_key_values"
    assert cache_name(llama) == llama_cache
    assert cache_name(adapted(llama, 0, r=2, target_modules=["q_proj"])) == llama_cache  # through PEFT
    assert cache_name(torch.nn.Linear(2, 2)) is None
