"""Every wide primitive: member i of the wide module equals module i, from_modules/to_modules round
trip, and broadcast inputs with a leading dim of 1 yield all N*B rows."""

import copy

import pytest
import torch
from torch import nn
from transformers.models.bart.modeling_bart import BartScaledWordEmbedding
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3RMSNorm,
    Gemma3TextScaledWordEmbedding,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.pytorch_utils import Conv1D

from hf_wide.fold import Fold
from hf_wide.registry import get_wide

N, B = 3, 2

# (factory, input shape per member batch, dtype)
PRIMITIVES = {
    "linear": (lambda: nn.Linear(6, 5), (B, 4, 6)),
    "linear-nobias": (lambda: nn.Linear(6, 5, bias=False), (B, 6)),
    "linear-falcon": (lambda: FalconLinear(6, 5), (B, 4, 6)),  # forward overridden, the same map: registered
    "conv1d-gpt2": (lambda: Conv1D(5, 6), (B, 4, 6)),
    "embedding": (lambda: nn.Embedding(11, 4, padding_idx=0), (B, 5)),
    "embedding-freq": (lambda: nn.Embedding(11, 4, scale_grad_by_freq=True), (B, 5)),
    "embedding-gemma-scaled": (lambda: Gemma3TextScaledWordEmbedding(11, 4, padding_idx=0, embed_scale=2.0), (B, 5)),
    "embedding-bart-scaled": (lambda: BartScaledWordEmbedding(11, 4, padding_idx=0, embed_scale=2.0), (B, 5)),
    "layernorm": (lambda: nn.LayerNorm(6), (B, 4, 6)),
    "layernorm-nobias": (lambda: nn.LayerNorm(6, bias=False), (B, 6)),
    "rmsnorm-llama": (lambda: LlamaRMSNorm(6, eps=1e-5), (B, 4, 6)),
    "rmsnorm-torch": (lambda: nn.RMSNorm(6), (B, 4, 6)),
    "rmsnorm-gemma": (lambda: Gemma3RMSNorm(6, eps=1e-5), (B, 4, 6)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (B, 4, 5, 5)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(4), (B, 4, 5, 5)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(4), (B, 4)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (B, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, stride=2), (B, 4, 9, 9)),
    "conv2d-groups-reflect": (lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1, padding_mode="reflect"), (B, 4, 7, 7)),
}


def randomised(factory, seed):
    torch.manual_seed(seed)
    module = factory()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
        for name, buf in module.named_buffers():
            if name == "running_mean":
                buf.normal_()
            elif name == "running_var":
                buf.uniform_(0.5, 1.5)
    return module.eval()


def sample(name, shape, seed=0):
    torch.manual_seed(100 + seed)
    if name.startswith("embedding"):
        return torch.randint(0, 11, shape)
    return torch.randn(shape)


@pytest.fixture(params=list(PRIMITIVES))
def case(request):
    factory, shape = PRIMITIVES[request.param]
    mods = [randomised(factory, s) for s in range(N)]
    fold = Fold(N)
    wide = get_wide(type(mods[0])).from_modules(mods, fold).eval()
    return request.param, mods, wide, fold, shape


def test_member_i_equals_module_i(case):
    name, mods, wide, fold, shape = case
    x = sample(name, shape)
    folded = x.unsqueeze(0).expand(N, *x.shape).reshape(N * x.shape[0], *x.shape[1:])
    fold.anchor = torch.empty(folded.shape[0], 0)
    with torch.no_grad():
        out = wide(folded).view(N, *mods[0](x).shape)
        for i, mod in enumerate(mods):
            assert (out[i] - mod(x)).abs().max() <= 1e-5


def test_round_trip(case):
    _, mods, wide, _, _ = case
    for i, back in enumerate(wide.to_modules()):
        assert type(back) is type(mods[i])
        assert back.state_dict().keys() == mods[i].state_dict().keys()
        for key, value in mods[i].state_dict().items():
            assert torch.equal(back.state_dict()[key], value)
            assert back.state_dict()[key].device == value.device


def test_broadcast_leading_one_gives_all_rows(case):
    name, mods, wide, fold, shape = case
    if name.startswith("batchnorm"):
        pytest.skip("BatchNorm is never fed broadcast inputs")
    x = sample(name, (1, *shape[1:]))
    fold.anchor = torch.empty(N * B, 0)
    with torch.no_grad():
        out = wide(x)
        assert out.shape[0] == N * B
        out = out.view(N, B, *out.shape[1:])
        for i, mod in enumerate(mods):
            assert (out[i] - mod(x)).abs().max() <= 1e-5


HALF_NORMS = {  # (factory, input shape per member batch): enough outputs to count the ones a last bit off
    "layernorm": (lambda: nn.LayerNorm(64), (8, 5, 64)),
    "rmsnorm-torch": (lambda: nn.RMSNorm(64), (8, 5, 64)),
    "groupnorm": (lambda: nn.GroupNorm(4, 16), (8, 16, 6, 6)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(16), (8, 16, 6, 6)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(HALF_NORMS))
def test_half_precision_norms_round_once_as_torchs_own(name, dtype):
    """The wide norms rounded the normalised rows to half precision before each member's affine, and again after:
    25-48% of outputs were a last bit off the member's own (torch's kernels round once), and further from the exact
    value. Now a rare tie between two float32 roundings is all that may differ."""
    factory, shape = HALF_NORMS[name]
    mods = [randomised(factory, s).to(dtype) for s in range(N)]
    fold = Fold(N)
    wide = get_wide(type(mods[0])).from_modules(mods, fold).eval()
    x = sample(name, shape).to(dtype)
    fold.anchor = torch.empty(N * shape[0], 0)
    with torch.no_grad():
        out = wide(x.repeat(N, *[1] * (x.dim() - 1))).view(N, *shape)
        for i, mod in enumerate(mods):
            assert (out[i] != mod(x)).float().mean().item() <= 0.01


def test_batchnorm_training_uses_each_members_own_rows():
    mods = [randomised(lambda: nn.BatchNorm2d(4), s).train() for s in range(N)]
    fold = Fold(N)
    wide = get_wide(nn.BatchNorm2d).from_modules(mods, fold).train()
    xs = [sample("bn", (B, 4, 3, 3), seed=s) for s in range(N)]
    fold.anchor = torch.empty(N * B, 0)
    out = wide(torch.cat(xs)).view(N, B, 4, 3, 3)
    for i, mod in enumerate(mods):
        assert (out[i] - mod(xs[i])).abs().max() <= 1e-5
        assert torch.allclose(wide.running_mean[i], mod.running_mean, atol=1e-6)
        assert torch.allclose(wide.running_var[i], mod.running_var, atol=1e-6)


def test_batchnorm_cumulative_average_counts_each_members_own_batches():
    # momentum=None averages over the batches seen: member 0's count served every member (0.11 off member 1's mean)
    mods = [randomised(lambda: nn.BatchNorm2d(4, momentum=None), s).train() for s in range(N)]
    for count, mod in enumerate(mods, start=1):
        mod.num_batches_tracked.fill_(10 * count)  # checkpoints trained for 10, 20 and 30 steps
    fold = Fold(N)
    wide = get_wide(nn.BatchNorm2d).from_modules(mods, fold).train()
    xs = [sample("bn", (B, 4, 3, 3), seed=s) for s in range(N)]
    fold.anchor = torch.empty(N * B, 0)
    wide(torch.cat(xs))
    for i, mod in enumerate(mods):
        mod(xs[i])
        assert torch.allclose(wide.running_mean[i], mod.running_mean, atol=1e-6)
        assert torch.allclose(wide.running_var[i], mod.running_var, atol=1e-6)
        assert wide.num_batches_tracked[i] == mod.num_batches_tracked


def test_batchnorm_training_on_one_value_per_channel_is_refused_as_torch_refuses_it():
    # each member's one row of (B=1, C): the wide model normalised it to 0 and moved its running variance towards 0
    mods = [randomised(lambda: nn.BatchNorm1d(4), s).train() for s in range(N)]
    fold = Fold(N)
    wide = get_wide(nn.BatchNorm1d).from_modules(mods, fold).train()
    fold.anchor = torch.empty(N, 0)
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training, got input size "
                                         r"torch\.Size\(\[1, 4\]\)") as refused:
        wide(sample("bn", (N, 4)))
    with pytest.raises(ValueError, match=str(refused.value).replace("[", r"\[").replace("(", r"\(").replace(
            "]", r"\]").replace(")", r"\)")):
        mods[0](sample("bn", (1, 4)))  # the member's own words
    assert all(torch.equal(wide.running_var[i], mod.running_var) for i, mod in enumerate(mods))  # untouched


def test_members_with_different_hyper_parameters_are_refused():
    with pytest.raises(ValueError, match="differs from member 0"):
        get_wide(nn.LayerNorm).from_modules([nn.LayerNorm(4, eps=1e-5), nn.LayerNorm(4, eps=1e-6)], Fold(2))


def test_registry_raises_with_the_supported_list():
    with pytest.raises(KeyError, match="Supported: .*Linear"):
        get_wide(nn.LSTM)


def test_meta_copies_are_shared_only_by_modules_alike():
    """One meta copy for members that differ in nothing but their tensors' values (what wide blocks keep to
    rebuild each member); another where a shape or an attribute differs."""
    from hf_wide.primitives.base import meta_copies

    a, b, narrower, flagged = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 2), nn.Linear(4, 3)
    flagged.scaling = {"default": 2.0}
    copies = meta_copies([a, b, narrower, flagged, nn.Linear(4, 3)])
    assert copies[0] is copies[1] is copies[4]
    assert len({id(c) for c in copies}) == 3 and copies[2].out_features == 2 and copies[3].scaling == {"default": 2.0}
    assert all(t.is_meta for c in copies for t in c.parameters())
    first = nn.Linear(4, 3).to("meta")
    assert meta_copies([a, b], first)[1] is first  # a copy of the first already made: taken


@pytest.mark.parametrize("name", [name for name in PRIMITIVES if name.startswith("embedding")])
@pytest.mark.parametrize("broadcast", [False, True], ids=["rows", "broadcast"])
def test_each_members_gradient_is_its_own_with_none_at_the_padding_row(name, broadcast):
    """``nn.Embedding(padding_idx=p)`` sends no gradient to row p; the wide table's rows p, V + p, ... neither (one
    lookup in the members' tables laid end to end has no padding row of its own: training moved them). With
    ``scale_grad_by_freq`` each member's rows are scaled by their counts in its own ids."""
    factory, shape = PRIMITIVES[name]
    mods = [randomised(factory, s) for s in range(N)]
    fold = Fold(N)
    wide = get_wide(type(mods[0])).from_modules(mods, fold)
    x = sample(name, (1, *shape[1:]) if broadcast else shape)
    x[0, :2] = 0 if mods[0].padding_idx is None else mods[0].padding_idx  # the padding token, twice
    fold.anchor = torch.empty(N * B, 0)
    folded = x if broadcast else x.repeat(N, *([1] * (x.dim() - 1)))
    out = wide(folded)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    out.backward(grad)
    rows = grad.view(N, -1, *out.shape[1:])  # each member's cotangent, (N, B or 1, ...)
    for i, mod in enumerate(mods):
        mod(x).backward(rows[i] if not broadcast else rows[i].sum(0, keepdim=True))
        assert torch.allclose(wide.weight.grad[i], mod.weight.grad, atol=1e-5)
        assert mod.padding_idx is None or not mod.weight.grad[mod.padding_idx].any()


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_batchnorms_the_members_hold_alike_are_each_members_own_in_training(adapters):
    # ResNets fine-tuned with their BatchNorms frozen (or LoRA adapters of one base): held once, a BatchNorm read every
    # member's rows in training, for its batch statistics and its running ones (0.33 and 0.14 off the members)
    import peft
    from conftest import CASES
    from lora_members import adapted
    from oracle import TOLERANCE, max_member_error

    from hf_wide import WideModel
    from hf_wide.plan import Kind

    case = CASES["resnet-imgcls"]
    members = [case.build(seed) for seed in range(2)]
    if adapters:
        members = [adapted(members[0], seed, r=2, target_modules=["convolution"]) for seed in range(2)]
        assert all(isinstance(m, peft.PeftModel) for m in members)
    else:
        for member in members[1:]:  # its BatchNorms as member 0's
            for mine, theirs in zip(member.modules(), members[0].modules()):
                if isinstance(mine, nn.modules.batchnorm._BatchNorm):
                    mine.load_state_dict(theirs.state_dict())
    wide = WideModel.from_models([copy.deepcopy(m) for m in members])
    assert not any(e.module_class.startswith("BatchNorm") for e in wide.plan.by_kind(Kind.SHARED))
    inputs = case.inputs(2, padded=False)
    with torch.no_grad():
        for model in (wide, *members):
            model.train()
        assert max_member_error(wide, members, inputs) <= TOLERANCE
        assert max_member_error(wide.eval(), [m.eval() for m in members], inputs) <= TOLERANCE  # the statistics too


def test_what_finds_a_models_batchnorms_by_class_finds_the_wide_ones():
    # Training with BatchNorms frozen (model.train(), then eval() on each _BatchNorm) and SWA's update_bn find them by
    # class: they found none in a wide model, whose BatchNorms went on updating in training (1.48 off the members)
    from conftest import CASES
    from oracle import TOLERANCE, max_member_error

    from hf_wide import WideModel

    case = CASES["resnet-imgcls"]
    members = [case.build(seed) for seed in range(2)]
    wide = WideModel.from_models([copy.deepcopy(m) for m in members], share_identical=False)
    norms = [m for m in wide.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and len(norms) == sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in members[0].modules())
    inputs = case.inputs(2, padded=False)
    for model in (wide, *members):
        model.train()
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
    with torch.no_grad():
        assert max_member_error(wide, members, inputs) <= TOLERANCE
    assert all(m.num_batches_tracked.eq(0).all() for m in norms)  # frozen: nothing updated
    loader = [inputs["pixel_values"], case.inputs(3, padded=False, seed=1)["pixel_values"]]
    for model in (wide, *members):  # statistics gathered anew over the loader, each member's over its own rows
        torch.optim.swa_utils.update_bn(loader, model)
    with torch.no_grad():
        assert max_member_error(wide.eval(), [m.eval() for m in members], inputs) <= TOLERANCE
    assert all(m.num_batches_tracked.eq(2).all() for m in norms)
