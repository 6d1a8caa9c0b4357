"""Each member's loss: given labels, a head that computes its loss through transformers' ``loss_function`` gives
``(N,)``, member i's equal to checkpoint i's; a head that computes it in its own code over the N*B rows (one
number mixing the members) is refused."""

import pytest
import torch
from conftest import CASES
from families import VOCAB


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


def test_a_loss_computed_in_the_heads_own_code_is_refused(fused):
    # BERT's classifier calls CrossEntropyLoss itself, over the N*B rows: their mean, no member's loss
    _, wide = fused("bert-seqcls")
    inputs = CASES["bert-seqcls"].inputs(2, padded=True)
    with torch.no_grad():
        for return_dict in (True, False):
            with pytest.raises(ValueError, match="mixing the members"):
                wide(**inputs, labels=torch.tensor([1, 0]), return_dict=return_dict)
        assert wide(**inputs).logits.shape[:2] == (3, 2)  # without labels, as ever


def test_a_member_taken_out_computes_its_own_loss(fused):
    members, wide = fused("llama-causallm")
    inputs = CASES["llama-causallm"].inputs(2, padded=False)
    labels = torch.randint(0, VOCAB, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = wide.member(1)(**inputs, labels=labels).loss
        assert alone.dim() == 0
        torch.testing.assert_close(alone, members[1](**inputs, labels=labels).loss, atol=1e-5, rtol=0)
