"""hf_wide/generation_configs.py: which generation config each member runs. Members whose own differ are refused a
generate that would run one with another's settings; what is set on the wide model's is every member's."""

import copy

import pytest
import torch
import transformers
from conftest import CASES

from hf_wide import WideModel
from hf_wide.generation_configs import GenerationConfigsDiffer


def assert_each_members_own(wide, members, inputs) -> None:
    """The wide model's generate gives each member its own continuation, padded (with 0) past its end."""
    out = wide.generate(**inputs)
    for i, member in enumerate(members):
        alone = member.generate(**inputs)
        assert torch.equal(out[i, :, :alone.shape[-1]], alone) and (out[i, :, alone.shape[-1]:] == 0).all()


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
                                         r"1\.0, member 1 1\.8\).*member 1 would not continue as it does "
                                         r"alone") as caught:
        wide.generate(**inputs)
    assert isinstance(caught.value, GenerationConfigsDiffer) and caught.value.settings == ["max_new_tokens",
                                                                                           "repetition_penalty"]
    assert caught.value.differences == ("max_new_tokens: member 0 3, member 1 5; repetition_penalty: member 0 1.0, "
                                        "member 1 1.8")
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


def test_settings_that_generate_reads_alike_or_not_at_all_do_not_differ():
    # eos 5 and [5] end alike; sampling's settings are not read where no member samples. Both were refused.
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    for member, own in zip(members, (dict(eos_token_id=5, temperature=0.7, top_k=10, top_p=0.9),
                                     dict(eos_token_id=[5], temperature=1.3, top_k=20, top_p=0.5))):
        member.generation_config.update(pad_token_id=0, do_sample=False, max_new_tokens=4, **own)
    wide = WideModel.from_models(members)
    inputs = case.inputs(2, padded=True)
    assert_each_members_own(wide, members, inputs)
    with pytest.raises(ValueError, match=r"temperature: member 0 0\.7, member 1 1\.3; top_k: member 0 10, member 1 20; "
                                         r"top_p: member 0 0\.9, member 1 0\.5\)"):
        wide.generate(**inputs, do_sample=True)  # sampling reads them
    with pytest.raises(ValueError, match=r"\(top_k: member 0 10, member 1 20\)"):
        wide.generate(**inputs, penalty_alpha=0.6)  # contrastive search reads top_k
    with pytest.raises(ValueError, match=r"\(top_k: member 0 10, member 1 20; top_p"):
        wide.generate(**inputs, temperature=0.5)  # (Whisper samples as temperature= says, whatever do_sample is)


def test_the_same_end_tokens_in_another_order_agree_where_a_pad_token_is_set():
    # [1, 5] and [5, 1] end alike; the order names the pad token (its first) only where none is set. Refused.
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    for member, eos in zip(members, ([1, 5], [5, 1])):
        member.generation_config.update(eos_token_id=eos, pad_token_id=0, max_new_tokens=5)
    wide = WideModel.from_models(members)
    inputs = case.inputs(2, padded=True)
    assert_each_members_own(wide, members, inputs)
    with pytest.raises(ValueError, match=r"\(eos_token_id: member 0 \[1, 5\], member 1 \[5, 1\]"):
        wide.generate(**inputs, pad_token_id=None)  # (unset by the call: each member pads with its first)
    for member in members:
        member.generation_config.pad_token_id = None
    with pytest.raises(ValueError, match=r"\(eos_token_id: member 0 \[1, 5\], member 1 \[5, 1\]"):
        WideModel.from_models(members).generate(**inputs)
    assert len(WideModel.from_models(members).generate(**inputs, pad_token_id=0)) == 2


def test_what_is_set_on_the_wide_generation_config_is_every_members(tmp_path):
    # transformers' idiom, model.generation_config.max_new_tokens = ...: generate ran with it, but member(i) and the
    # saved repo did not have it (loaded back, it generated 20 tokens), and assigning a config raised
    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(2)]
    for member, own in zip(members, (3, 5)):
        member.generation_config.update(pad_token_id=0, eos_token_id=None, max_new_tokens=own)
    wide = WideModel.from_models(members)
    inputs = case.inputs(2, padded=True)
    with pytest.raises(ValueError, match="max_new_tokens: member 0 3, member 1 5"):
        wide.generate(**inputs)
    wide.generation_config.max_new_tokens = 4
    out = wide.generate(**inputs)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(**inputs, max_new_tokens=4))
        assert wide.member(i).generation_config.max_new_tokens == 4
    wide.save_pretrained(tmp_path / "fused")
    assert torch.equal(WideModel.from_pretrained(tmp_path / "fused").generate(**inputs), out)
    config = transformers.GenerationConfig(max_new_tokens=2, pad_token_id=0)
    wide.generation_config = config
    out = wide.generate(**inputs)
    for i, member in enumerate(members):
        assert torch.equal(out[i], member.generate(**inputs, generation_config=config))
        assert wide.member(i).generation_config.max_new_tokens == 2


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
