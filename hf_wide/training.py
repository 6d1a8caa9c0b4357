"""What training a wide model does exactly, and what it warns of or refuses.

Each stacked tensor's slice i gets member i's gradient, so that training the wide model trains every member as it
would train alone (:mod:`hf_wide.losses`: each member's loss), with these exceptions:

- a module the members hold alike is kept once (``share_identical``): trainable, it gets every member's gradient at
  once. ``train()`` warns, naming those modules (:func:`trained_shared`); ``share_identical=False`` keeps a copy per
  member.
- a stacked tensor is trained for every member or for none. Members that train different tensors (PEFT's
  ``bias="lora_only"`` beside ``bias="none"``, or ``requires_grad`` set apart), and members given no-ops where the
  others have adapters (zero LoRA updates for ``target_modules`` they lack, the base's module for ``modules_to_save``
  they lack) that would train, cannot each train as alone: a forward that computes gradients in training mode is
  refused (:func:`check_training`), in training mode or in eval mode. One without gradients (dropout at inference)
  runs.

:class:`TrainingMixin` gives a wide model what transformers' ``Trainer`` and training code read of a model: its
members' ``loss_type`` and ``accepts_loss_kwargs``, and activation checkpointing (:mod:`hf_wide.trainer`).
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn

from .plan import Kind
from .primitives import PerMemberFallback, VectorisedFallback


def trained_shared(wide) -> list[str]:
    """The modules the members share (held once) with parameters that training changes. A frozen one (an adapted
    base's) stays as every member holds it: shared, it trains exactly."""
    modules = dict(wide.model.named_modules())
    return [e.name for e in wide.plan.by_kind(Kind.SHARED) if e.params and e.name in modules
            and any(p.requires_grad for p in modules[e.name].parameters())]


def training_refusal(wide) -> str | None:
    """Why training ``wide`` would not train each member as it trains alone (None: it would, but for the shared
    modules of :func:`trained_shared`)."""
    if not any(p.requires_grad for p in wide.parameters()):
        return None
    if wide.differently_trained:  # whatever the stacked tensor's flag: member 0's, which another's differs from
        names = list(wide.differently_trained)
        return (f"its members train different tensors: {names[:3]}{'...' if len(names) > 3 else ''} are trained by "
                "some members and kept fixed by others")
    modules = dict(wide.model.named_modules())
    for i, paths in enumerate(wide.padded_targets or []):
        trained = [p for p in paths if p not in modules or any(  # (a base bias PEFT's bias="all" trains is each
            t.requires_grad for name, t in modules[p].named_parameters()  # member's own: WideLoraLinear.base_bias)
            if not name.startswith(("base_layer.", "base_bias")))]
        if trained:
            return (f"member {i} holds no-ops where other members have adapters or saved modules ({trained[:2]}"
                    f"{'...' if len(trained) > 2 else ''}: their target_modules or modules_to_save differ), and they "
                    "would train")
    return None


@torch.compiler.disable  # (a walk over the model, on this rare path only)
def check_training(wide) -> None:
    """Refuse a forward that computes gradients where :func:`training_refusal` says why."""
    reason = training_refusal(wide)
    if reason is not None:
        raise RuntimeError(
            f"hf-wide cannot train this wide model exactly: {reason}. Each such tensor is one stacked tensor, trained "
            "for every member or for none, so a member would not train as it does alone. Fuse members that train "
            "the same tensors (the same target_modules, bias and modules_to_save; requires_grad set alike), or "
            "freeze the wide model (wide.requires_grad_(False)) to run it in training mode for its dropout.")


def needs_check(wide) -> bool:
    """Whether a forward must ask :func:`check_training` first: computing gradients, in training mode or in eval mode
    (training without dropout), over members that train different tensors or hold no-ops (cheap: no walk over the
    parameters otherwise). Eval mode was let through, and a step trained member 1's embeddings as member 0 froze
    them: 0.21 off."""
    return torch.is_grad_enabled() and bool(wide.differently_trained or wide.padded_targets)


class TrainingMixin:
    """The training side of :class:`~hf_wide.model.WideModel`: ``train()``, and what transformers reads of a model it
    trains, from the members' model (``Trainer`` counts a causal LM's ``num_items_in_batch`` over its shifted labels,
    and divides the loss by the accumulation steps unless the model takes ``num_items_in_batch`` itself)."""

    def train(self, mode: bool = True):
        """As ``nn.Module.train``; warns once of trainable modules the members share (:func:`trained_shared`)."""
        shared = trained_shared(self) if mode and not getattr(self, "_warned_shared", False) else []
        if shared:
            warnings.warn(
                f"Training a wide model whose modules {shared[:3]}{'...' if len(shared) > 3 else ''} are shared by "
                "all members, and trainable: each is one tensor, trained by every member's gradient at once. Fuse "
                "with share_identical=False to train every member's copy independently."
            )
            self._warned_shared = True
        return super().train(mode)

    @property
    def loss_type(self) -> str | None:
        """The members' loss type (``ForCausalLM``, ...), as transformers set it on their model."""
        return getattr(self._member_template(), "loss_type", None)

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether the members' forward takes loss keyword arguments (``num_items_in_batch``), as ``Trainer`` reads it
        of a model: its own flag, else a ``**kwargs`` in its forward's signature."""
        template = self._member_template()
        own = getattr(template, "accepts_loss_kwargs", None)
        if own is not None:
            return bool(own)
        return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(template.forward).parameters.values())

    def activation_checkpointing_enable(self, *args, **kwargs) -> None:
        """The members' model's own (transformers' ``activation_checkpointing_enable``): each layer's activations
        recomputed in the backward, wide modules included."""
        self._checkpointed().activation_checkpointing_enable(*args, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        self._checkpointed().activation_checkpointing_disable()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        """transformers' older name of :meth:`activation_checkpointing_enable`."""
        self.activation_checkpointing_enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        return bool(getattr(self._called, "is_activation_checkpointing", False))

    def _checkpointed(self) -> nn.Module:
        model = self._called
        if not hasattr(model, "activation_checkpointing_enable"):
            raise NotImplementedError(f"This wide model runs {type(model).__name__}, which has no activation "
                                      "checkpointing: its members are no transformers model fused layer by layer.")
        return model

    def _member_template(self) -> nn.Module:
        """A module of the members' class: the one the wide model calls, or a member's own where it runs whole."""
        model = self._called
        if isinstance(model, VectorisedFallback):
            return model.proto
        return model.members[0] if isinstance(model, PerMemberFallback) else model
