"""The vectorised fallback: a module no builder knows, every member in one vmapped call over stacked tensors."""

import copy
import pickle

import pytest
import torch
import transformers
from conftest import CASES
from families import members_from
from oracle import TOLERANCE, max_member_error, member_gradients, zero_dropout
from torch import nn

from hf_wide import Kind, PerMember, WideModel
from hf_wide.fold import Fold
from hf_wide.inputs import fold_inputs
from hf_wide.primitives import VectorisedFallback


class Gated(nn.Module):
    """Raw parameters, a child, and control flow on the values of a mask (as transformers' mask helpers have)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.proj(x) * self.scale
        if mask.all():  # data-dependent: vmap cannot batch it
            return h
        return h * mask


def members(n=3):
    torch.manual_seed(0)
    return [Gated().eval() for _ in range(n)]


def test_shared_masks_run_in_one_vmap_and_differing_ones_member_by_member():
    mods = members()
    wide = VectorisedFallback.from_modules(mods, Fold(3))
    x = torch.randn(3, 2, 4)  # each member its own rows
    for masks in (torch.ones(3, 2, 4, dtype=torch.long), torch.randint(0, 2, (3, 2, 4))):
        args, kwargs, _ = fold_inputs(3, (), {"x": PerMember(x), "mask": PerMember(masks)})
        with torch.no_grad():
            out = wide(**kwargs).view(3, 2, 4)
            for i, mod in enumerate(mods):
                assert (out[i] - mod(x[i], masks[i])).abs().max() <= TOLERANCE


def test_a_vectorised_module_under_autocast_computes_as_its_members_do():
    """vmap's CPU linear with a bias does not follow autocast: the wide output came back in float32 where each
    member's comes back in bfloat16 (BertForMaskedLM's head, 0.016 off), and Whisper's vectorised encoder raised on
    keys of another dtype than its queries. Under autocast the members' code runs member by member."""
    mods = [Gated().proj.eval() for _ in range(3)]  # (a linear, vmapped: no branch on values)
    wide = VectorisedFallback.from_modules(mods, Fold(3))
    x = torch.randn(3, 2, 4)
    _, kwargs, _ = fold_inputs(3, (), {"input": PerMember(x)})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = wide(**kwargs).view(3, 2, 4)
        for i, mod in enumerate(mods):
            own = mod(x[i])
            assert out.dtype == own.dtype == torch.bfloat16 and torch.equal(out[i], own)


def test_spectral_norm_members_train_member_by_member_where_vmap_has_no_batching_rule():
    """Spectral norm's power iteration, which runs in training only, divides with ``out=``: vmap has no batching rule
    for it, and every training forward raised (fusion verifies in eval). The members' code now runs one by one."""
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 5)), nn.ReLU()) for _ in range(3)]
    wide = WideModel.from_models(mods, torch.randn(2, 4)).train()
    references = [copy.deepcopy(m).train() for m in mods]
    x = torch.randn(3, 4)
    for _ in range(2):  # (each step moves every member's own power-iteration vectors)
        out = wide(x)
        for i, reference in enumerate(references):
            assert (out[i] - reference(x)).abs().max().item() <= TOLERANCE


def test_one_stacked_tensor_per_source_tensor_and_members_back():
    mods = members()
    wide = VectorisedFallback.from_modules(mods, Fold(3))
    assert {name: tuple(t.shape) for name, t in wide.named_parameters()} == {
        "stacked.scale": (3, 4), "stacked.proj.weight": (3, 4, 4), "stacked.proj.bias": (3, 4)}
    for i, mod in enumerate(mods):
        back = wide.to_module(i)
        assert type(back) is Gated
        assert all(torch.equal(back.state_dict()[k], v) for k, v in mod.state_dict().items())


def test_t5_encoder_is_vectorised_where_no_builder_reaches_and_keeps_one_weight_set(fused):
    members_, wide = fused("t5-encoder")
    assert not wide.plan.loops
    vectorised = {e.fqn for e in wide.plan.by_kind(Kind.VECTORISED)}
    assert "encoder.block.0.layer.0.SelfAttention" in vectorised  # the attention that owns the position bias
    assert "encoder.block.1.layer.0.SelfAttention" not in vectorised  # later ones read it, with a member dim
    assert len(list(wide.parameters())) <= len(list(members_[0].parameters()))
    assert max_member_error(wide, members_, CASES["t5-encoder"].inputs(3, padded=True)) <= TOLERANCE


def test_a_module_vmap_cannot_run_is_looped_with_the_reason():
    torch.manual_seed(0)
    nets = [nn.Sequential(Boolean(), nn.Linear(4, 2)).eval() for _ in range(3)]
    for i, net in enumerate(nets):
        net[0].gain.data.fill_(1.0 + i)
    wide = WideModel.from_models(nets, torch.randn(2, 4))
    (entry,) = wide.plan.loops
    assert entry.fqn == "0" and "in a loop" in entry.reason and "vmap" in entry.reason
    x = torch.randn(5, 4)
    with torch.no_grad():
        out = wide(x)
        assert max((out[i] - net(x)).abs().max().item() for i, net in enumerate(nets)) <= TOLERANCE


class Boolean(nn.Module):
    """Boolean-mask indexing of its (batched) input: vmap cannot batch it."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        out = x.clone()
        out[x > 0] = x[x > 0] * self.gain
        return out


class WindowScale(nn.Module):
    """Swin's pattern: each image's W windows are rows of their own, (B*W, L, D), beside a mask of the W windows
    that every image shares, (W, L); a raw parameter, so that no builder takes it."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, windows, mask):
        h = windows * self.scale
        return (h.view(-1, mask.shape[0], *h.shape[1:]) * mask[None, :, :, None]).view_as(h)


class Windowed(nn.Module):
    def __init__(self, dim: int = 4, length: int = 2):
        super().__init__()
        self.embed, self.windows, self.length = nn.Linear(dim, dim), WindowScale(dim), length

    def forward(self, x):  # (B, W*L, D)
        b, t, d = x.shape
        w = t // self.length
        mask = (torch.arange(t, device=x.device).view(w, self.length) % 3 + 1).to(x.dtype)  # (W, L), no batch dim
        return self.windows(self.embed(x).view(b * w, self.length, d), mask).view(b, t, d)


def test_windows_of_each_image_split_by_member_at_any_count_and_a_shared_mask_of_n_b_windows_stays_shared():
    # Fused on one window per image; then W windows: the rows are N*B*W (Swinv2 at other image sizes than the
    # sample's raised), and at W == N*B the mask has the forward's rows without carrying them.
    torch.manual_seed(0)
    nets = [Windowed().eval() for _ in range(2)]
    wide = WideModel.from_models(nets, torch.randn(2, 2, 4))
    assert [e.fqn for e in wide.plan.by_kind(Kind.VECTORISED)] == ["windows"]
    for batch, windows in [(2, 3), (2, 4), (1, 2), (3, 1), (1, 6)]:
        x = torch.randn(batch, windows * 2, 4)
        with torch.no_grad():
            out = wide(x)
            assert max((out[i] - net(x)).abs().max().item() for i, net in enumerate(nets)) <= TOLERANCE


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_what_the_first_call_taught_about_the_inputs(how):
    # A copy called first at W == N*B windows cannot tell the mask from the rows by their lengths: it keeps the
    # roles the fused model's verification taught it (copies once learned them again, from the lengths, and raised).
    torch.manual_seed(0)
    nets = [Windowed().eval() for _ in range(2)]
    wide = WideModel.from_models(nets, torch.randn(2, 2, 4))
    twin = copy.deepcopy(wide) if how == "deepcopy" else pickle.loads(pickle.dumps(wide))
    assert twin.model.windows.input_roles == wide.model.windows.input_roles != {}
    x = torch.randn(1, 4, 4)  # one image of two windows: N*B windows
    with torch.no_grad():
        out = twin(x)
        assert max((out[i] - net(x)).abs().max().item() for i, net in enumerate(nets)) <= TOLERANCE


class Dropped(nn.Module):
    """A raw parameter (no builder: vectorised) and a dropout."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(64) + 1)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(x * self.scale)


def test_a_vectorised_module_drops_out_in_training_as_its_members_do():
    # Its code is a copy of member 0's on the meta device, not a child: train() did not reach it, and its dropout
    # stayed off in training, as fusion (in eval mode) had left it.
    wide = WideModel.from_models([Dropped() for _ in range(3)], (torch.randn(2, 64),))
    assert wide.plan.entries[""].kind == Kind.VECTORISED
    x = torch.randn(4, 64)
    with torch.no_grad():
        wide.train()
        dropped = (wide(x) == 0).float().mean().item()
        assert 0.3 < dropped < 0.7
        out = wide(x)
        assert not torch.equal(out[0] != 0, out[1] != 0)  # each member its own mask
        wide.eval()
        assert (wide(x) != 0).all()


def test_dropout_set_on_the_models_modules_reaches_a_vectorised_modules_code():
    # What sets the model's dropout modules (TRL's disable_dropout_in_model: every nn.Dropout's p to 0; Monte Carlo
    # dropout: the dropout modules alone back in training mode) reached the registered copy of the structure, and
    # not the code that runs: it kept dropping out, and stayed off for Monte Carlo dropout
    wide = WideModel.from_models([Dropped() for _ in range(3)], (torch.randn(2, 64),))
    dropouts = [m for m in wide.modules() if isinstance(m, nn.Dropout)]
    assert dropouts
    x = torch.randn(4, 64)
    with torch.no_grad():
        wide.train()
        for module in dropouts:
            module.p = 0.0
        assert (wide(x) != 0).all()
        wide.eval()
        for module in dropouts:
            module.p = 0.5
            module.train()
        assert 0.3 < (wide(x) == 0).float().mean().item() < 0.7


class Normed(nn.Module):
    """A raw parameter (vectorised) before a BatchNorm."""

    def __init__(self, seed: int):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(8, generator=torch.Generator().manual_seed(seed)) + 1)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x * self.scale)


def test_a_batchnorms_statistics_gathered_anew_in_a_vectorised_module_are_each_members():
    # SWA's update_bn sets momentum to None on the BatchNorms it finds, which reached the registered structure and not
    # the code that runs (gathered with 0.1: 1.7 off); and vmap, which refuses the count's .item() that momentum None
    # reads, had counted each batch before it raised, the loop that ran instead counted it again
    members = [Normed(seed) for seed in range(2)]
    wide = WideModel.from_models([copy.deepcopy(m) for m in members], (torch.randn(4, 8),), share_identical=False)
    assert wide.plan.entries[""].kind == Kind.VECTORISED
    generator = torch.Generator().manual_seed(0)
    loader = [torch.randn(4, 8, generator=generator) * scale + shift for scale, shift in ((3, 1), (0.5, -2), (1, 0))]
    for model in (wide, *members):
        torch.optim.swa_utils.update_bn(loader, model)
    x = torch.randn(4, 8, generator=generator)
    with torch.no_grad():
        out = wide.eval()(x)  # (N, B, 8)
        assert max((out[i] - m.eval()(x)).abs().max().item() for i, m in enumerate(members)) <= TOLERANCE


@pytest.mark.parametrize("verify", [True, False])
def test_jetmoes_experts_count_their_tokens_in_a_loop_and_return_token_rows(verify):
    # JetMoe's routers call .tolist() on the tokens per expert: under vmap a batched tensor has no storage, which was
    # raised as is (unverified) rather than run member by member. Looped, its MoE returns the router's logits per
    # token, (B*T, E) beside its (B, T, D): "no batch dim", where the members' token rows are the folded rows'.
    config = transformers.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2,
                                       kv_channels=8, intermediate_size=32, num_local_experts=4,
                                       num_experts_per_tok=2, max_position_embeddings=32)
    models = members_from(transformers.JetMoeForCausalLM, config, range(2))
    wide = WideModel.from_models(models, verify=verify)
    assert {wide.plan.entries[f"model.layers.0.{name}"].kind for name in ("mlp", "self_attention")} <= {
        Kind.VECTORISED, Kind.FALLBACK}
    inputs = {"input_ids": torch.randint(3, 64, (3, 5)), "labels": torch.randint(3, 64, (3, 5))}
    with torch.no_grad():
        got, want = wide(**inputs), [m(**inputs) for m in models]
    assert (got.logits - torch.stack([w.logits for w in want])).abs().max() <= TOLERANCE
    assert torch.allclose(got.loss, torch.stack([w.loss for w in want]), atol=TOLERANCE)


def _checkpointed(model, on: bool = True):
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def test_t5s_position_bias_attention_trains_under_activation_checkpointing():
    # Its first call under autograd tried vmap, which chose CPU flash attention (not differentiable in the position
    # bias) and failed after saving tensors, then ran member by member. Checkpointing counted the failed try's
    # tensors in the forward, and the recomputation (member by member from the start) saved fewer: CheckpointError.
    case = CASES["t5-encoder"]
    members = [zero_dropout(case.build(seed)) for seed in range(3)]
    wide = WideModel.from_models(members, share_identical=False)
    for model in (*members, wide.model):
        _checkpointed(model)
    inputs = case.inputs(2, padded=True)
    out = wide(**inputs).last_hidden_state
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    out.backward(cotangent)
    for i, member in enumerate(members):
        member(**inputs).last_hidden_state.backward(cotangent[i])
        got = member_gradients(wide, i)
        for name, param in member.named_parameters():
            torch.testing.assert_close(got[name], param.grad, atol=1e-5, rtol=1e-4)


def test_the_try_under_autograd_leaves_the_random_state_that_checkpointing_replays():
    # The try draws its dropout masks from the random state; had it kept them, the forward would have drawn the next
    # ones, and the recomputation (from the state at the checkpoint) the try's: gradients of other masks.
    case = CASES["t5-encoder"]
    wide = WideModel.from_models([case.build(seed) for seed in range(3)], share_identical=False)
    plain, checkpointed = copy.deepcopy(wide), copy.deepcopy(wide)
    inputs = case.inputs(2, padded=True)
    grads = []
    for model, on in ((plain, False), (checkpointed, True)):
        _checkpointed(model.model, on)
        model.train()
        torch.manual_seed(1)
        model(**inputs).last_hidden_state.pow(2).sum().backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=lambda m, name=name: f"{name}: {m}")


class ItemInBackward(torch.autograd.Function):
    """Doubles its input; its backward reads a value, which vmap cannot batch (as CUDA's memory-efficient attention
    cannot take a vmapped bias in its backward: "LSE is not correctly aligned")."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * (2.0 if grad.abs().sum().item() >= 0 else 0.0)


class ScaledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return ItemInBackward.apply(x * self.scale)


def test_a_module_whose_backward_fails_batched_trains_member_by_member():
    # Its forward vmaps (and is planned so), its backward does not: it raised in backward.
    torch.manual_seed(0)
    members = [ScaledTwice() for _ in range(3)]
    wide = WideModel.from_models(members, (torch.randn(2, 8),))
    assert wide.plan.entries[""].kind == Kind.VECTORISED
    x = torch.randn(4, 8)
    out = wide(x)
    cotangent = torch.randn(out.shape)
    out.backward(cotangent)
    for i, member in enumerate(members):
        member(x).backward(cotangent[i])
        torch.testing.assert_close(member_gradients(wide, i)["scale"], member.scale.grad)
    assert torch.equal(out.detach(), torch.stack([member(x) for member in members]).detach())
