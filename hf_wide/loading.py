"""Member checkpoints loaded into one wide model, once they are on disk (:mod:`hf_wide.download` fetches them).

The low-memory path (:func:`load_streaming`, DESIGN.md "The Hub"): member 0 is loaded alone for the trace and
dropped; the wide model is then built from meta-device skeletons and filled member by member from the safetensors
files (:mod:`hf_wide.checkpoints`), so the peak stays near the fused model's own size, and :func:`verified` checks
every fused module against the members as transformers runs them. Pickle checkpoints, and checkpoints whose tensor
names transformers must convert, are loaded as whole models instead (:func:`load_models`). The dtype and the one
device a load asks for are read in :mod:`hf_wide.placement`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from huggingface_hub.utils import tqdm as hf_tqdm
from torch import nn

from . import plan_cache
from .checkpoints import Checkpoint, assemble, same_bytes, skeleton_like, state_tensors
from .compat import IncompatibleMembersError, check_configs, refuse_other_class, require_one_dtype
from .fallback_roots import STAND_IN
from .forward_state import StateSnapshot, refuse_changes
from .planner import plan_members, tensor_aliases
from .samples import sample_inputs
from .saving import config_differences, member_config, model_class_for
from .verify import diagnose
from .verify_cache import require_cache_agrees

logger = logging.getLogger(__name__)


def weights_format(folder: Path, name: str, allow_pickle: bool) -> bool:
    """True for safetensors; False for pickle (when allowed); raise when there are no usable weights."""
    if any(folder.glob("*.safetensors")):
        return True
    if any(folder.glob("*.bin")):
        if allow_pickle:
            return False
        raise ValueError(
            f"{name} has only pickle weights (*.bin), which can run arbitrary code when loaded. "
            "Pass allow_pickle=True if you trust it."
        )
    raise FileNotFoundError(f"{name} has no model weights (*.safetensors) in {folder}.")


def _auto_dtypes(configs: list, stored: list[dict]) -> list[torch.dtype]:
    """The dtype transformers loads each member in without a dtype ("auto"): its config's ``dtype`` where it names
    one (a config saying bfloat16 over float32 tensors: bfloat16), else that of its floating-point tensors."""
    found = []
    for config, tensors in zip(configs, stored):
        named = getattr(config, "dtype", None)
        named = getattr(torch, named.removeprefix("torch."), None) if isinstance(named, str) else named
        floating = next((d for d in tensors.values() if d.is_floating_point), None)
        found.append(named if isinstance(named, torch.dtype) else floating)
    return found


def load_streaming(cls, ids, folders, names, dtype, device, trust_remote_code, allow_label_mismatch,
                    share_identical, model_kwargs: dict | None = None, cached: bool = False, read_cache: bool = True):
    """The low-memory path: member 0 alone for the trace, then the wide model filled from the files.
    Returns None when a checkpoint's tensor names differ from its model's (transformers must convert them).
    ``cached`` (the caller verifies what this returns): a list of the same structure fused before is filled by the
    plan it was fused by (:mod:`hf_wide.plan_cache`), not traced, unless it keeps once a tensor the files hold apart;
    the wide model's ``_plan_cache`` is (the key to keep its plan under once verified, or None without ``cached``;
    whether it was traced). ``read_cache=False``: traced, the plan kept all the same."""
    raw = [transformers.AutoConfig.from_pretrained(f, trust_remote_code=trust_remote_code) for f in folders]
    classes = [model_class_for(raw[0], names[0], folders[0], trust_remote_code)]
    classes += [model_class_for(config, name, folder, trust_remote_code, like=classes[0])
                for config, name, folder in zip(raw[1:], names[1:], folders[1:])]
    for name, config, klass in zip(names[1:], raw[1:], classes[1:]):
        if klass is not classes[0]:
            refuse_other_class(classes[0], klass, names[0], name)
        check_configs(raw[0], config, names[0], name, allow_label_mismatch)
    checkpoints, stale = [Checkpoint(folder) for folder in folders], None
    try:
        template = load_member(folders[0], names[0], dtype, device=None, use_safetensors=True,
                                trust_remote_code=trust_remote_code, **(model_kwargs or {}))
        keys = _checkpoint_keys(template, checkpoints, names)
        if keys is None:
            return None
        if dtype is None or dtype == "auto":  # each alone in its own (given one, every member is loaded in it, as
            stored = [{k: c.dtype(v) for k, v in ks.items()} for c, ks in zip(checkpoints, keys)]  # transformers would)
            require_one_dtype(stored, names, "Pass dtype= to load every member in one")
            require_one_dtype([{"the dtype it loads in (its config's, else its tensors')": d}
                               for d in _auto_dtypes(raw, stored)], names, "Pass dtype= to load every member in one")
        differing = [config_differences(config, raw[0]) for config in raw]
        configs = [member_config(template.config, d) for d in differing]
        generation_configs = [_generation_config(template, folder) for folder in folders]
        skeletons = [skeleton_like(template, c, g) for c, g in zip(configs, generation_configs)]
        identical = {k for k in keys[0] if share_identical and same_bytes(checkpoints, [ks[k] for ks in keys])}
        cache_key = plan_cache.checkpoints_key(template, differing, identical, dict(
            share_identical=share_identical, allow_label_mismatch=allow_label_mismatch)) if (
            cached and plan_cache.enabled()) else None
        plan = None if cache_key is None or not read_cache else plan_cache.load_plan(cache_key)
        traced = plan is None
        if traced:
            stand_ins = [_stand_in(template, identical) for _ in folders[1:]]
            given = StateSnapshot([template])  # (the skeletons are copies of it as loaded; see hf_wide.forward_state)
            plan = plan_members([template, *stand_ins], share_identical=share_identical)
            refuse_changes(given, names)
            del stand_ins
        ties = tensor_aliases(template)
        del template  # free member 0 before the wide model takes its memory
        gc.collect()

        def read(i: int, key: str, dst: torch.Tensor) -> None:  # a tied tensor, under any of its names (a fallback's
            known = next((a for a in ties.get(key, [key]) if a in keys[i]), key)  # copy of BERT's MLM decoder)
            checkpoints[i].read_into(keys[i][known], dst)

        def alike(key: str) -> bool:  # every member's file holds the same tensor, under one of its names
            return any(a in identical for a in ties.get(key, [key]))

        try:
            model, fold, aliases = assemble(skeletons, plan, device, read, alike)
        except Exception as exc:  # a cached plan is never trusted: one that does not build these members is traced past
            if traced or isinstance(exc, OSError):  # (a file that does not read is no plan's doing)
                raise
            stale = exc
    finally:
        for checkpoint in checkpoints:
            checkpoint.close()
    if stale is not None:  # a cached plan that is not these members' (the cache was written by other code, say)
        logger.info("hf-wide: the cached plan is not these members' (%s: %s): tracing them", type(stale).__name__,
                    stale)
        return load_streaming(cls, ids, folders, names, dtype, device, trust_remote_code, allow_label_mismatch,
                              share_identical, model_kwargs, cached, read_cache=False)
    wide = cls(model, plan, fold, aliases, ids, configs, generation_configs)
    wide._source_dirs, wide._plan_cache = list(folders), (cache_key, traced)
    return wide.eval()


def verified(wide, share_identical: bool):
    """``wide`` if every block and primitive agrees with its members (each member a view of the wide model's
    tensors in its own classes: checkpoint i as transformers would run it); else the same members fused anew
    by :meth:`WideModel.from_models`, which moves each module that disagrees one strategy down."""
    members = [wide.member(i, share=True) for i in range(wide.num_members)]
    sample = sample_inputs(members[0])
    # what the checks' forwards change, put back after them
    given, built = StateSnapshot(members, parameters=False), StateSnapshot([wide], parameters=False)
    failures, _ = diagnose(wide, members, (), sample)
    if not failures:
        require_cache_agrees(wide, members, wide.member_ids, sample)
        built.restore()
        return wide
    given.restore()
    logger.warning("hf-wide: %s; fusing the members again with it moved down", "; ".join(
        f"{path or '(model)'} {reason}" for path, reason in failures.items()))
    fused = type(wide).from_models(members, member_ids=wide.member_ids, share_identical=share_identical)
    fused._source_dirs = wide._source_dirs
    return fused


def _checkpoint_keys(template: nn.Module, checkpoints: Sequence[Checkpoint], names: Sequence[str]):
    """For each member, the file key of every state-dict tensor of the template (a tied tensor may be stored
    under any of its names), checking shapes; None if some tensor is not found under any of its names."""
    aliases, tensors = tensor_aliases(template), state_tensors(template)
    found = []
    for checkpoint, name in zip(checkpoints, names):
        keys = {}
        for key, t in tensors.items():
            stored = next((a for a in aliases.get(key, [key]) if a in checkpoint), None)
            if stored is None:
                logger.info("%s has no tensor %r under that name: loading whole members with transformers", name, key)
                return None
            if checkpoint.shape(stored) != tuple(t.shape):
                raise IncompatibleMembersError(
                    f"{name} has {stored!r} of shape {checkpoint.shape(stored)}, but {names[0]} has {tuple(t.shape)}."
                )
            keys[key] = stored
        found.append(keys)
    return found


def _generation_config(template: nn.Module, folder: Path):
    """The generation config transformers would give the member in ``folder`` (None if it cannot generate)."""
    if getattr(template, "generation_config", None) is None:
        return None
    if (Path(folder) / "generation_config.json").exists():
        return transformers.GenerationConfig.from_pretrained(folder)
    # Without one, transformers builds it from the member's own config.json (not member 0's generation config)
    return transformers.GenerationConfig.from_pretrained(folder, config_file_name="config.json",
                                                         _from_model_config=True)


def _stand_in(template: nn.Module, identical: set[str]) -> nn.Module:
    """What the planner needs of members 1..N-1 without loading them: their module tree, holding member 0's very
    tensors where all members agree and an empty tensor where they differ (the planner only compares them)."""
    memo = {}
    for key, t in state_tensors(template).items():
        if key not in identical:
            empty = torch.empty(0, dtype=t.dtype)
            empty = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
            setattr(empty, STAND_IN, True)  # its shape is not the member's: the planner must not compare it
            memo[id(t)] = empty
    for t in (*template.parameters(), *template.buffers()):
        memo.setdefault(id(t), t)
    return copy.deepcopy(template, memo)


def load_models(model_ids, folders, torch_dtype, device, allow_pickle, trust_remote_code,
                **model_kwargs) -> list[nn.Module]:
    show_bar = len(model_ids) > 1 and transformers.utils.logging.is_progress_bar_enabled()
    models = []
    for i, (model_id, folder) in enumerate(hf_tqdm(list(zip(model_ids, folders)), desc="Loading members",
                                                 unit="member", disable=not show_bar)):
        name = f"member {i} ({model_id})"
        use_safetensors = weights_format(folder, name, allow_pickle)
        models.append(load_member(folder, name, torch_dtype, device=device, use_safetensors=use_safetensors,
                                   trust_remote_code=trust_remote_code, like=type(models[0]) if models else None,
                                   **model_kwargs))
    return models


@contextlib.contextmanager
def quiet_transformers_bars():
    """transformers' bar per checkpoint (loading, saving), switched off: the members share one bar."""
    were_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if were_on:
            transformers.utils.logging.enable_progress_bar()


def load_member(folder, name, torch_dtype, *, device, use_safetensors, trust_remote_code, klass=None, like=None,
                 may_miss: frozenset[str] | None = None, **model_kwargs):
    """One member with its own transformers class (or ``klass``), refusing a checkpoint that lacks tensors (but those
    named in ``may_miss``, where given: an adapters' base may lack the head each of them saves whole, and
    transformers' load report, which would call such a head newly initialized, is then not shown: see
    :class:`_HeldReport`). ``model_kwargs`` go to ``from_pretrained`` (an adapter's head may want ``num_labels``).
    ``like``: another member's class, taken where this checkpoint's own code is the same (:func:`model_class_for`)."""
    if klass is None:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        klass = model_class_for(config, name, folder, trust_remote_code, like=like)
    report = _HeldReport(str(folder)) if may_miss else contextlib.nullcontext()
    with quiet_transformers_bars(), report:
        try:
            model, info = klass.from_pretrained(str(folder), dtype=torch_dtype, use_safetensors=use_safetensors,
                                                trust_remote_code=trust_remote_code, output_loading_info=True,
                                                **model_kwargs)
        except SafetensorError as exc:  # a file cut short, say: safetensors names neither the member nor the file
            raise OSError(f"{name}: its weights in {folder} cannot be read: {exc}") from exc
        # (a head of another size, ignore_mismatched_sizes: drawn anew, as a missing one)
        reported_missing = set(info.get("missing_keys") or ()) | {k[0] for k in info.get("mismatched_keys") or ()}
        missing = sorted(reported_missing - (may_miss or set()))
        if may_miss and reported_missing and not missing:
            report.drop()  # every tensor it calls newly initialized is one each adapter holds
    if missing:
        raise IncompatibleMembersError(f"{name}: the checkpoint is missing tensor(s) {', '.join(missing[:5])}" + (
            "." if may_miss is None else ", of which not every adapter holds values (as of a head it saves whole): "
            "transformers would draw them at random."))
    if device is not None:
        model.to(device)
    return model.eval()


class _HeldReport(logging.Filter):
    """``with _HeldReport(folder) as report:`` transformers' load report of ``folder`` (its table of MISSING and
    UNEXPECTED tensors, "newly initialized ... consider training") held back, and shown as transformers would when the
    block ends, unless ``report.drop()`` was called: loading an adapters' base saved for pre-training
    (``bert-base-uncased``) as the adapters' classifier, the head it calls newly initialized is one every adapter
    holds whole. The filter sits on transformers' ``modeling_utils`` logger while the block runs, so it holds that
    one folder's report only."""

    LOGGER = "transformers.modeling_utils"

    def __init__(self, folder: str):
        super().__init__()
        self.folder, self.held, self.dropped = folder, [], False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" in message and f"from: {self.folder}\n" in message:
            self.held.append(record)
            return False
        return True

    def drop(self) -> None:
        self.dropped = True

    def __enter__(self) -> "_HeldReport":
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        log = logging.getLogger(self.LOGGER)
        log.removeFilter(self)
        if not self.dropped:
            for record in self.held:
                log.handle(record)
