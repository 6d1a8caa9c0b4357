"""``WideModel``: N checkpoints of one architecture as one module and one forward pass.

    wide = WideModel.from_pretrained(["org/a", "org/b", "./local_dir"])
    out = wide(**inputs)           # every member sees the same B rows
    out.logits.shape               # (N, B, ...)
    wide.member(1)                 # checkpoint 1 again, as an ordinary transformers model
    print(wide.plan)               # what became of every module
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .adapters import runs_inner_model
from .capture import asks_for_capture, install_capture_hooks, reset_capture_hooks
from .choices import install_choice_rows
from .compare import tolerance
from .compat import member_names
from .concurrency import GATE, under_dynamo
from .fold import Fold
from .forward import first_tensor, run_members
from .generation import generate_wide
from .generation_configs import GenerationConfigs
from .hub_mixin import WideHubMixin
from .losses import install_member_losses
from .plan import WidePlan
from .primitives import PerMemberFallback, VectorisedFallback
from .primitives.vectorised import copy_code_for_thread
from .swap import member_model
from .training import TrainingMixin


# Methods of the members' class that compute each row's features outside their forward, from the modules it runs
# (CLIP's and SigLIP's towers and projections): a wide model runs them as its forward, every member on the rows
FEATURE_METHODS = frozenset({"get_text_features", "get_image_features", "get_audio_features", "get_video_features"})


FULL = (torch.float32, torch.float64)  # validate's default tolerance in these: 1e-4


class WideValidationError(RuntimeError):
    """The fused model's output for a member differs from that member run alone."""


class WideModel(WideHubMixin, TrainingMixin, GenerationConfigs, nn.Module):
    """N members folded into the batch of one model (see DESIGN.md, "Execution").

    Attributes: ``model`` (the folded template: the members' class with wide modules swapped in),
    ``plan`` (:class:`WidePlan`), ``num_members``, ``member_ids`` and ``member_configs``; ``adapter_sources``
    for members loaded as PEFT adapters (:mod:`hf_wide.adapter_repos`: their base and adapter configs), and
    ``full_members``: which of those members were full checkpoints (the base in the list, say), not adapters.
    Loading, saving and uploading (``from_pretrained``, ``save_pretrained``, ``push_to_hub``, ...) come from
    :class:`~hf_wide.hub_mixin.WideHubMixin`; ``train()``, activation checkpointing and what transformers' ``Trainer``
    reads of a model, from :class:`~hf_wide.training.TrainingMixin`.
    """

    adapter_sources = None
    full_members: frozenset[int] = frozenset()
    padded_targets: list[list[str]] | None = None  # per member held here: the no-ops it was given (adapter_layers)
    member_subfolders: list[str | None] | None = None  # where in its repo each member was, where one was given
    member_peft_configs: list[dict] | None = None  # each PeftModel member's own (the fused model holds member 0's)
    members_group = None  # a MemberGroup when the members are split over ranks (hf_wide.parallel)
    # parameters some members train and others keep fixed: held stacked, so a training forward is refused
    # (hf_wide.training)
    differently_trained: tuple[str, ...] = ()

    def __init__(
        self,
        model: nn.Module,
        plan: WidePlan,
        fold: Fold,
        aliases: dict[str, list[str]],
        member_ids: Sequence[str],
        member_configs: Sequence[Any] | None = None,
        member_generation_configs: Sequence[Any] | None = None,
    ):
        super().__init__()
        self.model = model
        self.plan = plan
        self.fold = fold
        self.member_ids = list(member_ids)
        self.member_revisions: list[str | None] = [None] * len(self.member_ids)  # commit shas, from the Hub
        self.member_configs = list(member_configs) if member_configs is not None else None
        self.member_generation_configs = member_generation_configs
        self._aliases = aliases
        self._capture_hooks = False  # installed on the first forward that asks for attentions or hidden states
        self._unrecorded: dict[str, tuple[str, str]] = {}  # what they cannot record (hf_wide.capture): refused
        self._capture_lock = threading.Lock()
        self._thread = threading.local()  # what this thread has made: its copies of the vectorised modules' code
        if isinstance(model, (VectorisedFallback, PerMemberFallback)):  # the whole model runs per member: its
            model.expands_broadcasts = False  # outputs are the caller's (CLIP's one image beside texts: (N, 1, ...))
        self._inner = runs_inner_model(model)  # a LoRA PeftModel: its transformers model is called directly
        # a rewritten model that scores each member's rows against its own (CLIP's): every batched input folded
        self.own_batches = any(getattr(m, "mixes_rows", False) for m in model.modules())
        install_member_losses(self._called, fold)  # each member's loss
        # generate() calls the model's forward itself (and an encoder-decoder's encoder first), with rows it may
        # expand (beams, several sequences per input): this pre-hook records the rows of each call, in the thread
        # that is generating only.
        encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
        # (a PeftModel's generate calls its transformers model's: a seq2seq adapter's beams went unrecorded)
        inner = model.get_base_model() if hasattr(model, "get_base_model") else None
        for module in {id(m): m for m in (model, inner, encoder) if isinstance(m, nn.Module)}.values():
            module.register_forward_pre_hook(fold, with_kwargs=True)
        install_choice_rows(self._called, fold)  # (B, C, T): B*C rows inside

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_models(
        cls,
        models: Sequence[nn.Module],
        sample_inputs: dict | tuple | None = None,
        *,
        validate: bool = False,
        allow_label_mismatch: bool = False,
        member_ids: Sequence[str] | None = None,
        share_identical: bool = True,
        verify: bool = True,
        atol: float | None = None,
        copy_shared: bool = True,
    ) -> "WideModel":
        """Fuse ``models`` (same class and architecture). The models are left untouched.

        ``sample_inputs`` (a dict of kwargs or a tuple of args, batch first) drives the trace; transformers
        models get one built from their config when it is omitted. ``validate=True`` runs every member
        alone on it and refuses a fused model whose outputs differ by more than ``atol`` (by default 1e-4, and in
        half precision what its rounding allows: :meth:`validate`).
        ``verify`` (on by default) checks every fused block and primitive against its members on the inputs the
        sample gives it (:mod:`hf_wide.verify`: one wide forward, and a forward per member) and runs a module that
        disagrees one strategy further down, with the reason in the plan.
        Modules identical in every member are kept once (``share_identical``); pass False to train the
        members independently, since a shared module's parameters would stay one tensor. They are copies, unless
        ``copy_shared=False``: then they are member 0's own tensors, and the members' LoRA tensors become views
        of the stacked ones (what loading adapters over one base uses: each tensor held once). The members'
        outputs that verification checks against are recorded before that, from their own tensors.
        """
        from .fuse import fuse_models

        return fuse_models(cls, models, sample_inputs, validate=validate, allow_label_mismatch=allow_label_mismatch,
                           member_ids=member_ids, share_identical=share_identical, verify=verify, atol=atol,
                           copy_shared=copy_shared)

    # ---------------------------------------------------------------- running
    @property
    def num_members(self) -> int:
        """N: every member, including those other ranks hold in a member-parallel model."""
        return self.fold.num_members if self.members_group is None else self.members_group.num_members

    @property
    def config(self):
        return getattr(self.model, "config", None)

    @property
    def device(self) -> torch.device:
        """Where the wide model's parameters are, as transformers' ``model.device``: ``inputs.to(wide.device)``."""
        return next(p.device for p in self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its floating-point parameters, as transformers' ``model.dtype``."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def forward(self, *args, **kwargs):
        """Run all members. Plain tensors ``(B, ...)`` are shared by every member; :class:`PerMember`
        tensors ``(N, B, ...)`` give each its own. Every output tensor gains a leading member dim; given labels, the
        loss is each member's, ``(N,)`` (:mod:`hf_wide.losses`); asked for router logits, so are the mixture of
        experts' load-balancing losses (:mod:`hf_wide.routers`)."""
        return self._run(None, args, kwargs)

    def __call__(self, *args, **kwargs):
        # Past the process's gate (hf_wide.concurrency): compiled, a call shares transformers' output collector
        compiled = self._compiled_call_impl is not None or torch.compiler.is_compiling() or under_dynamo()
        self._copy_code_for_thread(compiled)
        with GATE.call(compiled, asks_for_capture(kwargs, self.config)):
            return super().__call__(*args, **kwargs)

    def __getattr__(self, name: str):
        """The members' :data:`FEATURE_METHODS` (CLIP's ``get_text_features``, say), run as the forward runs: every
        member on the rows, each output ``(N, B, ...)``."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in FEATURE_METHODS or not callable(getattr(self._members_class(), name, None)):
                raise

        def method(*args, **kwargs):
            compiled = torch.compiler.is_compiling() or under_dynamo()
            self._copy_code_for_thread(compiled)
            with GATE.call(compiled, asks_for_capture(kwargs, self.config)):
                return self._run(name, args, kwargs)

        method.__name__ = method.__qualname__ = name
        return method

    def _copy_code_for_thread(self, compiled: bool) -> None:
        """Before a compiled call's first in this thread: its own copies of the vectorised modules' code, made here
        rather than inside the graph (a graph break in every new thread)."""
        if compiled and not getattr(self._thread, "code", False):
            copy_code_for_thread(self.model)
            self._thread.code = True

    @property
    def _called(self) -> nn.Module:
        """The module a call runs: the transformers model inside a LoRA PeftModel, called directly; else the model."""
        return self.model.base_model.model if self._inner else self.model

    def _members_class(self) -> type:
        return type(self._member_template())  # (the whole model as a fallback: its methods run per member too)

    def _run(self, method: str | None, args: tuple, kwargs: dict):
        """The members' ``forward`` (``method`` None) or their ``method``, every member on the folded rows."""
        return run_members(self, method, args, kwargs)

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickling: a lock cannot be copied (the copy makes its own, and installs
        transformers' capture hooks anew when asked, rather than keep the copies of this model's); nor can what
        ``compile()`` made, as torch's modules drop it (a copy of a compiled model ran the original's code)."""
        state = super().__getstate__()
        state.pop("_capture_lock", None)
        state.pop("_thread", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._capture_lock = threading.Lock()
        self._thread = threading.local()
        if self._capture_hooks:
            reset_capture_hooks(self.model)
            self._capture_hooks, self._unrecorded = False, {}

    @torch.compiler.disable
    def _install_capture_hooks(self) -> None:
        with self._capture_lock:  # once, whichever thread asks first
            if not self._capture_hooks:  # see hf_wide.capture: fused attentions record theirs too
                self._unrecorded = install_capture_hooks(self.model)
                self._capture_hooks = True

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        """Each member's own continuation: ``(N, B, T')`` tokens. Rows are folded into one ``generate`` on
        the wide model (KV cache of N*B rows), so each step is one wide forward. Rows that finish early are
        padded with ``pad_token_id``, as in transformers. Runs :attr:`generation_config`, and is refused where the
        members' differ in a setting the call does not give
        (:func:`~hf_wide.generation_configs.check_generation_configs`). With ``return_dict_in_generate=True``,
        transformers' output with every member's: ``sequences`` ``(N, B, T')``, and each step's ``scores``,
        ``logits``, attentions and hidden states ``(N, B, ...)`` (B times the beams or returned sequences, where
        there are some, as for each member alone)."""
        if self._compiled_call_impl is not None:
            warnings.warn("generate steps the members' model eagerly: compile() compiled the wide forward, which "
                          "generate does not call (README, 'Speed').", stacklevel=2)
        records = asks_for_capture(kwargs, self.config) or asks_for_capture(kwargs, self.generation_config)
        with GATE.call(True, records):  # as compiled: transformers may compile its steps (hf_wide.concurrency)
            return generate_wide(self, args, kwargs)

    def compile(self, **compile_kwargs) -> "WideModel":
        """Compile the whole wide forward (folding included) in place with ``torch.compile``.

        Batch and sequence lengths vary from call to call, so shapes are dynamic by default
        (``dynamic=True``): one graph serves every batch size above 1 and every sequence length, with no
        padding to buckets (batch size 1 gets a graph of its own, as torch specialises size-1 dims). Vectorised
        modules then run their members one after another in the graph (vmap would fix their shapes); with
        ``dynamic=False``, under vmap.
        Other ``torch.compile`` arguments (``mode=``, ``backend=``, ``fullgraph=``) pass through.
        """
        compile_kwargs.setdefault("dynamic", True)
        self.fold.compiled_static = compile_kwargs["dynamic"] is False
        super().compile(**compile_kwargs)
        return self

    # ---------------------------------------------------------------- members
    def member(self, i: int, share: bool = False) -> nn.Module:
        """Member i as an ordinary model (its own class, config and weights): the inverse of fusion. A member
        loaded as a PEFT adapter is a ``PeftModel``; one loaded as a full checkpoint beside adapters, the plain
        model. With ``share=True`` its tensors are views into the wide model's: no memory, but one storage."""
        return member_model(self, i, share)

    def validate(self, models: Sequence[nn.Module], args: tuple = (), kwargs: dict | None = None, *,
                 atol: float | None = None):
        """Check member i of the fused model against ``models[i]`` run alone on the given inputs: within ``atol``,
        by default 1e-4 in float32, and what a half precision's own rounding allows in it
        (:func:`hf_wide.compare.tolerance`: 2e-2 of the output's scale)."""
        kwargs = kwargs or {}
        names = member_names(models, self.member_ids)
        with torch.no_grad():
            wide_out = first_tensor(self(*args, **kwargs))
            for i, model in enumerate(models):
                alone = first_tensor(model(*args, **kwargs))
                diff = (wide_out[i] - alone).abs().max().item()
                limit = atol if atol is not None else 1e-4 if alone.dtype in FULL else tolerance(alone)
                if not diff <= limit:
                    raise WideValidationError(
                        f"{names[i]}: the fused model's output differs from the member run alone by {diff:.3g} "
                        f"(tolerance {limit:.3g}). Plan:\n{self.plan}"
                    )

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, plan: {self.plan.summary()}"
