"""Each member's loss: given labels, a head gives ``(N,)``, member i's equal to checkpoint i's, whether it computes
its loss through transformers' ``loss_function`` or with torch.nn.functional's losses in its own code; a loss
reduced over all N*B rows by other code (one number mixing the members), with labels or without, is refused."""

import pytest
import torch
import transformers
from conftest import CASES
from families import VOCAB
import torch.nn.functional as F
from torch import nn

from hf_wide import WideModel


def test_a_causal_lms_loss_is_each_members(fused):
    members, wide = fused("llama-causallm")
    for batch in (2, 1):  # at B=1 the N losses are N rows: they stay (N,)
        inputs = CASES["llama-causallm"].inputs(batch, padded=True)
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        with torch.no_grad():
            loss = wide(**inputs, labels=labels).loss
            want = torch.stack([m(**inputs, labels=labels).loss for m in members])
        assert loss.shape == (len(members),)
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=0)


def test_training_on_the_sum_gives_each_member_its_own_gradient(fused):
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=False)
    wide.zero_grad()
    wide(**inputs, labels=inputs["input_ids"]).loss.sum().backward()
    norm = dict(wide.named_parameters())["model.model.norm.weight"]  # (N, D): the final RMSNorm's, stacked
    for i, member in enumerate(members):
        member.zero_grad()
        member(**inputs, labels=inputs["input_ids"]).loss.backward()
        torch.testing.assert_close(norm.grad[i], member.model.norm.weight.grad, atol=1e-5, rtol=0)
    wide.zero_grad()
    for member in members:
        member.zero_grad()


def test_a_classifiers_loss_through_loss_function_is_each_members_also_as_a_tuple(fused):
    members, wide = fused("llama-seqcls")
    inputs = CASES["llama-seqcls"].inputs(2, padded=True)
    labels = torch.tensor([1, 0])
    with torch.no_grad():
        want = torch.stack([m(**inputs, labels=labels).loss for m in members])
        torch.testing.assert_close(wide(**inputs, labels=labels).loss, want, atol=1e-5, rtol=0)
        loss, logits = wide(**inputs, labels=labels, return_dict=False)[:2]
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=0)
    assert logits.shape[:2] == (len(members), 2)


@pytest.mark.parametrize("case_id, labels", [
    ("bert-seqcls", lambda ids: torch.tensor([1, 0])),  # CrossEntropyLoss()(logits.view(-1, C), labels.view(-1))
    ("bert-tokcls", lambda ids: ids % 3),  # the same over (N*B*T) flattened tokens
    ("gpt2-seqcls", lambda ids: torch.tensor([2, 1])),
    ("resnet-imgcls", lambda ids: torch.tensor([1, 0])),
])
def test_a_loss_a_head_computes_in_its_own_code_is_split_by_member_too(fused, case_id, labels):
    members, wide = fused(case_id)
    inputs = CASES[case_id].inputs(2, padded=True)
    y = labels(inputs.get("input_ids", torch.zeros(2, 4, dtype=torch.long)))
    with torch.no_grad():
        want = torch.stack([m(**inputs, labels=y).loss for m in members])
        torch.testing.assert_close(wide(**inputs, labels=y).loss, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(wide(**inputs, labels=y, return_dict=False)[0], want, atol=1e-5, rtol=0)


class Regressor(nn.Module):
    """Its loss reduced by its own arithmetic, not a torch.nn.functional loss: nothing to split."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.head(x).squeeze(-1)
        return {"logits": out, "loss": None if labels is None else (out - labels).pow(2).mean()}


def test_a_loss_reduced_over_every_members_rows_is_refused_not_returned():
    torch.manual_seed(0)
    wide = WideModel.from_models([Regressor().eval() for _ in range(3)], {"x": torch.randn(2, 4)})
    with torch.no_grad(), pytest.raises(ValueError, match="mixing the members"):
        wide(x=torch.randn(2, 4), labels=torch.randn(2))


def test_a_masked_image_models_loss_is_refused_naming_what_asks_for_it():
    # ViT's masked image modeling reduces its loss with .sum() over every row whenever bool_masked_pos is given: the
    # refusal named labels only
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                    image_size=16, patch_size=4, encoder_stride=4)
    wide = WideModel.from_models([transformers.ViTForMaskedImageModeling(config).eval() for _ in range(2)])
    with torch.no_grad(), pytest.raises(ValueError, match="mixing the members.*bool_masked_pos"):
        wide(pixel_values=torch.randn(2, 3, 16, 16), bool_masked_pos=torch.ones(2, 16, dtype=torch.bool))


def test_a_member_taken_out_computes_its_own_loss(fused):
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=False)
    labels = torch.randint(0, VOCAB, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = wide.member(1)(**inputs, labels=labels).loss
        assert alone.dim() == 0
        torch.testing.assert_close(alone, members[1](**inputs, labels=labels).loss, atol=1e-5, rtol=0)


class WithAuxiliaryLoss(nn.Module):
    """A loss it computes without labels when asked (as an MoE's load-balancing loss), reduced over every row."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x, aux=False):
        out = self.head(x)
        return {"logits": out, "aux_loss": out.pow(2).mean() if aux else None}


def test_a_loss_mixing_the_members_is_refused_without_labels_too():
    torch.manual_seed(0)
    # (a reduction the sample's trace sees makes the module run per member: its loss is each member's)
    wide = WideModel.from_models([WithAuxiliaryLoss().eval() for _ in range(3)], {"x": torch.randn(2, 4)})
    with torch.no_grad():
        assert wide(x=torch.randn(2, 4))["aux_loss"] is None
        with pytest.raises(ValueError, match="'aux_loss'.*mixing the members"):
            wide(x=torch.randn(2, 4), aux=True)


def test_a_contrastive_loss_of_each_member_stays_one_per_member_at_batch_one():
    from test_architectures import MIXED, members

    factory, make_inputs, _ = MIXED["clip"]
    models = members(factory)
    torch.manual_seed(3)
    wide = WideModel.from_models(models, make_inputs())
    torch.manual_seed(4)
    inputs = {k: v[:1] for k, v in make_inputs().items()}  # one text and one image: N losses are N rows
    with torch.no_grad():
        loss = wide(**inputs, return_loss=True).loss
        want = torch.stack([m(**inputs, return_loss=True).loss for m in models])
    assert loss.shape == (3,)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=0)


def test_a_model_run_whole_per_member_computes_its_own_loss():
    members = [CASES["llama-causallm"].build(seed) for seed in range(3)]
    for member in members:  # a hook on the model: each member runs whole, as its own module
        member.register_forward_hook(lambda module, args, output: None)
    wide = WideModel.from_models(members)
    assert [e.fqn for e in wide.plan.fallbacks] == [""]
    ids = torch.randint(5, VOCAB, (2, 9))  # its 2*9 token rows divide into the forward's 3*2: not to be split again
    with torch.no_grad():
        loss = wide(input_ids=ids, labels=ids).loss
        want = torch.stack([m(input_ids=ids, labels=ids).loss for m in members])
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", ["ProphetNetForCausalLM", "ProphetNetForConditionalGeneration"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_a_heads_own_loss_method_that_reorders_the_rows_runs_per_member(head, eps):
    # ProphetNet's _compute_loss puts its two n-gram streams before the rows and flattens them: split into N blocks,
    # each member's loss took rows of the others' (4.607 for 4.612), and its smoothing term averaged every member's.
    config = transformers.ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4, max_position_embeddings=64,
        ngram=2, num_buckets=8, relative_max_distance=16, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0,
        eps=eps)
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(getattr(transformers, head)(config).eval())
    wide = WideModel.from_models(members)
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(3, VOCAB, (2, 3, 8), generator=gen)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if head.endswith("Generation"):
        inputs["decoder_input_ids"] = labels
    with torch.no_grad():
        want = torch.stack([m(**inputs).loss for m in members])
        assert torch.allclose(wide(**inputs).loss, want, atol=1e-6, rtol=0)
        assert torch.allclose(wide.member(1)(**inputs).loss, want[1], atol=1e-6, rtol=0)


class WeightedHead(nn.Module):
    """A head whose loss weighs its 3 classes (cross_entropy's weight, BCE's pos_weight), or each row (BCE's weight)."""

    CLASSES = torch.tensor([1.0, 2.0, 3.0])

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(8, 3)

    def forward(self, x, labels=None, rows=None):
        logits = self.lin(x)  # (B, 3)
        if labels is None:
            return {"logits": logits}
        if not labels.is_floating_point():
            return {"logits": logits, "loss": F.cross_entropy(logits, labels, weight=self.CLASSES)}
        return {"logits": logits, "loss": F.binary_cross_entropy_with_logits(
            logits, labels, weight=rows, pos_weight=self.CLASSES)}


@pytest.mark.parametrize("batch", [1, 2])
def test_a_class_weight_as_long_as_the_rows_is_every_members_whole(batch):
    # 3 classes, 3 members of 1 row: the weight read as the rows and was split among the members (cross_entropy
    # raised; BCE's pos_weight gave a loss 0.07 off each member's)
    members = [WeightedHead(seed) for seed in range(3)]
    wide = WideModel.from_models(members, {"x": torch.randn(2, 8)})
    x = torch.randn(batch, 8)
    rows = torch.rand(batch, 1)  # BCE's weight of each row: each member's block of them
    for labels, extra in ((torch.tensor([2, 0])[:batch], {}), (torch.rand(batch, 3).round(), {"rows": rows})):
        with torch.no_grad():
            got = wide(x=x, labels=labels, **extra)["loss"]
            want = torch.stack([m(x=x, labels=labels, **extra)["loss"] for m in members])
        assert (got - want).abs().max() <= 1e-6


def test_num_items_in_batch_of_several_numbers_is_refused(fused):
    # Each member's loss was divided by all of them: a loss of (N, N), silently
    _, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=True)
    with pytest.raises(ValueError, match="num_items_in_batch holds 3 numbers: it is one count"):
        wide(**inputs, labels=inputs["input_ids"], num_items_in_batch=torch.tensor([10, 20, 30]))
    assert wide(**inputs, labels=inputs["input_ids"], num_items_in_batch=torch.tensor(12)).loss.shape == (3,)
