"""hf_wide/training.py: training a wide model trains each member as it trains alone; what would not is refused, and
trainable modules the members share are warned of."""

import copy
import warnings

import pytest
import torch
from conftest import CASES
from lora_members import LLAMA, adapted, save_llama_adapters

from hf_wide import WideModel

BERT = CASES["bert-seqcls"]


def test_members_that_train_different_tensors_are_refused_training():
    # PEFT's bias="lora_only" trains the adapted layers' biases, bias="none" keeps them fixed: stacked, such a tensor
    # was trained or not as member 0's, and member 1 did not train as its PeftModel does (train() only warned)
    base = BERT.build(0)
    members = [adapted(base, seed, r=4, target_modules=["query"], bias=bias)
               for seed, bias in enumerate(["none", "lora_only"])]
    wide = WideModel.from_models(members, share_identical=False)
    assert wide.differently_trained and all(name.endswith("query.base_layer.bias") for name in wide.differently_trained)
    inputs, labels = BERT.inputs(2, padded=True), torch.tensor([0, 1])
    wide.train()
    with pytest.raises(RuntimeError, match=r"train different tensors: \[.*query\.base_layer\.bias.*freeze the wide"):
        wide(**inputs, labels=labels)
    with torch.no_grad():  # training mode for its dropout, computing no gradients: it runs
        wide(**inputs)
    wide.eval()  # training without dropout: refused too (it ran, and member 1's bias stayed as member 0 keeps it)
    with pytest.raises(RuntimeError, match=r"train different tensors"):
        wide(**inputs, labels=labels)
    with torch.no_grad():
        wide(**inputs)
    wide.requires_grad_(False)
    wide(**inputs, labels=labels)  # frozen: nothing would train
    same = WideModel.from_models([adapted(base, seed, r=4, target_modules=["query"]) for seed in range(2)],
                                 share_identical=False)
    assert same.differently_trained == ()
    same.train()(**inputs, labels=labels).loss.sum().backward()


def test_no_ops_a_member_holds_for_targets_it_lacks_are_refused_training(tmp_path):
    # Adapters with other target_modules than a member's hold zero LoRA updates for it there; made trainable after
    # loading, those zeros trained with the rest of the stacked tensor, and the wide model's member 1 drifted from
    # wide.member(1), which takes them out
    _, adapters = save_llama_adapters(tmp_path)
    wide = WideModel.from_pretrained(adapters)
    assert any(wide.padded_targets)
    inputs = LLAMA.inputs(2, padded=True)
    wide.train()
    wide(**inputs, labels=inputs["input_ids"])  # loaded as PEFT loads adapters, frozen: nothing trains
    for name, p in wide.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"member \d holds no-ops where other members have adapters .*target_modules"):
        wide(**inputs, labels=inputs["input_ids"])


def test_train_warns_of_the_shared_modules_that_would_train_and_of_no_others():
    # It named the first three shared modules, frozen embeddings of the base, and not the head every member trains
    base = BERT.build(0)
    heads = [adapted(base, seed, r=4, target_modules=["query"], task_type="SEQ_CLS") for seed in range(2)]
    wide = WideModel.from_models(heads)  # a new head each, alike: held once, and trainable
    with pytest.warns(UserWarning, match=r"modules \['[^']*classifier\.modules_to_save\.default'\] are shared by all "
                                         r"members, and trainable"):
        wide.train()
    frozen = WideModel.from_models([adapted(base, seed, r=4, target_modules=["query"]) for seed in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frozen.train()  # the base's modules it shares are frozen: they train exactly, as every member holds them


@pytest.mark.parametrize("targets", [["query", "value"], ["query", "key", "value", "dense", "classifier"]])
def test_biases_peft_trains_with_bias_all_are_each_members_own(targets):
    # PEFT's bias="all" trains every bias; a linear's, the same in every member as PEFT starts them, was held once in
    # its wide LoRA layer and took every member's gradient (3.7x off; 0.07 in the logits after 3 steps). With layers
    # it does not adapt, training was refused as if the members' targets differed
    base = BERT.build(0)
    for module in base.modules():  # trained in training mode, as alone, without dropout's draws
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    members = [adapted(base, seed, r=4, target_modules=targets, bias="all") for seed in range(3)]
    wide = WideModel.from_models([copy.deepcopy(m) for m in members], share_identical=False)
    inputs, labels = BERT.inputs(3, padded=True, seed=1), torch.tensor([0, 1, 2])
    for model, rate in ((wide, 0.1), *((m, 0.1) for m in members)):
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=rate)
        for _ in range(3):
            optimizer.zero_grad()
            model(**inputs, labels=labels).loss.sum().backward()
            optimizer.step()
    wide.eval()
    with torch.no_grad():
        got = wide(**inputs).logits
        for i, member in enumerate(members):
            assert (got[i] - member.eval()(**inputs).logits).abs().max() <= 1e-5
