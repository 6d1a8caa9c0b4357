"""The tracer and planner on plain torch modules: raw parameters, row mixing, export failures."""

import copy
from typing import NamedTuple

import pytest
import torch
from torch import nn

from hf_wide import Kind, WideModel, WideValidationError


class RawScale(nn.Module):
    """A raw nn.Parameter read in forward: no builder can know what it means."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x) * self.scale


class CentreOverBatch(nn.Module):
    """Subtracts the batch mean: mixes rows, so it must run per member."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.proj(x)
        return h - h.mean(0)


class RowsByRows(nn.Module):
    """Scores every row against every row (a contrastive model's texts by its images): ``(B, D) @ (D, B)``."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.proj(x)
        return h @ h.t()


class DataDependent(nn.Module):
    """Python control flow on tensor values: torch.export cannot capture it."""

    def __init__(self, dim):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def residual_conv():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1),
                         nn.GroupNorm(2, 4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))


def members_of(factory, n=3):
    members = []
    for seed in range(n):
        torch.manual_seed(seed)
        m = factory()
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 1.5)
        members.append(m.eval())
    return members


def exact(wide, members, x):
    with torch.no_grad():
        out = wide(x)
        return max((out[i] - m(x)).abs().max().item() for i, m in enumerate(members))


@pytest.mark.parametrize(
    "factory, sample",
    [
        (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(2, 6)),
        (residual_conv, torch.randn(2, 3, 8, 8)),
    ],
    ids=["mlp", "conv-bn"],
)
def test_plain_modules_fuse_into_primitives(factory, sample):
    members = members_of(factory)
    wide = WideModel.from_models(members, sample, validate=True)
    assert wide.plan.fallbacks == []
    assert exact(wide, members, torch.randn(5, *sample.shape[1:])) <= 1e-5


def test_raw_parameter_falls_back_per_member():
    members = members_of(lambda: RawScale(4))
    wide = WideModel.from_models(members, torch.randn(2, 4))
    (entry,) = wide.plan.fallbacks
    assert entry.fqn == "" and "scale" in entry.reason
    assert exact(wide, members, torch.randn(3, 4)) <= 1e-6


def test_row_mixing_op_is_caught_and_runs_per_member():
    members = members_of(lambda: nn.Sequential(nn.Linear(4, 4), CentreOverBatch(4), nn.Linear(4, 2)))
    wide = WideModel.from_models(members, torch.randn(2, 4))
    (entry,) = wide.plan.fallbacks
    assert entry.fqn == "1" and "mixes batch rows" in entry.reason
    assert wide.plan.entries["0"].kind == Kind.PRIMITIVE
    assert exact(wide, members, torch.randn(3, 4)) <= 1e-6


def test_a_product_of_rows_by_rows_is_caught_unverified():
    """The batch in two dims of an op's output and one of each input's: it kept the batch dim, and the plan kept the
    module, whose output then held every member's rows by every member's (the wrong shape, unverified; verification
    caught it: CLIP's logits)."""
    members = members_of(lambda: nn.Sequential(nn.Linear(4, 4), RowsByRows(4)))
    wide = WideModel.from_models(members, torch.randn(2, 4), verify=False)
    (entry,) = wide.plan.fallbacks
    assert entry.fqn == "1" and "mixes batch rows" in entry.reason
    assert exact(wide, members, torch.randn(3, 4)) <= 1e-6


class RelativeBias(nn.Module):
    """Scores plus a bias looked up with a (T, T) table of relative positions: no batch dim (T5, MPNet)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.bias = nn.Embedding(16, 1)

    def forward(self, x):  # (B, T, D)
        pos = torch.arange(x.shape[1], device=x.device)
        buckets = (pos[None, :] - pos[:, None]).clamp(-7, 8) + 7  # (T, T)
        return self.proj(x) @ x.transpose(1, 2) + self.bias(buckets).squeeze(-1)  # (B, T, T)


def test_a_layer_run_on_an_unbatched_input_falls_back_with_its_users():
    members = members_of(lambda: nn.Sequential(nn.Linear(4, 4), RelativeBias(4)))
    wide = WideModel.from_models(members, torch.randn(2, 6, 4))
    (entry,) = wide.plan.fallbacks
    assert entry.fqn == "1" and "without the batch dim" in entry.reason
    assert wide.plan.entries["0"].kind == Kind.PRIMITIVE
    assert exact(wide, members, torch.randn(2, 6, 4)) <= 1e-5  # 6 positions, 3 members: no shape error to warn


class TableBias(nn.Module):
    """A bias made from its own table alone, no input: (1, L, D), as Swin's relative position bias."""

    def __init__(self, length: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(length, dim))

    def forward(self):
        return self.table[None]


class WindowBias(nn.Module):
    """Each image's W windows as rows of their own, (B*W, L, D), plus the bias: it meets B*W rows, not B."""

    def __init__(self, dim: int, length: int = 2):
        super().__init__()
        self.proj, self.bias, self.length = nn.Linear(dim, dim), TableBias(length, dim), length

    def forward(self, x):  # (B, W*L, D)
        b, t, d = x.shape
        return (self.proj(x).view(b * (t // self.length), self.length, d) + self.bias()).view(b, t, d)


def test_a_module_taking_no_rows_runs_in_the_one_that_gives_them():
    # Planned alone, the bias would be expanded to the forward's N*B rows, which its sum meets only where each image
    # is one window (the sample here); at three windows, it raised
    members = members_of(lambda: nn.Sequential(nn.Linear(4, 4), WindowBias(4)))
    wide = WideModel.from_models(members, torch.randn(2, 2, 4))
    (entry,) = wide.plan.fallbacks
    assert entry.fqn == "1" and "TableBias" in entry.reason and "gives it its rows" in entry.reason
    assert exact(wide, members, torch.randn(2, 6, 4)) <= 1e-6


class CentredWithNorm(nn.Module):
    """Mixes batch rows (so it falls back), and owns a norm that its parent calls directly (XMOD does this)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        y = self.lin(x)
        return y - y.mean(0, keepdim=True)


class CallsAGrandchild(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.inner = CentredWithNorm(dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.inner.norm(self.inner(x)))


def test_a_fallback_whose_submodule_is_called_from_outside_takes_its_caller_along():
    members = members_of(lambda: CallsAGrandchild(4))
    wide = WideModel.from_models(members, torch.randn(2, 4))
    (entry,) = wide.plan.fallbacks
    assert entry.fqn == ""  # not "inner": the parent calls inner.norm itself, which "inner" cannot run per member
    assert exact(wide, members, torch.randn(3, 4)) <= 1e-6


def test_no_graph_of_the_trace_outlives_it():
    import gc

    from hf_wide.tracer import trace

    class TracedHere(nn.Sequential):
        pass

    def ours(node):  # a node of this test's graph: an op called inside TracedHere
        return any(str(cls).endswith("TracedHere") for _, cls in (node.meta.get("nn_module_stack") or {}).values())

    model = TracedHere(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    assert trace(model, (torch.randn(2, 6),)).method == "export (dynamic batch)"
    gc.collect()
    # type(), not isinstance(): isinstance() would touch deprecated torch objects among them, which warn
    assert not [o for o in gc.get_objects() if type(o) is torch.fx.Node and ours(o)]


def test_modules_reached_through_a_sliced_module_list_keep_their_own_paths():
    """Export may name a layer called as ``self.layers[:n][i]`` by the slice; the plan needs the layer's path."""
    from hf_wide.tracer_graph import unslice

    assert unslice("base.layers.slice(None, 2, None).1.attn") == "base.layers.1.attn"
    assert unslice("layers.slice(2, None, 3).1") == "layers.5"
    assert unslice("layers.slice(-2, None, None).0") == "layers.slice(-2, None, None).0"  # unknown length: as is


def test_export_failure_plans_from_the_module_tree_loudly():
    members = members_of(lambda: DataDependent(4))
    with pytest.warns(UserWarning, match="module tree"):
        wide = WideModel.from_models(members, torch.randn(2, 4))
    assert wide.plan.trace_method == "module tree"
    assert any("export" in w for w in wide.plan.warnings)


def test_a_plan_no_trace_could_check_is_verified_even_if_asked_not_to_be():
    # Without a trace the planner cannot see the row mixing. Unverified, the result was wrong, and only validate
    # (the sample's whole output) could catch it: verify=False is now ignored there, and says so.
    members = members_of(lambda: Hidden(4))
    with pytest.warns(UserWarning, match="verify=False ignored: Hidden was traced by module tree"):
        wide = WideModel.from_models(members, torch.randn(2, 4), validate=True, verify=False)
    assert [e.name for e in wide.plan.fallbacks] == ["(model)"]
    x = torch.randn(3, 4)
    with torch.no_grad():
        out = wide(x)
        assert all(torch.allclose(out[i], m(x), atol=1e-6) for i, m in enumerate(members))


def test_a_failed_export_prints_nothing(capfd):
    # torch.export prints the partial graph of an export that fails to stderr (a thousand lines for Longformer), and
    # logs each op its fake tensors could not run: hf-wide tries the next way and says why in the plan.
    members = members_of(lambda: Hidden(4))
    with pytest.warns(UserWarning, match="planning from the module tree"):
        wide = WideModel.from_models(members, torch.randn(2, 4))
    assert "export (dynamic batch) failed" in " ".join(wide.plan.warnings)
    printed = capfd.readouterr()
    assert "def forward" not in printed.err + printed.out and "fake_tensor" not in printed.err


def test_verification_runs_untraced_row_mixing_per_member():
    # Verified (the default), the module whose own code mixes rows is found and runs per member: exact.
    members = members_of(lambda: Hidden(4))
    with pytest.warns(UserWarning):
        wide = WideModel.from_models(members, torch.randn(2, 4))
    assert [e.name for e in wide.plan.fallbacks] == ["(model)"]
    assert "disagreed with its members" in wide.plan.fallbacks[0].reason
    x = torch.randn(3, 4)
    with torch.no_grad():
        out = wide(x)
        assert all(torch.allclose(out[i], m(x), atol=1e-6) for i, m in enumerate(members))


class Hidden(DataDependent):
    def forward(self, x):
        h = super().forward(x)
        return h - h.mean(0)


def test_plan_prints_flops_and_every_module(fused):
    _, wide = fused("bert-seqcls")
    text = str(wide.plan)
    assert "WideLinear" in text and "WideEmbedding" in text and "WideLayerNorm" in text
    assert wide.plan.total_flops > 0
    assert wide.plan.entries["classifier"].flops > 0


def test_a_reason_given_for_many_modules_is_printed_once(fused):
    # A 32-layer model printed the same reason for each layer's attention: 32 lines
    plan = copy.copy(fused("bert-seqcls")[1].plan)
    plan.warnings = ["export (dynamic batch) failed: why", *(f"layers.{i}.attn: not a WideAttention block: r"
                                                           for i in range(4)), "a.b: once", "c.d: once"]
    assert str(plan).splitlines()[-4:] == [
        "warning: export (dynamic batch) failed: why",
        "warning: layers.0.attn (and 3 more modules, the last layers.3.attn): not a WideAttention block: r",
        "warning: a.b: once", "warning: c.d: once"]  # (two alike stay apart)


def test_a_text_model_without_a_vocabulary_asks_for_sample_inputs():
    # CANINE reads characters (hashed code points): no vocab_size to draw sample ids from
    import transformers as tf

    config = tf.CanineConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                             num_hash_functions=2, num_hash_buckets=32, local_transformer_stride=4)
    members = [tf.CanineModel(config).eval() for _ in range(2)]
    with pytest.raises(ValueError, match="CanineConfig has no vocab_size.*pass sample inputs"):
        WideModel.from_models(members)
    ids = torch.randint(0, 1000, (2, 8))
    wide = WideModel.from_models(members, {"input_ids": ids})
    with torch.no_grad():
        got = wide(input_ids=ids).last_hidden_state
        for i, member in enumerate(members):
            assert (got[i] - member(input_ids=ids).last_hidden_state).abs().max().item() <= 1e-5


def test_a_member_taken_out_of_a_wide_model_in_training_trains_as_its_model():
    """``member(i)`` rebuilt its wide modules from copies in eval mode: in training its BatchNorm read its running
    statistics, not the batch's (1.40 off model i in training)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train() for _ in range(3)]
    wide = WideModel.from_models(models, torch.randn(2, 3, 8, 8))
    x = torch.randn(4, 3, 8, 8)
    for i, model in enumerate(models):
        member = wide.member(i)
        assert member.training and all(m.training for m in member.modules())
        with torch.no_grad():
            assert (member(x) - model(x)).abs().max().item() <= 1e-5


class Fields(NamedTuple):
    logits: torch.Tensor
    features: torch.Tensor


class NamedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        features = torch.tanh(self.a(x))
        return Fields(self.b(features), features)


def test_outputs_in_a_named_tuple_are_each_members():
    # unfolding rebuilt the tuple from one generator, which a named tuple does not take (a TypeError)
    members = members_of(NamedOutputs)
    wide = WideModel.from_models(members, torch.randn(2, 6))
    x = torch.randn(5, 6)
    with torch.no_grad():
        out = wide(x)
        assert isinstance(out, Fields) and out.logits.shape == (len(members), 5, 3)
        for i, member in enumerate(members):
            assert (out.logits[i] - member(x).logits).abs().max().item() <= 1e-5


class LastState(nn.Module):  # returns the LSTM's h_n, (1, B, H): no batch dim first
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(5, 7, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[1][0]


class BatchMean(nn.Module):  # returns (C,): the batch averaged away
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)

    def forward(self, x):
        return self.a(x).mean(0)


@pytest.mark.parametrize("factory, sample", [(LastState, torch.randn(2, 4, 5)), (BatchMean, torch.randn(2, 6))],
                         ids=["lstm-h_n", "batch-mean"])
def test_outputs_that_are_not_one_per_member_are_refused(factory, sample):
    # An LSTM's h_n, (1, B, H), came back (N, B, B, H), taken for a broadcast and expanded to the rows; an output
    # averaged over the batch, (C,), came back (N*C,): wide[1] was member 0's second feature. Each verified as a
    # layout a module's output may take inside the model, not as what its caller gets.
    with pytest.raises(WideValidationError, match=r"returned output \d of shape .*, where each member's is .*: not "
                                                  r"one per member"):
        WideModel.from_models(members_of(factory), sample)


@pytest.mark.parametrize("encoder", [False, True], ids=["layer", "encoder"])
def test_torchs_transformer_layers_run_their_fast_path_with_each_members_weights(encoder):
    # In eval without autograd, torch's encoder layer hands its children's weights to one kernel itself: those of
    # the wide linears and norms, (N, ...) ("2d weights expected"), since verification's hooks turn the path off
    def factory():
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False) if encoder else layer

    members = [m.eval() for m in members_of(factory)]
    wide = WideModel.from_models(members, torch.randn(2, 5, 8))
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        out = wide(x)
        for i, member in enumerate(members):
            assert (out[i] - member(x)).abs().max().item() <= 1e-5
