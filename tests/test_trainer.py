"""WideTrainer: a wide model trained by transformers' Trainer equals each member trained alone by Trainer with the
same arguments (hf_wide/trainer.py); what would mix the members is refused."""

import copy

import peft
import pytest
import torch
import transformers
from conftest import CASES
from families import randomise_
from lora_members import save_adapter

from hf_wide import WideModel
from hf_wide.trainer import WideTrainer

DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
            "attention_dropout", "hidden_dropout", "summary_first_dropout")


def members(case_id: str, count: int = 2):
    """Members without dropout, so that each trains alone as in the wide model, step for step."""
    case = CASES[case_id]
    built = []
    for seed in range(count):
        config = case.make_config()
        for name in DROPOUTS:
            if hasattr(config, name):
                setattr(config, name, 0.0)
        model = case.model_class(config).float()
        randomise_(model, seed)
        built.append(model)
    return built


def rows(case_id: str, count: int = 8) -> list[dict]:
    """Training rows, each with a column the models do not take (``idx``: Trainer drops it) and labels of -100
    where a causal LM's count of the items in the batch reads them."""
    case = CASES[case_id]
    data = []
    for i in range(count):
        row = {k: v[0] for k, v in case.inputs(1, padded=False, seed=i).items()}
        if case.causal_lm:
            labels = row["input_ids"].clone()
            labels[: i % 3] = -100  # position 0 among them: counted only where the labels are not shifted
            row["labels"] = labels
        else:
            row["labels"] = torch.tensor(i % 3)
        row["idx"] = i
        data.append(row)
    return data


def arguments(folder, **options) -> transformers.TrainingArguments:
    base = dict(output_dir=str(folder), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0, report_to=[], use_cpu=True,
                save_strategy="no", num_train_epochs=1, seed=3)
    return transformers.TrainingArguments(**{**base, **options})


def assert_each_trained_as_alone(wide, alone, inputs):
    with torch.no_grad():
        got = wide.eval()(**inputs).logits
        for i, model in enumerate(alone):
            assert (got[i] - model.eval()(**inputs).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case_id", ["llama-causallm", "gpt2-causallm", "bert-seqcls"])
@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_each_member_trains_as_trainer_trains_it_alone(case_id, optim, tmp_path):
    # A causal LM's num_items_in_batch counts its shifted labels only (Trainer reads Llama's loss_type); GPT-2's
    # ln_1 is spared weight decay by its type, not its name; gradient accumulation divides no loss that is
    # normalised by num_items_in_batch; the idx column is dropped as the members' forward does not take it
    models = members(case_id)
    wide = WideModel.from_models(models, share_identical=False)
    data = rows(case_id)
    WideTrainer(model=wide, args=arguments(tmp_path / "wide", optim=optim), train_dataset=data).train()
    for i, model in enumerate(models):
        transformers.Trainer(model=model, args=arguments(tmp_path / f"m{i}", optim=optim), train_dataset=data).train()
    assert_each_trained_as_alone(wide, models, CASES[case_id].inputs(3, padded=True, seed=99))


def test_lora_members_train_and_evaluate_with_activation_checkpointing(tmp_path):
    case = CASES["bert-seqcls"]
    base = members("bert-seqcls", 1)[0]
    base.save_pretrained(tmp_path / "base")
    folders = [save_adapter(case, tmp_path / "base", tmp_path / f"a{i}", i, r=4, lora_alpha=8, target_modules=["query", "value"],
                            modules_to_save=["classifier"], task_type="SEQ_CLS") for i in range(2)]
    wide = WideModel.from_pretrained(folders)
    for name, p in wide.named_parameters():
        p.requires_grad_("lora_" in name or "modules_to_save" in name)
    data = rows("bert-seqcls")
    metrics_seen = {}

    def metrics(prediction):
        metrics_seen["shape"] = prediction.predictions.shape
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids[:, None]).mean())}

    options = dict(activation_checkpointing=True, optim="sgd", learning_rate=0.5)
    trainer = WideTrainer(model=wide, args=arguments(tmp_path / "wide", **options), train_dataset=data,
                          eval_dataset=data, compute_metrics=metrics)
    trainer.train()
    assert wide.is_activation_checkpointing
    evaluated = trainer.evaluate()
    alone, losses = [], []
    for i, folder in enumerate(folders):
        model = peft.PeftModel.from_pretrained(case.model_class.from_pretrained(tmp_path / "base"), folder,
                                               is_trainable=True)
        reference = transformers.Trainer(model=model, args=arguments(tmp_path / f"m{i}", **options),
                                         train_dataset=data, eval_dataset=data)
        reference.train()
        losses.append(reference.evaluate()["eval_loss"])
        alone.append(model)
    assert_each_trained_as_alone(wide, alone, case.inputs(3, padded=True, seed=99))
    assert evaluated["eval_loss"] == pytest.approx(sum(losses), abs=1e-5)  # the members' sum, as trained
    assert metrics_seen["shape"] == (len(data), 2, 3)  # (B, N, C): batches concatenated along B
    assert 0 <= evaluated["eval_accuracy"] <= 1


@pytest.mark.parametrize("options, match", [
    ({"max_grad_norm": 1.0}, "max_grad_norm=1.0 clips one norm over every member's gradients"),
    ({"optim": "adafactor"}, "optim='adafactor' is not element-wise"),
    ({"label_smoothing_factor": 0.1}, "label smoother reads the logits of all members"),
    ({"neftune_noise_alpha": 5}, "neftune_noise_alpha=5: WideTrainer does not run NEFTune"),
])
def test_what_would_mix_the_members_is_refused(options, match, tmp_path):
    wide = WideModel.from_models(members("bert-seqcls"), share_identical=False)
    with pytest.raises(ValueError, match=match):
        WideTrainer(model=wide, args=arguments(tmp_path, **options))
    with pytest.raises(TypeError, match="trains a WideModel"):
        WideTrainer(model=members("bert-seqcls", 1)[0], args=arguments(tmp_path))


@pytest.mark.parametrize("case_id", ["bert-seqcls", "gpt2-causallm", "resnet-imgcls"])
def test_the_wide_model_reads_as_its_members_to_trainer(case_id, tmp_path):
    # Trainer reads a model's loss_type (a causal LM's shifted labels) and whether its forward takes
    # num_items_in_batch (then it divides no loss by the accumulation steps): a wide model's are its members'
    models = [CASES[case_id].build(s) for s in range(2)]
    wide = WideModel.from_models(models)
    trainer = transformers.Trainer(model=models[0], args=arguments(tmp_path))
    assert wide.loss_type == models[0].loss_type
    assert wide.accepts_loss_kwargs == trainer.model_accepts_loss_kwargs


def parameters_apart(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("case_id", ["gpt2-causallm", "bert-seqcls"])
def test_checkpoints_are_fused_repos_that_resume_as_uninterrupted(case_id, tmp_path):
    # GPT-2's tied embeddings: Trainer's bare state dict was refused by safetensors; BERT's was written, but neither
    # WideModel.from_pretrained nor resume_from_checkpoint read it
    data = rows(case_id)
    options = dict(gradient_accumulation_steps=1, save_strategy="steps", save_steps=2)  # 4 steps, 2 checkpoints
    whole = WideModel.from_models(members(case_id), share_identical=False)
    WideTrainer(model=whole, args=arguments(tmp_path / "whole", **options), train_dataset=data).train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert WideModel.from_pretrained(checkpoint).num_members == 2
    resumed = WideModel.from_models(members(case_id), share_identical=False)
    trainer = WideTrainer(model=resumed, args=arguments(tmp_path / "resumed", **options), train_dataset=data)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert parameters_apart(resumed, whole) <= 1e-6  # weights and optimizer state as at step 2, then the same steps
    trainer.save_model(str(tmp_path / "saved"))
    inputs = CASES[case_id].inputs(3, padded=True, seed=99)
    with torch.no_grad():
        back = WideModel.from_pretrained(tmp_path / "saved")(**inputs).logits
        assert (back - resumed.eval()(**inputs).logits).abs().max().item() <= 1e-6
    other = WideModel.from_models(members(case_id, 3), share_identical=False)
    with pytest.raises(ValueError, match=r"holds another wide model than the one trained \(\d+ tensors differ: "):
        WideTrainer(model=other, args=arguments(tmp_path / "other", **options),
                    train_dataset=data).train(resume_from_checkpoint=str(checkpoint))


def test_the_best_checkpoint_is_loaded_back_at_the_end(tmp_path):
    scores = iter([1.0, 0.0])  # the first evaluation (step 2) is the best: the model trained on to step 4
    data = rows("gpt2-causallm")
    wide = WideModel.from_models(members("gpt2-causallm"), share_identical=False)
    options = dict(gradient_accumulation_steps=1, save_strategy="steps", save_steps=2, eval_strategy="steps",
                   eval_steps=2, load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True)
    trainer = WideTrainer(model=wide, args=arguments(tmp_path, **options), train_dataset=data, eval_dataset=data,
                          compute_metrics=lambda prediction: {"score": next(scores)})
    trainer.train()
    assert trainer.state.global_step == 4 and trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert parameters_apart(wide, WideModel.from_pretrained(tmp_path / "checkpoint-2")) == 0
    assert parameters_apart(wide, WideModel.from_pretrained(tmp_path / "checkpoint-4")) > 1e-4


def test_a_wide_model_without_a_fused_repo_checkpoints_its_state_dict_and_resumes(tmp_path):
    # PeftModels given to from_models have no fused repo: saving one raised at the first checkpoint (step 2 here, step
    # 500 by default), where Trainer had saved the state dict
    base = members("bert-seqcls", 1)[0]
    config = dict(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")

    def adapted():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return [peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **config))
                    for _ in range(2)]

    data = rows("bert-seqcls")
    options = dict(gradient_accumulation_steps=1, save_strategy="steps", save_steps=2)
    whole = WideModel.from_models(adapted(), share_identical=False)
    WideTrainer(model=whole, args=arguments(tmp_path / "whole", **options), train_dataset=data).train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file()
    resumed = WideModel.from_models(adapted(), share_identical=False)
    WideTrainer(model=resumed, args=arguments(tmp_path / "resumed", **options),
                train_dataset=data).train(resume_from_checkpoint=str(checkpoint))
    assert parameters_apart(resumed, whole) <= 1e-6
