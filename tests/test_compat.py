"""Members that do not share an architecture are refused with errors that name what differs,
and a refused fusion leaves the members as they were."""

import pytest
import torch
import transformers as tf
from conftest import CASES

from hf_wide import IncompatibleMembersError, WideModel


def test_empty_list_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        WideModel.from_models([])


def test_members_of_different_classes():
    a = CASES["bert-seqcls"].build(0)
    b = CASES["bert-base"].build(1)
    with pytest.raises(IncompatibleMembersError, match=r"member 1.*BertModel.*BertForSequenceClassification"):
        WideModel.from_models([a, b])


def test_different_hidden_sizes_name_the_field_and_both_values():
    a = CASES["bert-seqcls"].build(0)
    config = CASES["bert-seqcls"].make_config()
    config.hidden_size, config.intermediate_size = 48, 64
    b = tf.BertForSequenceClassification(config).eval()
    with pytest.raises(IncompatibleMembersError, match=r"member 1.*hidden_size = 48.*32"):
        WideModel.from_models([a, b])


def test_labels_may_differ_only_when_allowed():
    a, b = CASES["bert-seqcls"].build(0), CASES["bert-seqcls"].build(1)
    b.config.id2label = {0: "neg", 1: "neu", 2: "pos"}
    with pytest.raises(IncompatibleMembersError, match="allow_label_mismatch"):
        WideModel.from_models([a, b])
    wide = WideModel.from_models([a, b], allow_label_mismatch=True)
    assert wide.member(1).config.id2label[2] == "pos"


def test_state_dict_shape_mismatch_is_named():
    a, b = CASES["llama-causallm"].build(0), CASES["llama-causallm"].build(1)
    b.model.norm.weight = torch.nn.Parameter(torch.ones(40))
    with pytest.raises(IncompatibleMembersError, match=r"member 1.*model.norm.weight.*\(40,\).*\(32,\)"):
        WideModel.from_models([a, b])


def test_a_refused_fusion_leaves_members_untouched():
    a, b = CASES["bert-seqcls"].build(0), CASES["bert-base"].build(1)
    a.train()
    before = {k: v.clone() for k, v in a.state_dict().items()}
    with pytest.raises(IncompatibleMembersError):
        WideModel.from_models([a, b])
    assert a.training
    assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())


def test_fusion_does_not_modify_members():
    members = [CASES["bert-seqcls"].build(s) for s in range(2)]
    classes = [type(m).__name__ for m in members[0].modules()]
    WideModel.from_models(members)
    assert [type(m).__name__ for m in members[0].modules()] == classes
