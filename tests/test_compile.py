"""torch.compile: no graph breaks for the BERT, DeBERTa, Llama and T5 families, outputs equal to eager, and one
graph for every batch size > 1 and sequence length."""

import warnings

import pytest
import torch
import transformers as tf
from conftest import CASES
from oracle import TOLERANCE, main_output
from torch._dynamo.testing import CompileCounter

from hf_wide import WideModel
from hf_wide.verify_cache import cache_name


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case_id", [
    "bert-seqcls", "roberta-tokcls", "deberta-v2-seqcls", "llama-causallm", "qwen2-causallm",
    "t5-encoder",  # its first attention vectorised (vmap): a mask every member shares is no data-dependent branch
])
def test_no_graph_breaks(fused, case_id):
    _, wide = fused(case_id)
    inputs = CASES[case_id].inputs(2, padded=True)
    with torch.no_grad():
        explanation = torch._dynamo.explain(wide)(**inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# T5's first attention is vectorised: under vmap its relative-position embedding and attention fixed the length and
# the batch in the graph (a graph per shape); compiled, a vectorised module runs its members in a loop
@pytest.mark.parametrize("case_id", ["bert-seqcls", "llama-causallm", "t5-encoder"])
def test_lengths_and_batch_sizes_share_one_graph(case_id):
    case = CASES[case_id]
    members = [case.build(seed) for seed in range(2)]
    counter = CompileCounter()
    wide = WideModel.from_models(members).compile(backend=counter)
    with torch.no_grad():
        for batch, length in [(2, 5), (3, 9), (2, 16), (4, 11)]:
            ids = torch.randint(2, 100, (batch, length))
            out = main_output(wide(input_ids=ids, attention_mask=torch.ones_like(ids)))
            alone = main_output(members[1](input_ids=ids, attention_mask=torch.ones_like(ids)))
            assert (out[1] - alone).abs().max() <= TOLERANCE
    assert counter.frame_count == 1


def test_t5s_decoder_over_its_cache_shares_one_graph_across_batch_sizes():
    """T5 given ``decoder_input_ids`` makes a cache, which its first (vectorised) attention takes member by member:
    the members' rows were taken by a ``slice`` object, which fixed the batch in the graph (a graph per batch size,
    and past 8 of them, eager)."""
    config = tf.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                         decoder_start_token_id=0, pad_token_id=0)
    members = []
    for seed in range(2):
        torch.manual_seed(seed)
        members.append(tf.T5ForConditionalGeneration(config).eval())
    counter = CompileCounter()
    wide = WideModel.from_models(members).compile(backend=counter)
    with torch.no_grad():
        for batch in (2, 3, 4):
            inputs = {"input_ids": torch.randint(2, 100, (batch, 7)),
                      "decoder_input_ids": torch.randint(2, 100, (batch, 5))}
            out = wide(**inputs).logits
            for i, member in enumerate(members):
                assert (out[i] - member(**inputs).logits).abs().max() <= TOLERANCE
    assert counter.frame_count == 1


def test_compiling_a_vectorised_module_warns_of_nothing_of_ours(monkeypatch):
    # Each compile of a model with a vectorised module warned that dynamo traced through an lru_cache of hf-wide's
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())  # (dynamo warns of each thing once a process)
    case = CASES["t5-encoder"]
    wide = WideModel.from_models([case.build(seed) for seed in range(2)]).compile(backend=CompileCounter())
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        wide(**case.inputs(2, padded=True))
    ours = [str(w.message) for w in caught if "hf_wide" in str(w.message) or "hf_wide" in w.filename]
    assert not ours


STATE_SPACE = {
    "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(vocab_size=100, hidden_size=32, state_size=4,
                                                        num_hidden_layers=1, pad_token_id=0)),
    "mamba2": lambda: tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=100, hidden_size=32, state_size=8,
                                                           num_hidden_layers=1, num_heads=8, head_dim=8, n_groups=1,
                                                           chunk_size=4, pad_token_id=0)),
}


@pytest.mark.parametrize("name", list(STATE_SPACE))
def test_a_cache_run_member_by_member_compiles_whole(name):
    # Mamba's mixers run member by member on their rows of the cache; folding the members' states back read each
    # state's storage address, which dynamo cannot trace: a graph break per layer and step (Mamba2: 17 of them; one
    # layer here, which breaks as surely and traces in half the time)
    members = []
    for seed in range(2):
        torch.manual_seed(seed)
        members.append(STATE_SPACE[name]().eval())
    wide = WideModel.from_models(members)
    ids = torch.randint(5, 100, (2, 7))
    prefill, cache = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": True}, cache_name(members[0])
    with torch.no_grad():
        wide.compile(backend="aot_eager", fullgraph=True)  # a graph break raises: the prefill and the step
        got = wide(**prefill)
        step = {"input_ids": ids[:, -1:], "attention_mask": torch.ones(2, 8, dtype=ids.dtype), "use_cache": True}
        got_next = wide(**step, **{cache: got[cache]}).logits
        for i, member in enumerate(members):
            want = member(**prefill)
            assert (got.logits[i] - want.logits).abs().max() <= TOLERANCE
            assert (got_next[i] - member(**step, **{cache: want[cache]}).logits).abs().max() <= TOLERANCE


def test_inductor_output_equals_eager():
    case = CASES["bert-seqcls"]
    members = [case.build(seed) for seed in range(3)]
    wide = WideModel.from_models(members)
    inputs = case.inputs(3, padded=True)
    with torch.no_grad():
        eager = wide(**inputs).logits
        compiled = wide.compile()(**inputs).logits
    assert (compiled - eager).abs().max() <= TOLERANCE


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_compiled_vectorised_module_gives_each_member_its_own_output(dynamic):
    # T5's first attention is vectorised: compiled with dynamic shapes, it runs member by member; with fixed shapes,
    # under vmap, where its mask (the same for every member) goes in batched
    case = CASES["t5-encoder"]
    members = [case.build(seed) for seed in range(2)]
    wide = WideModel.from_models(members).compile(backend="aot_eager", dynamic=dynamic)
    with torch.no_grad():
        for batch in (2, 3):
            inputs = case.inputs(batch, padded=True)
            out = main_output(wide(**inputs))
            for i, member in enumerate(members):
                assert (out[i] - main_output(member(**inputs))).abs().max() <= TOLERANCE


def test_a_compiled_whole_model_takes_another_batch_of_images_than_of_texts():
    """CLIP members whose ``logit_scale`` differs run whole, vectorised; compiled, member by member, where 3 texts
    beside 2 images raised ("a tensor of shape (2, 3) for 3 rows: ... no batch dim"): its outputs have the images'
    batch, which eager (vmap) and unfolding take."""
    text = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8)
    members = []
    for seed in range(2):
        torch.manual_seed(seed)
        member = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
        with torch.no_grad():
            member.logit_scale.fill_(2.0 + seed)
        members.append(member)
    wide = WideModel.from_models(members).compile(backend="eager")
    torch.manual_seed(0)
    inputs = {"input_ids": torch.randint(2, 100, (3, 7)), "pixel_values": torch.randn(2, 3, 32, 32)}
    with torch.no_grad():
        out = wide(**inputs)
        for i, member in enumerate(members):
            for key in ("logits_per_image", "text_embeds", "image_embeds"):
                assert (out[key][i] - member(**inputs)[key]).abs().max() <= TOLERANCE, key


def test_code_after_a_graph_break_still_knows_the_forwards_rows(monkeypatch):
    # The rows were set on a threading.local in compiled code, which dynamo dropped at a graph break: the embeddings
    # after it expanded BERT's (1, T) positions to N rows, not N*B, and the compile failed (XLM breaks at .item())
    import transformers.models.bert.modeling_bert as modeling_bert

    case = CASES["bert-seqcls"]
    members = [case.build(seed) for seed in range(3)]
    wide = WideModel.from_models(members)
    forward = modeling_bert.BertEmbeddings.forward

    def breaking(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_bert.BertEmbeddings, "forward", breaking)
    wide.compile(backend="eager", dynamic=False)  # (dynamic shapes across the break: minutes of sympy)
    inputs = case.inputs(2, padded=True)
    with torch.no_grad():
        out = wide(**inputs).logits
        for i, member in enumerate(members):
            assert (out[i] - member(**inputs).logits).abs().max() <= TOLERANCE


def test_a_compiled_model_gives_and_trains_each_members_loss():
    # The split of the loss by member is a TorchFunctionMode, which code compiled around it did not apply: the loss
    # came out over every member's rows, and was refused. That call now runs eagerly, the rest compiled.
    case = CASES["bert-seqcls"]
    members = [case.build(seed) for seed in range(2)]
    inputs, labels = case.inputs(3, padded=True), torch.tensor([0, 2, 1])
    eager, compiled = (WideModel.from_models(members, share_identical=False) for _ in range(2))
    compiled.compile(backend="aot_eager")
    losses = []
    for wide in (eager, compiled):
        loss = wide(**inputs, labels=labels).loss
        loss.sum().backward()
        losses.append(loss.detach())
    with torch.no_grad():
        want = torch.stack([m(**inputs, labels=labels).loss for m in members])
    assert torch.allclose(losses[0], want, atol=TOLERANCE) and torch.allclose(losses[1], want, atol=TOLERANCE)
    grads = [{n: p.grad for n, p in wide.named_parameters() if p.grad is not None} for wide in (eager, compiled)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]) <= TOLERANCE


def test_a_copy_of_a_compiled_model_runs_its_own_weights():
    # torch's modules drop what compile() made when copied or pickled; the wide model kept it, so a copy ran the
    # original's compiled code (and weights: 2.9 off after loading others into the copy), and torch.save failed
    import copy
    import io

    case = CASES["llama-causallm"]
    members = [case.build(seed) for seed in range(4)]
    wide = WideModel.from_models(members[:2]).compile(backend="eager")
    inputs = case.inputs(2, padded=True)
    with torch.no_grad():
        wide(**inputs)
        twin = copy.deepcopy(wide)
        twin.load_state_dict(WideModel.from_models(members[2:]).state_dict())
        got = twin(**inputs).logits
        for i, member in enumerate(members[2:]):
            assert (got[i] - member(**inputs).logits).abs().max() <= TOLERANCE
    torch.save(wide, io.BytesIO())


def test_generate_on_a_compiled_model_says_it_steps_eagerly():
    # compile() compiles the wide forward, which generate does not call: it ran eagerly without a word
    members = [CASES["llama-causallm"].build(seed) for seed in range(2)]
    wide = WideModel.from_models(members)
    inputs = CASES["llama-causallm"].inputs(1, padded=False)
    expected = wide.generate(**inputs, max_new_tokens=3, do_sample=False)
    wide.compile(backend=CompileCounter())
    with pytest.warns(UserWarning, match="generate steps the members' model eagerly"):
        assert torch.equal(wide.generate(**inputs, max_new_tokens=3, do_sample=False), expected)
