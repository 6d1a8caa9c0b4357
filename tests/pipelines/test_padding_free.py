"""Padding-free pipelines (hf_wide.packing, hf_wide.pipelines.packing): where the encoder runs on the batch's real
tokens only (and a text classifier's last layer on the texts' first tokens only), every member's answer still equals
that member run alone on its text alone; models whose encoder is not known to act per token, or whose packed probe
disagrees, run padded; nothing leaks into other calls."""

import threading

import pytest
import torch
import transformers
from families import VOCAB, randomise_
from text_members import bert_tokenizer, build_members

from hf_wide import WideModel
from hf_wide.packing import Packing, is_packing_hook
from hf_wide.pipelines import pipeline
from hf_wide.pipelines.packing import enable_first_tokens

SHORT, LONG = "great", "the big red dog ran over the small green mat and it was very good today yes"
TEXTS = [SHORT, LONG, "a cat sat", LONG + " again"]  # one batch, mostly padding in its short rows
DEBERTA_V2 = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 64, "num_labels": 3, "relative_attention": True,
              "pos_att_type": ["p2c", "c2p"], "position_buckets": 8, "max_relative_positions": 16}
FIRST_TOKEN_CASES = ["bert-seqcls", "roberta-seqcls", "xlm-roberta-seqcls", "electra-seqcls", "distilbert-seqcls"]
PACKED_CASES = ["bert-seqcls", "roberta-seqcls", "xlm-roberta-seqcls", "electra-seqcls", "distilbert-seqcls",
                "albert-seqcls", "deberta-seqcls", "deberta-v2-seqcls", "mpnet-seqcls"]  # DeBERTa: layer by layer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bert_tokenizer(tmp_path_factory.mktemp("tok"))


def shapes_of_calls(monkeypatch, method: str) -> list:
    """The shapes of the tensors passed to ``Packing.<method>`` from now on, as the calls come."""
    calls = []
    original = getattr(Packing, method)

    def recorded(self, x):
        calls.append(tuple(x.shape))
        return original(self, x)

    monkeypatch.setattr(Packing, method, recorded)
    return calls


@pytest.fixture
def packs(monkeypatch):
    """Counts the encoder states packed (one per padding-free encoder call)."""
    return shapes_of_calls(monkeypatch, "pack")


@pytest.fixture
def cuts(monkeypatch):
    """The shapes of the states of encoders whose last layer ran at the texts' first tokens: (N, B, D) each."""
    return shapes_of_calls(monkeypatch, "unpack_firsts")


def run_packed(pipe, packs) -> list:
    """The pipeline's answers for TEXTS, which it ran padding-free."""
    assert pipe.padding_free
    packs.clear()
    results = pipe(TEXTS)
    assert packs, "the batch was not packed"
    return results


def alone(member, tokenizer, text, key="logits"):
    with torch.no_grad():
        return member(**tokenizer(text, return_tensors="pt"))[key][0]


def assert_packed_answers_are_the_members(pipe, members, tokenizer, packs) -> None:
    """The text-classification pipeline ran TEXTS padding-free, and member i's answer on each text is member i's
    on that text alone."""
    results = run_packed(pipe, packs)
    for text, result in zip(TEXTS, results):
        for i, member in enumerate(members):
            expected = alone(member, tokenizer, text).softmax(-1)
            assert result["members"][i]["score"] == pytest.approx(expected.max().item(), abs=1e-5)


@pytest.mark.parametrize("case", PACKED_CASES)
def test_text_classification_runs_padding_free_and_equals_each_member_alone(case, tokenizer, packs):
    members = build_members(case, 3)
    pipe = pipeline("text-classification", model=WideModel.from_models(members), tokenizer=tokenizer, batch_size=4)
    assert_packed_answers_are_the_members(pipe, members, tokenizer, packs)


@pytest.mark.parametrize("case", FIRST_TOKEN_CASES)
def test_text_classification_runs_the_last_layer_at_first_tokens_and_equals_each_member_alone(case, tokenizer, packs,
                                                                                               cuts):
    members = build_members(case, 3)
    pipe = pipeline("text-classification", model=WideModel.from_models(members), tokenizer=tokenizer, batch_size=4)
    assert pipe.first_tokens
    cuts.clear()  # the probe's
    assert_packed_answers_are_the_members(pipe, members, tokenizer, packs)
    width = members[0].config.hidden_size if hasattr(members[0].config, "hidden_size") else members[0].config.dim
    assert cuts == [(3, len(TEXTS), width)]  # the last layer past its keys and values: one row per member and text


@pytest.mark.parametrize("case, reason", [
    ("albert-seqcls", "no encoder of it ends in a layer that can"),  # one layer shared by every step
    ("deberta-seqcls", "no encoder of it ends in a layer that can"),  # relative positions: packed layer by layer
    ("mpnet-seqcls", "no encoder of it ends in a layer that can"),  # hf-wide's rewrite of its encoder
])
def test_other_encoders_run_their_last_layer_at_every_token(case, reason, tokenizer, packs, cuts):
    members = build_members(case, 2)
    wide = WideModel.from_models(members)
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer, batch_size=4)
    assert pipe.padding_free and not pipe.first_tokens
    assert reason in wide.__dict__["_first_tokens_refusal"]
    run_packed(pipe, packs)
    assert not cuts


def test_outputs_of_every_token_keep_the_last_layer_at_every_token(tokenizer, cuts):
    """A bare encoder's last_hidden_state is every token's: its probe at first tokens disagrees; and pipelines that
    read every token never ask."""
    wide = WideModel.from_models(build_members("bert-base", 2))
    assert "at first tokens, its last_hidden_state differ" in enable_first_tokens(wide)
    cuts.clear()  # that probe's
    wide = WideModel.from_models(build_members("bert-tokcls", 2))
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, batch_size=4)
    assert pipe.padding_free and not pipe.first_tokens and "_first_tokens_refusal" not in wide.__dict__
    pipe(TEXTS)
    assert not cuts


def test_a_probe_at_first_tokens_that_disagrees_leaves_every_token_to_the_last_layer(tokenizer, packs, cuts,
                                                                                    monkeypatch):
    members = build_members("bert-seqcls", 2)
    wide = WideModel.from_models(members)
    original = Packing.unpack_firsts
    monkeypatch.setattr(Packing, "unpack_firsts", lambda self, x: 2 * original(self, x))  # [CLS] states changed
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer, batch_size=4)
    assert pipe.padding_free and not pipe.first_tokens
    assert "at first tokens, its logits differ from the padded forward's" in wide.__dict__["_first_tokens_refusal"]
    assert_packed_answers_are_the_members(pipe, members, tokenizer, packs)


def test_layer_norms_shared_by_every_member_run_on_the_packed_rows(tokenizer, packs):
    """Members whose layer norms are equal share one (the source's DebertaLayerNorm, on all rows): packed too."""
    members = build_members("deberta-seqcls", 2)
    for name, module in members[0].named_modules():
        if type(module).__name__ == "DebertaLayerNorm":
            members[1].get_submodule(name).load_state_dict(module.state_dict())
    wide = WideModel.from_models(members)
    assert "DebertaLayerNorm" in {type(m).__name__ for m in wide.model.modules()}  # shared, not a wide primitive
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer, batch_size=4)
    assert_packed_answers_are_the_members(pipe, members, tokenizer, packs)


@pytest.mark.parametrize("options", [
    {"conv_kernel_size": 3, "conv_act": "gelu"},  # DeBERTa-v2 xlarge's convolution after the first layer
    {"share_att_key": True, "position_buckets": 256, "norm_rel_ebd": "layer_norm"},  # DeBERTa-v3's
    {"pos_att_type": ["c2p"], "share_att_key": False},  # its own position keys, content-to-position only
])
def test_deberta_v2_variants_run_padding_free_and_equal_each_member_alone(options, tokenizer, packs):
    config = transformers.DebertaV2Config(**{**DEBERTA_V2, **options})
    members = []
    for seed in range(2):
        members.append(transformers.DebertaV2ForSequenceClassification(config).eval())
        randomise_(members[-1], seed)
    pipe = pipeline("text-classification", model=WideModel.from_models(members), tokenizer=tokenizer, batch_size=4)
    assert_packed_answers_are_the_members(pipe, members, tokenizer, packs)


@pytest.mark.parametrize("case", ["bert-tokcls", "electra-tokcls", "camembert-tokcls", "deberta-v2-tokcls"])
def test_token_classification_runs_padding_free_and_equals_each_member_alone(case, tokenizer, packs):
    members = build_members(case, 2)
    wide = WideModel.from_models(members)
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, batch_size=4, combine="none",
                    ignore_labels=[])
    results = run_packed(pipe, packs)
    for text, result in zip(TEXTS, results):
        for i, member in enumerate(members):
            probs = alone(member, tokenizer, text).softmax(-1)[1:-1]  # (T - 2, C): no [CLS], [SEP]
            scores = torch.tensor([entity["score"] for entity in result["members"][i]])
            assert scores == pytest.approx(probs.max(-1).values, abs=1e-5)


@pytest.mark.parametrize("case, pooling", [("bert-base", "mean"), ("bert-base", "cls"), ("bert-base", "none"),
                                           ("mpnet-base", "mean")])
def test_feature_extraction_of_a_bare_encoder_runs_padding_free(case, pooling, tokenizer, packs):
    members = build_members(case, 2)
    pipe = pipeline("feature-extraction", model=WideModel.from_models(members), tokenizer=tokenizer, batch_size=4,
                    pooling=pooling)
    results = run_packed(pipe, packs)
    for text, result in zip(TEXTS, results):
        for i, member in enumerate(members):
            states = alone(member, tokenizer, text, "last_hidden_state")  # (T, D)
            expected = {"mean": states.mean(0), "cls": states[0], "none": states}[pooling]
            assert torch.tensor(result["members"][i]) == pytest.approx(expected, abs=1e-5)


def test_a_model_with_a_head_asked_for_its_hidden_states_runs_padded(tokenizer):
    pipe = pipeline("feature-extraction", model=WideModel.from_models(build_members("bert-seqcls", 2)),
                    tokenizer=tokenizer)
    assert not pipe.padding_free  # every layer's states are recorded, and those are not unpacked


@pytest.mark.parametrize("case, reason", [
    ("xmod-seqcls", "has no encoder of a family known to act per token"),
    ("llama-seqcls", "has no encoder of a family known to act per token"),
])
def test_other_families_run_padded_and_say_why(case, reason, tokenizer, packs):
    members = build_members(case, 2)
    wide = WideModel.from_models(members)
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer, batch_size=4)
    assert not pipe.padding_free
    assert reason in wide.__dict__["_packing_refusal"]
    results = pipe(TEXTS)
    assert not packs
    for i, member in enumerate(members):
        expected = alone(member, tokenizer, TEXTS[0]).softmax(-1)
        assert results[0]["members"][i]["score"] == pytest.approx(expected.max().item(), abs=1e-5)


def test_an_encoder_that_chunks_its_feed_forward_runs_padded(tokenizer):
    members = build_members("bert-seqcls", 2)
    for member in members:
        for layer in member.bert.encoder.layer:
            layer.chunk_size_feed_forward = 2
    wide = WideModel.from_models(members)
    assert not pipeline("text-classification", model=wide, tokenizer=tokenizer).padding_free
    assert "chunks its feed-forward" in wide.__dict__["_packing_refusal"]


def test_a_probe_that_disagrees_leaves_the_model_padded_and_without_hooks(tokenizer, monkeypatch):
    wide = WideModel.from_models(build_members("bert-seqcls", 2))
    original = Packing.unpack
    monkeypatch.setattr(Packing, "unpack", lambda self, x: original(self, x).roll(1, dims=1))  # tokens moved
    assert not pipeline("text-classification", model=wide, tokenizer=tokenizer).padding_free
    assert "differ from the padded forward's" in wide.__dict__["_packing_refusal"]
    hooks = [h for m in wide.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert not any(is_packing_hook(h) for h in hooks)


def test_the_model_itself_and_its_members_stay_as_they_were(tokenizer):
    members = build_members("bert-tokcls", 2)
    wide = WideModel.from_models(members)
    assert pipeline("token-classification", model=wide, tokenizer=tokenizer).padding_free
    batch = tokenizer([SHORT, LONG], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = wide(**batch).logits  # (N, B, T, C): every position, the padded ones too
        for i, member in enumerate(members):
            assert logits[i] == pytest.approx(member(**batch).logits, abs=1e-5)
    copy = wide.member(0)
    hooks = [h for m in copy.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert not any(is_packing_hook(h) for h in hooks)


def test_a_padding_free_pipeline_and_plain_calls_in_other_threads_do_not_mix(tokenizer):
    members = build_members("bert-tokcls", 2)
    wide = WideModel.from_models(members)
    pipe = pipeline("token-classification", model=wide, tokenizer=tokenizer, batch_size=4, combine="none",
                    ignore_labels=[])
    batch = tokenizer([SHORT, LONG], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected_plain = wide(**batch).logits
    expected_pipe = pipe(TEXTS)
    errors = []

    def plain():
        with torch.no_grad():
            for _ in range(15):
                if not torch.allclose(wide(**batch).logits, expected_plain, atol=1e-5):
                    errors.append("a plain call saw packed states")

    def padding_free():
        for _ in range(15):
            if pipe(TEXTS) != expected_pipe:
                errors.append("a padding-free call changed")

    threads = [threading.Thread(target=plain), threading.Thread(target=padding_free)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


@pytest.mark.parametrize("targets, fused", [(["dense"], False), (["query", "key", "value", "dense"], True),
                                            (["query", "key", "value", "dense"], False)])
def test_lora_members_run_padding_free_with_every_adapter(targets, fused, tmp_path, tokenizer, packs, cuts,
                                                          monkeypatch):
    """Adapted q, k and v fused into the wide attention (``fused``), or not (on CPU, by default): then the attention
    is transformers' own module around wide LoRA layers, and one shared by every member where q, k and v are not
    adapted; those run padded inside the packed encoder."""
    from conftest import CASES
    from lora_members import alone as peft_alone
    from lora_members import save_adapter

    from hf_wide.blocks import lora_projections

    monkeypatch.setattr(lora_projections, "FUSE_ON_CPU", fused)
    case = CASES["bert-seqcls"]
    case.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(case, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                             target_modules=targets, modules_to_save=["classifier"], task_type="SEQ_CLS")
                for seed in range(2)]
    pipe = pipeline("text-classification", model=adapters, tokenizer=tokenizer, batch_size=4)
    kinds = {type(m).__name__ for m in pipe.model.modules()}
    assert ("WideAttention" in kinds) == fused and ("BertSelfAttention" in kinds) == (not fused)
    assert pipe.first_tokens == fused  # the last layer at first tokens: around a fused attention only
    cuts.clear()  # the probe's
    members = [peft_alone(case, tmp_path / "base", adapter) for adapter in adapters]
    assert_packed_answers_are_the_members(pipe, members, tokenizer, packs)
    assert len(cuts) == fused


@pytest.mark.parametrize("case, targets, attention", [
    ("deberta-v2-seqcls", ["query_proj", "value_proj", "dense"], "DisentangledSelfAttention"),
    ("mpnet-seqcls", ["q", "v", "o"], "MPNetSelfAttention"),
])
def test_attentions_around_lora_layers_run_padded_in_packed_encoders(case, targets, attention, tmp_path, tokenizer,
                                                                      packs):
    """DeBERTa-v2's and MPNet's attentions around adapted projections are the model's own modules: they run padded
    in a packed layer (DeBERTa-v2) or encoder (MPNet)."""
    from conftest import CASES
    from lora_members import alone as peft_alone
    from lora_members import save_adapter

    case = CASES[case]
    case.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(case, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8,
                             target_modules=targets, modules_to_save=["classifier"], task_type="SEQ_CLS")
                for seed in range(2)]
    pipe = pipeline("text-classification", model=adapters, tokenizer=tokenizer, batch_size=4)
    assert attention in {type(m).__name__ for m in pipe.model.modules()}
    members = [peft_alone(case, tmp_path / "base", adapter) for adapter in adapters]
    assert_packed_answers_are_the_members(pipe, members, tokenizer, packs)
