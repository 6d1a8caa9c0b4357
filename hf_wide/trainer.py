"""``WideTrainer``: transformers' ``Trainer`` for a wide model, each member trained as it trains alone.

    from hf_wide import WideTrainer
    args = TrainingArguments("out", max_grad_norm=0, ...)   # clipping's one norm would mix the members
    trainer = WideTrainer(model=wide, args=args, train_dataset=..., eval_dataset=..., compute_metrics=...)
    trainer.train(); trainer.evaluate()

What it changes in ``Trainer``, and why:

- the loss it backpropagates is the sum of the members' losses (a wide model's loss is each member's, ``(N,)``), so
  that each member's gradient is its own loss's. What it logs is that sum too (``loss``, ``eval_loss``).
- what ``Trainer`` reads of a model's class (the columns its forward takes, the names of its labels, whether it
  returns a loss without them) it reads of the members' class: a wide model's forward takes ``**kwargs`` only, so
  every column was dropped and no batch had labels. (``loss_type`` and ``accepts_loss_kwargs``, which ``Trainer``
  reads of the model itself, come from :class:`~hf_wide.training.TrainingMixin`.)
- weight decay spares the parameters it spares in each member: the stacked tensors of a member's ``nn.LayerNorm``
  whose name says nothing of a norm (GPT-2's ``ln_1``) were decayed.
- the predictions gathered for ``compute_metrics`` are ``(B, N, ...)``, the member dim after the batch's, since
  ``Trainer`` concatenates batches along their first dim.
- ``save_model`` and the checkpoints write one fused repo (``WideModel.save_pretrained``), which
  ``WideModel.from_pretrained`` loads back (a wide model that has none, of plain modules or of PeftModels given to
  ``from_models``: its state dict), and ``resume_from_checkpoint`` and ``load_best_model_at_end`` copy a
  checkpoint's back into the model being trained. ``Trainer`` saves a model that is not a ``PreTrainedModel`` as a
  bare state dict: safetensors refused the members' tied embeddings (GPT-2's), and no loader read what it wrote.
- what would mix the members is refused: gradient clipping (``max_grad_norm > 0``: one norm over every member's
  gradients), optimizers that are not element-wise (Adafactor's factored moments, 8-bit blocks, GaLore's
  projections) and label smoothing (``Trainer``'s smoother reads all members' logits as one batch). NEFTune
  (``neftune_noise_alpha``) is refused too: ``Trainer`` hooks the model's ``get_input_embeddings()``, which a wide
  model does not give (it raised an AttributeError from inside ``train()``).
"""

from __future__ import annotations

import inspect
import os
import warnings

import safetensors.torch
import torch
from torch import nn
from torch.utils import _pytree as pytree
from transformers import Trainer
from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.utils import SAFE_WEIGHTS_NAME
from transformers.utils.generic import can_return_loss, find_labels

from .capture import source_class
from .model import WideModel
from .primitives import PerMemberFallback, VectorisedFallback
from .saving import peft_without_sources, read_section

# Trainer's optimizers that update every element from its own gradient and state alone
ELEMENTWISE_OPTIMIZERS = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused",
                                    "sgd", "adagrad", "rmsprop"})
ELEMENTWISE_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
                       torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop)


class WideTrainer(Trainer):
    """``Trainer`` for a :class:`~hf_wide.model.WideModel` (see the module's docstring); its arguments."""

    def __init__(self, model: WideModel | None = None, args=None, *rest, **kwargs):
        if not isinstance(model, WideModel):
            raise TypeError(f"WideTrainer trains a WideModel, got {type(model).__name__}: use transformers' Trainer.")
        super().__init__(model, args, *rest, **kwargs)
        chosen = getattr(self, "optimizer_cls_and_kwargs", None)
        _refuse_mixing(self.args, self.optimizer if chosen is None else chosen[0])
        members = type(model._member_template())
        if self.args.label_names is None:
            self.label_names = find_labels(members)
        self.can_return_loss = can_return_loss(members)

    def _set_signature_columns_if_needed(self) -> None:
        """The columns the members' forward takes (and the labels'), as ``Trainer`` reads them of a model."""
        if self._signature_columns is None:
            forward = self.model._member_template().forward
            self._signature_columns = [*inspect.signature(forward).parameters, "label", "label_ids", *self.label_names]

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """``Trainer``'s loss, each member's ``(N,)``, summed: each member's gradient is its own loss's."""
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss = loss.sum()
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """``Trainer``'s, with every per-member output ``(N, B, ...)`` as ``(B, N, ...)``: batches are concatenated
        along their first dim."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        n = self.model.num_members
        logits = pytree.tree_map(
            lambda t: t.transpose(0, 1) if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == n else t,
            logits)
        return loss, logits, labels

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """``Trainer``'s (every weight but biases and norms), less the stacked tensors of the members' norms."""
        norms = norm_parameters(model)
        return [name for name in super().get_decay_parameter_names(model) if name not in norms]

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model as one fused repo, with the processing class and the training arguments, as ``Trainer`` saves a
        ``PreTrainedModel``: ``Trainer``'s own wrote a bare state dict, which safetensors refuses for tied tensors. A
        wide model that has no fused repo (of plain modules, or of PeftModels given to ``from_models``) is saved as its
        state dict still, its tied tensors once (``safetensors.torch.save_model``)."""
        if state_dict is not None:  # (DeepSpeed, FSDP and SageMaker gather one; a fused repo is written of the model)
            raise NotImplementedError("WideTrainer saves the wide model as a fused repo; it cannot save a state dict "
                                      "gathered by DeepSpeed, FSDP or SageMaker.")
        if not self.args.should_save:
            return
        output_dir = self.args.output_dir if output_dir is None else output_dir
        preprocessor = self.processing_class
        if preprocessor is None:
            preprocessor = getattr(self.data_collator, "tokenizer", None)
        if saves_fused(self.model):
            self.model.save_pretrained(output_dir, processor=preprocessor)
        else:
            os.makedirs(output_dir, exist_ok=True)
            safetensors.torch.save_model(self.model, os.path.join(output_dir, SAFE_WEIGHTS_NAME),
                                         metadata={"format": "pt"})
            if preprocessor is not None:
                preprocessor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The checkpoint's fused repo copied into the model being trained (``resume_from_checkpoint``)."""
        load_checkpoint(self.model if model is None else model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """The best checkpoint's fused repo copied into the model trained (``load_best_model_at_end``)."""
        load_checkpoint(self.model, self.state.best_model_checkpoint)


def saves_fused(model: WideModel) -> bool:
    """Whether ``model`` saves as a fused repo: its members are transformers models, not PeftModels given to
    ``from_models`` (which :func:`~hf_wide.saving.refuse_peft_without_sources` refuses)."""
    return getattr(model, "config", None) is not None and not peft_without_sources(model)


def load_checkpoint(model: WideModel, folder: str) -> None:
    """Copy the checkpoint in ``folder`` into ``model``, in place (its optimizer holds its parameters): a fused repo
    (refused where its tensors' names or shapes are not ``model``'s: another number of members, another plan), or
    the state dict :meth:`WideTrainer._save` writes of a model that has none."""
    if read_section(folder) is None:
        weights = os.path.join(folder, SAFE_WEIGHTS_NAME)
        if saves_fused(model) or not os.path.isfile(weights):
            raise ValueError(f"{folder} holds no fused repo (a config.json with an hf_wide section): it was not saved "
                             "by WideTrainer.")
        missing, unexpected = safetensors.torch.load_model(model, weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder} holds another wide model than the one trained (missing here: "
                             f"{sorted(missing)[:3]}, unexpected: {sorted(unexpected)[:3]}).")
        return
    saved = WideModel.from_pretrained(folder).state_dict()
    own = model.state_dict()
    differ = sorted(k for k in own.keys() | saved.keys()
                    if k not in own or k not in saved or own[k].shape != saved[k].shape)
    if differ:
        shown = ", ".join(f"{k} {tuple(own[k].shape) if k in own else 'absent'} here, "
                          f"{tuple(saved[k].shape) if k in saved else 'absent'} there" for k in differ[:3])
        raise ValueError(f"{folder} holds another wide model than the one trained ({len(differ)} tensors differ: "
                         f"{shown}{', ...' if len(differ) > 3 else ''}): resume a checkpoint with the members, and the "
                         "fusion, it was saved from.")
    model.load_state_dict(saved, strict=True)


def norm_parameters(model: nn.Module) -> set[str]:
    """The names of ``model``'s parameters that stand for a member's ``nn.LayerNorm`` (``ALL_LAYERNORM_LAYERS``), which
    ``Trainer`` spares weight decay by their type: a wide norm, and the norms inside a module run per member
    (vectorised: ``stacked.<path>``; looped: ``members.<i>.<path>``)."""
    norms = tuple(ALL_LAYERNORM_LAYERS)
    found = set()
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, (VectorisedFallback, PerMemberFallback)):
            source = module.proto if isinstance(module, VectorisedFallback) else module.members[0]
            owners = {p for p, sub in source.named_modules() if isinstance(sub, norms)}
            for name, _ in module.named_parameters():
                inner = name.split(".", 2)[2] if name.startswith("members.") else name.removeprefix("stacked.")
                if (inner.rsplit(".", 1)[0] if "." in inner else "") in owners:
                    found.add(prefix + name)
        else:
            source = source_class(module)
            if source is not None and issubclass(source, norms):
                found.update(prefix + name for name, _ in module.named_parameters())
    return found


def _refuse_mixing(args, optimizer: torch.optim.Optimizer | type | None) -> None:
    """Refuse the training arguments under which a member would not train as it does alone (an optimizer given, or
    its class, is the user's: warned of unless torch's element-wise)."""
    if args.max_grad_norm:
        raise ValueError(f"max_grad_norm={args.max_grad_norm} clips one norm over every member's gradients, so each "
                         "member's step would depend on the others': pass TrainingArguments(max_grad_norm=0).")
    if args.label_smoothing_factor:
        raise ValueError(f"label_smoothing_factor={args.label_smoothing_factor}: Trainer's label smoother reads the "
                         "logits of all members as one batch. Smooth the labels in the members' loss instead, or "
                         "pass label_smoothing_factor=0.")
    if args.neftune_noise_alpha is not None:
        raise ValueError(f"neftune_noise_alpha={args.neftune_noise_alpha}: WideTrainer does not run NEFTune, whose "
                         "hook Trainer puts on the model's get_input_embeddings(), which a wide model does not give. "
                         "Pass neftune_noise_alpha=None.")
    if optimizer is not None:
        kind = optimizer if isinstance(optimizer, type) else type(optimizer)
        if not issubclass(kind, ELEMENTWISE_CLASSES):
            warnings.warn(f"{kind.__name__} is not one of torch's element-wise optimizers: each member "
                          "trains as alone only if it updates every element from its own gradient and state.")
        return
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(f"optim={optim!r} is not element-wise (it reduces over whole tensors, or blocks of them), so "
                         "each member's step would depend on the others': use one of "
                         f"{', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}.")
