"""Verify, don't trust: members that are not what a builder knows (PEFT LoRA layers, forward hooks, weight-norm
parametrizations, attributes that differ) and builders that are wrong are either exact or run per member, with
the reason in the plan. Never a wrong number."""

import peft
import pytest
import torch
import transformers
from conftest import CASES
from oracle import TOLERANCE, max_member_error
from torch import nn

from hf_wide import Kind, WideModel
from hf_wide.blocks.base import WideBlock
from hf_wide.primitives.base import WideModule
from hf_wide.registry import register_block, register_wide

LLAMA = CASES["llama-causallm"]


def lora_members(n=3, alphas=(8, 8, 8), **config) -> list[nn.Module]:
    """Adapters of one Llama base: LoRA on q_proj and v_proj, each member's own random A and B."""
    members = []
    for seed, alpha in zip(range(n), alphas):
        lora = peft.LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj"], **config)
        model = peft.get_peft_model(LLAMA.build(0), lora)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        members.append(model.eval())
    return members


def test_lora_wrapped_projections_are_not_fused_into_an_attention_block():
    members = lora_members()
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(3, padded=True)) <= TOLERANCE
    attentions = [e for e in wide.plan.entries.values() if e.module_class == "LlamaAttention"]
    assert not attentions  # no block: q_proj and v_proj are LoRA layers, k_proj is not
    assert any("q_proj" in w and "not all LoRA layers" in w for w in wide.plan.warnings)


def test_lora_members_loaded_with_peft_from_pretrained(tmp_path):
    members = []
    for i, adapter in enumerate(lora_members()):
        adapter.save_pretrained(tmp_path / f"adapter{i}")
        members.append(peft.PeftModel.from_pretrained(LLAMA.build(0), tmp_path / f"adapter{i}").eval())
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE


def test_lora_scaling_that_differs_is_each_members_own():
    # lora_alpha differs, so PEFT's per-layer `scaling` does: member 0's must not serve all. The LoRA block takes
    # each member's; a hook on one member's layer keeps that layer as each member's own code instead.
    members = lora_members(alphas=(4, 8, 16))
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    assert not wide.plan.fallbacks
    assert {e.wide_class for e in wide.plan.by_kind(Kind.BLOCK)} == {"WideLoraLinear"}
    members[1].base_model.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: out)
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(2, padded=True)) <= TOLERANCE
    (loop,) = wide.plan.loops
    assert loop.name.endswith("layers.0.self_attn.q_proj") and "forward hook" in loop.reason


def test_forward_hooks_run_per_member():
    members = [LLAMA.build(seed) for seed in range(3)]
    for i, member in enumerate(members):  # each member's own hook on one projection and one whole layer
        member.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out, s=1.0 + i: out * s)
        member.model.layers[1].register_forward_pre_hook(lambda m, args, s=0.5 + i: (args[0] * s, *args[1:]))
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, LLAMA.inputs(3, padded=True)) <= TOLERANCE
    reasons = {e.name: e.reason for e in wide.plan.fallbacks}
    assert "forward hook" in reasons["model.layers.0.mlp.down_proj"]
    assert "forward hook" in reasons["model.layers.1"]


def weight_normed(dims=(0, 0, 0)) -> list[nn.Module]:
    members = [CASES["bert-seqcls"].build(seed) for seed in range(len(dims))]
    for member, dim in zip(members, dims):
        layer = member.bert.encoder.layer[0]
        torch.nn.utils.parametrizations.weight_norm(layer.attention.self.query, dim=dim)
        torch.nn.utils.parametrizations.weight_norm(layer.output.dense)
    return members


def test_weight_norm_parametrizations_are_vectorised():
    # The same parametrizations in every member: member 0's code computes each member's weight from its tensors.
    members = weight_normed()
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE
    parametrized = [e for e in wide.plan.fallbacks if "parametrized" in e.reason]
    assert parametrized and all(e.kind == Kind.VECTORISED for e in parametrized)
    assert not wide.plan.loops


def test_weight_norm_parametrizations_held_alike_are_shared():
    # A parametrized module whose tensors every member holds alike computes one weight for all: shared, one copy
    # (it ran vectorised, its tensors stacked N times); one whose members differ is vectorised still.
    members = weight_normed()
    for member in members[1:]:
        member.bert.encoder.layer[0].attention.self.query.load_state_dict(
            members[0].bert.encoder.layer[0].attention.self.query.state_dict())
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE
    query = "bert.encoder.layer.0.attention.self.query"
    kinds = {e.fqn: e.kind for e in wide.plan.entries.values()}
    assert kinds[query] == kinds[f"{query}.parametrizations.weight"] == Kind.SHARED
    assert kinds["bert.encoder.layer.0.output.dense"] == Kind.VECTORISED
    assert wide.model.get_submodule(query).parametrizations.weight.original1.shape == (32, 32)  # no member dim
    apart = WideModel.from_models(members, share_identical=False)  # to be trained apart: every member's own
    assert {e.fqn: e.kind for e in apart.plan.entries.values()}[query] == Kind.VECTORISED


class Scaled(nn.Module):
    """A parametrization with a plain attribute of its own."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, weight):
        return weight * self.factor


def test_parametrizations_that_differ_run_as_each_members_own_code():
    members = [CASES["bert-seqcls"].build(seed) for seed in range(3)]
    for member, factor in zip(members, (1.0, 1.0, 2.0)):  # member 2's parametrization doubles the weight
        torch.nn.utils.parametrize.register_parametrization(member.bert.encoder.layer[0].output.dense, "weight",
                                                            Scaled(factor))
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE
    loop = {e.name: e for e in wide.plan.loops}["bert.encoder.layer.0.output.dense"]
    assert "'factor' differs" in loop.reason and loop.wide_class == "PerMemberFallback"


def test_a_loop_over_stacked_tensors_holds_one_tensor_per_source_tensor():
    # OLMoE's experts route tokens by value: a loop, but of member 0's code over each member's stacked tensors.
    config = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, pad_token_id=0)
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(transformers.OlmoeForCausalLM(config).eval())
    wide = WideModel.from_models(members)
    ids = torch.randint(1, 64, (2, 7))
    assert max_member_error(wide, members, {"input_ids": ids}) <= TOLERANCE
    assert wide.plan.loops and all(e.wide_class == "VectorisedFallback" for e in wide.plan.loops)
    assert len(list(wide.model.parameters())) == len(list(members[0].parameters()))
    for i, member in enumerate(members):  # and each member comes back whole
        assert all(torch.equal(a, b) for a, b in zip(wide.member(i).state_dict().values(),
                                                     member.state_dict().values()))


def test_a_hyper_parameter_that_differs_runs_per_member():
    members = [CASES["bert-seqcls"].build(seed) for seed in range(3)]
    members[2].bert.embeddings.LayerNorm.eps = 1e-2
    wide = WideModel.from_models(members)
    assert max_member_error(wide, members, CASES["bert-seqcls"].inputs(3, padded=True)) <= TOLERANCE
    assert "'eps' differs" in {e.name: e.reason for e in wide.plan.fallbacks}["bert.embeddings.LayerNorm"]


# ---------------------------------------------------------------- builders that are wrong
class Gain(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return x * self.weight


@register_wide(Gain)
class ForgetfulGain(WideModule):
    """Wrong on purpose: forgets the gain."""

    def forward(self, x):
        return x


class Pair(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@register_block(Pair)
class BiaslessPair(WideBlock):
    """Wrong on purpose: drops b's bias."""

    def build(self, mods):
        self.a = nn.Parameter(torch.stack([m.a.weight.detach() for m in mods]))
        self.a_bias = nn.Parameter(torch.stack([m.a.bias.detach() for m in mods]))
        self.b = nn.Parameter(torch.stack([m.b.weight.detach() for m in mods]))

    def forward(self, x):  # (N*B, D)
        n = self.num_members
        h = torch.relu(torch.baddbmm(self.a_bias.unsqueeze(1), x.view(n, -1, x.shape[-1]), self.a.transpose(1, 2)))
        return torch.bmm(h, self.b.transpose(1, 2)).reshape(x.shape)


class Net(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.gain, self.pair, self.head = Gain(dim), Pair(dim), nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.pair(self.gain(x)))


@pytest.fixture
def nets():
    torch.manual_seed(0)
    return [Net().eval() for _ in range(3)]


def test_wrong_builders_are_moved_down_the_ladder(nets):
    wide = WideModel.from_models(nets, torch.randn(2, 4))
    entries = wide.plan.entries
    assert entries["gain"].kind == Kind.VECTORISED and "ForgetfulGain disagreed" in entries["gain"].reason
    assert "pair" not in entries and entries["pair.b"].kind == Kind.PRIMITIVE  # the block, by its parts
    assert any("BiaslessPair disagreed" in w for w in wide.plan.warnings)
    x = torch.randn(5, 4)
    with torch.no_grad():
        out = wide(x)
        assert max((out[i] - net(x)).abs().max().item() for i, net in enumerate(nets)) <= TOLERANCE


def test_unverified_wrong_builders_give_wrong_numbers(nets):
    # The check above is what stands between a wrong builder and a wrong number.
    wide = WideModel.from_models(nets, torch.randn(2, 4), verify=False)
    assert wide.plan.entries["gain"].kind == Kind.PRIMITIVE and wide.plan.entries["pair"].kind == Kind.BLOCK
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert (wide(x)[1] - nets[1](x)).abs().max() > 1e-3
    with pytest.raises(RuntimeError, match="differs from the member run alone"):  # validate's whole-output check
        WideModel.from_models(nets, torch.randn(2, 4), validate=True, verify=False)


class Fault(Gain):
    """A gain whose wide class loses the device: a CUDA device-side assert, raised as torch raises it."""


@register_wide(Fault)
class DeviceAssert(WideModule):
    def forward(self, x):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")


def test_a_lost_device_is_raised_not_worked_around():
    # After a device-side assert every later call on the device fails: no strategy further down could be checked, and
    # the error would surface later, somewhere else
    torch.manual_seed(0)
    faults = [nn.Sequential(Fault(4), nn.Linear(4, 2)).eval() for _ in range(2)]
    with pytest.raises(torch.AcceleratorError, match="device-side assert"):
        WideModel.from_models(faults, torch.randn(2, 4))


# ---------------------------------------------------------------- members checked a group at a time
class Tilt(Gain):
    """A gain with a (wrong) wide class of its own."""


@register_wide(Tilt)
class LastMemberForgotten(WideModule):
    """Wrong on purpose, for the last member only: its rows come back untilted."""

    def forward(self, x):  # (N*B, D)
        n = self.num_members
        weight = torch.cat([self.weight[:-1], torch.ones_like(self.weight[-1:])])  # (N, D)
        return (x.view(n, -1, x.shape[-1]) * weight.unsqueeze(1)).reshape(x.shape)


@pytest.mark.parametrize("share", [0.0, 1e9], ids=["one-member-a-forward", "all-at-once"])
def test_a_builder_wrong_for_one_member_is_found_in_its_group(monkeypatch, share):
    from hf_wide import verify

    monkeypatch.setattr(verify, "RECORD_SHARE", share)
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 4), Tilt(4), nn.Linear(4, 2)).eval() for _ in range(3)]
    wide = WideModel.from_models(members, torch.randn(2, 4))
    assert "LastMemberForgotten disagreed" in wide.plan.entries["1"].reason
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert max((wide(x)[i] - m(x)).abs().max().item() for i, m in enumerate(members)) <= TOLERANCE


class Shift(nn.Module):
    """No builder knows it: vectorised, so its members' outputs are recorded (built modules are checked where they
    run, hf_wide.verify_here)."""

    def __init__(self, dim):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return x + self.bias


@pytest.mark.parametrize("n, share, expected", [
    (3, 0.0, [0, "wide", 1, "wide", 2, "wide"]),
    (3, 1e9, [0, 1, 2, "wide"]),
    (8, 0.0, [0, 1, "wide", 2, 3, "wide", 4, 5, "wide", 6, 7, "wide"]),  # four groups at most
], ids=["one-member-a-forward", "all-at-once", "four-forwards-at-most"])
def test_members_outputs_are_recorded_a_group_at_a_time(monkeypatch, n, share, expected):
    """As many members' recorded module outputs as fit in RECORD_SHARE of the wide model's bytes are held at once
    (but in MAX_GROUPS groups at most), each group checked in a wide forward of its own."""
    from hf_wide import verify

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), Shift(8), nn.Linear(8, 2)).eval() for _ in range(n)]
    index, events = {id(m): i for i, m in enumerate(members)}, []
    recorded, forward = verify._recorded, WideModel.forward

    def spy_recorded(reference, *args):
        events.append(index[id(reference)])
        return recorded(reference, *args)

    def spy_forward(self, *args, **kwargs):
        events.append("wide")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(verify, "RECORD_SHARE", share)
    monkeypatch.setattr(verify, "_recorded", spy_recorded)
    monkeypatch.setattr(WideModel, "forward", spy_forward)
    wide = WideModel.from_models(members, torch.randn(2, 4))
    assert events == expected
    assert not wide.plan.loops


def test_the_budget_counts_a_storage_that_tensors_share_once():
    from hf_wide.verify import held_bytes

    stacked = torch.zeros(2, 3, 4)  # two members' adapters as views of one stacked tensor
    module = nn.Module()
    module.a, module.b = nn.Parameter(stacked[0]), nn.Parameter(stacked[1])
    module.register_buffer("c", torch.zeros(5))
    assert held_bytes(module) == stacked.nbytes + 5 * 4


def test_a_groups_outputs_of_a_module_are_let_go_once_compared(monkeypatch):
    """The members' recorded outputs of a module are dropped as soon as the wide forward has compared them, so
    that the rest of that forward reuses their memory; the caller's recorded calls are never what is dropped from."""
    from hf_wide import verify

    torch.manual_seed(0)
    members = [nn.Sequential(Shift(4), nn.ReLU(), Shift(4)).eval() for _ in range(2)]
    groups, recorded, seen = [], verify._recorded, []

    def spy_recorded(reference, calls, *args):
        group = recorded(reference, calls, *args)
        assert group is not calls
        groups.append(group)
        return group

    def before_last_layer(module, args):  # the wide forward is past the first layer: its outputs are compared
        seen.append([("0" in group, "2" in group) for group in groups])

    monkeypatch.setattr(verify, "_recorded", spy_recorded)
    monkeypatch.setattr(verify, "RECORD_SHARE", 1e9)  # one group: both members
    wide = WideModel.from_models(members, torch.randn(2, 4), verify=False)
    wide.model[2].register_forward_pre_hook(before_last_layer)
    failures, _, _ = verify.verify_modules(wide, ["0", "2"], members, (torch.randn(2, 4),), {})
    assert not failures
    assert seen == [[(False, True), (False, True)]]
    assert all("0" not in group and "2" not in group for group in groups)


def test_a_module_a_member_never_runs_on_the_sample_moves_down_instead_of_failing_the_fusion():
    # Switch Transformers' experts each run on the tokens routed to them. Looking for what disagreed, verification
    # asked every member's recording for an expert's activation that one member had routed no token to: KeyError.
    config = transformers.SwitchTransformersConfig(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, num_heads=4, num_experts=4, relative_attention_num_buckets=8, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0)
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
        for param in model.parameters():
            param.data.normal_(0, 0.1)
        members.append(model)
    wide = WideModel.from_models(members)
    for batch, length in [(1, 5), (3, 9)]:
        inputs = {"input_ids": torch.randint(3, 100, (batch, length)),
                  "decoder_input_ids": torch.randint(3, 100, (batch, 3))}
        assert max_member_error(wide, members, inputs) <= TOLERANCE
