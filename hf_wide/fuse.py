"""Fusing N models: plan, build, verify, and move down what disagrees (:meth:`WideModel.from_models`).

    plan = make_plan(members, traced)        # what each module becomes (hf_wide.planner)
    folded = build_wide(members, plan, fold) # stacked weights, wide modules swapped in (hf_wide.swap)
    diagnose(wide, members, ...)             # every fused module against its members (hf_wide.verify)

A module whose output differs from its members' moves one strategy down the ladder (fused block, primitives,
vectorised, a loop over the stacked tensors, a loop over the members' own modules) with the reason recorded in the
plan, and the loop runs again; a plan with nothing left to move down is refused.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from .adapter_aligned import aligned_adapters
from .compare import device_lost
from .compat import check_compatible
from .cpu import release_freed_memory
from .fold import Fold
from .forward_state import StateSnapshot, refuse_changes
from .model import WideModel, WideValidationError
from .plan import Demotions, Kind, WidePlan
from .planner import make_plan, tensor_aliases
from .planner_rules import direct_tensors, same_tensors
from .primitives.base import keeping_storage
from .sample_trace import trace_members
from .samples import sample_inputs as build_sample_inputs
from .structure import opaque_modules
from .swap import build_wide
from .verify import diagnose, record_members
from .verify_cache import require_cache_agrees

logger = logging.getLogger(__name__)


def needs_verifying(method: str, model_class: str) -> bool:
    """Whether an unverified fusion must be verified after all: planned without a trace over a dynamic batch (export
    specialised the batch, or failed), no op that mixes rows or runs a tensor on an input without the batch dim was
    seen, and nothing else would check the plan (Longformer, planned from its module tree and unverified: 0.014 off
    at 3 x 9 tokens; T5's classifier, traced with a static batch: 0.0013 off at one text). Says so in a warning."""
    if method == "export (dynamic batch)":
        return False
    warnings.warn(
        f"verify=False ignored: {model_class} was traced by {method}, which cannot see whether its "
        "ops keep the members' rows apart, so the plan is checked against the members (verify=True).", stacklevel=4)
    return True


MAX_VERIFY_ROUNDS = 16  # each round moves every module that disagreed one strategy down


def fuse_models(cls: type[WideModel], models: Sequence[nn.Module], sample_inputs: dict | tuple | None = None, *,
                validate: bool = False, allow_label_mismatch: bool = False, member_ids: Sequence[str] | None = None,
                share_identical: bool = True, verify: bool = True, atol: float | None = None,
                copy_shared: bool = True, traced: tuple | None = None, outputs: list | None = None,
                saved_plan: WidePlan | None = None) -> WideModel:
    """``cls.from_models(models, ...)``: see :meth:`WideModel.from_models` for the options. ``traced``: (sample,
    :func:`~hf_wide.sample_trace.trace_members`' result) of ``models[0]`` as it is, traced already
    (:func:`hf_wide.adapter_trace.trace_ahead`): the sample to check the members on, and its trace. ``outputs``: a
    list that each member's whole output on that sample, as verification recorded it, is added to (a
    :func:`~hf_wide.verify.check_whole` record; nothing without ``verify``), for :mod:`hf_wide.adapter_groups`.
    ``saved_plan``: the plan a saved ensemble of adapters was fused by (:mod:`hf_wide.adapter_repos`), built without a
    trace where it is these members' and verification runs; where verification finds a module that disagrees, the
    members are traced and planned afresh, as without it."""
    if traced is not None and sample_inputs is not None:
        raise ValueError("Pass sample inputs or a trace taken on its own sample, not both.")
    models, padded, full = aligned_adapters(models)  # LoRA members that differ, or beside plain models: views
    traced = None if padded else traced  # (views: padded since it was traced)
    check_compatible(models, member_ids, allow_label_mismatch)
    template = models[0]
    sample = sample_inputs if sample_inputs is not None else traced[0] if traced else build_sample_inputs(template)
    args, kwargs = as_args_kwargs(sample)
    ids = member_ids or [getattr(getattr(m, "config", None), "_name_or_path", "") or f"member-{i}"
                         for i, m in enumerate(models)]
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    given = StateSnapshot(models)  # the members as given: fusion runs them (hf_wide.forward_state)
    saved_plan = saved_plan if uses_saved_plan(verify, share_identical) and _plans_these(saved_plan, models) else None
    try:
        opaque = opaque_modules(models)  # before the trace runs member 0
        if saved_plan is not None:
            trace = None
        elif traced is not None:
            trace = traced[1]
        else:
            trace = trace_members(template, args, kwargs, built=sample_inputs is None)
            release_freed_memory()  # after each phase, its temporaries: see hf_wide.cpu
        refuse_changes(given, ids)  # (the trace runs member 0)
        if trace is not None:  # (a saved plan is built only to be verified)
            verify = verify or needs_verifying(trace[0].method, type(template).__name__)
        wide, demotions, recorded = None, Demotions(), None
        for _ in range(MAX_VERIFY_ROUNDS):
            plan = saved_plan if trace is None else make_plan(models, *trace, share_identical=share_identical,
                                                              demotions=demotions, opaque=opaque)
            fold = Fold(len(models))
            if verify and recorded is None:  # the whole outputs, before the build shares the members' tensors
                given.restore()
                recorded = record_members(models, (), args, kwargs, inputs=False)
                release_freed_memory()
                refuse_changes(given, ids)  # (before any build, which shares tensors)
            given.restore()  # built from the members as given, not as the trace or the checks left them
            try:
                with contextlib.nullcontext() if copy_shared else keeping_storage():
                    folded = build_wide(models, plan, fold)
                release_freed_memory()
                wide = cls(
                    folded,
                    plan,
                    fold,
                    tensor_aliases(*models),  # the ties every member holds
                    ids,
                    [copy.deepcopy(m.config) for m in models] if hasattr(template, "config") else None,
                    [copy.deepcopy(getattr(m, "generation_config", None)) for m in models],
                ).eval()
                built = StateSnapshot([wide], parameters=False)
                if hasattr(template, "peft_config"):
                    wide.member_peft_configs = [copy.deepcopy(m.peft_config) for m in models]
                if not verify:
                    break
                failures, recorded = diagnose(wide, models, args, kwargs, recorded)
                built.restore()
            except Exception as exc:
                if trace is not None or device_lost(exc):
                    raise
                # the saved plan does not build these members, or its modules' outputs have other shapes than theirs
                failures, recorded = {"": f"{type(exc).__name__}: {exc}"}, None
            if not failures:
                break
            if trace is None:  # the saved plan is not these members' after all: traced and planned as any fusion
                logger.info("hf-wide: the saved plan is not these members' (%s): tracing them", _describe(failures))
                given.restore()
                trace = trace_members(template, args, kwargs, built=sample_inputs is None)
                refuse_changes(given, ids)
                continue
            if not demotions.add(plan, failures):
                raise WideValidationError(
                    f"hf-wide cannot fuse these members exactly: {_describe(failures)} on the sample input, and "
                    f"nothing is left to move down. Plan:\n{plan}"
                )
        else:
            raise WideValidationError(f"hf-wide could not verify a plan in {MAX_VERIFY_ROUNDS} rounds:\n{plan}")
        if verify and not args:
            require_cache_agrees(wide, models, ids, kwargs)
            built.restore()
        if verify and outputs is not None:
            outputs.extend({None: calls[None]} for calls in recorded)
    finally:
        given.restore()
        for m, training in zip(models, was_training):
            m.train(training)
    if padded:  # the no-ops the views were given, which member(i) takes out
        wide.padded_targets, wide.full_members = padded, full
    wide.differently_trained = differently_trained(models)
    wide.train(was_training[0])
    if validate:
        try:
            wide.validate(models, args, kwargs, atol=atol)
        finally:
            given.restore()
            built.restore()
    return wide


def uses_saved_plan(verify: bool, share_identical: bool) -> bool:
    """Whether a fusion with these options builds by a saved plan rather than a trace: one it verifies (a plan is
    never used unchecked), of members that keep once what they hold alike (as the plan was made)."""
    return verify and share_identical


def _plans_these(plan: WidePlan | None, models: Sequence[nn.Module]) -> bool:
    """Whether ``plan`` (a saved or cached one) was made for as many members of the class of ``models``, names only
    their modules, and keeps once only modules that hold the same tensors in every member (as a plan made for them
    would); verification then holds the rest of it to them."""
    if plan is None or plan.num_members != len(models) or plan.model_class != type(models[0]).__name__:
        return False
    modules = [dict(m.named_modules()) for m in models]
    if not all(fqn in modules[0] for fqn in plan.entries):
        return False
    for fqn, entry in plan.entries.items():
        if entry.kind == Kind.SHARED:
            tensors = [direct_tensors(member[fqn]) if fqn in member else None for member in modules]
            if any(t is None or t.keys() != tensors[0].keys() for t in tensors) or not all(
                    same_tensors([t[name] for t in tensors]) for name in tensors[0]):
                logger.info("hf-wide: the saved plan keeps %s once, which the members hold apart: tracing them", fqn)
                return False
    return True


def differently_trained(models: Sequence[nn.Module]) -> tuple[str, ...]:
    """The names of the parameters that some of ``models`` train (``requires_grad``) and others keep fixed."""
    flags = [{name: p.requires_grad for name, p in m.named_parameters()} for m in models]
    return tuple(name for name, flag in flags[0].items() if any(f.get(name, flag) != flag for f in flags[1:]))


def _describe(failures: dict[str, str]) -> str:
    return "; ".join(f"{path or '(model)'} {reason}" for path, reason in failures.items())


def as_args_kwargs(sample: dict | tuple | torch.Tensor) -> tuple[tuple, dict]:
    """A sample as a forward's ``(args, kwargs)``: a dict is keyword arguments, a tensor or a tuple positional."""
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    return tuple(sample), {}
