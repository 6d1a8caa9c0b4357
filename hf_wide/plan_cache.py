"""Plans kept on disk: a list of members loaded again is verified by the plan it was fused by, not traced.

The trace of member 0 is about half of a load's time (over adapters of one base, most of it) and a share of what it
holds (README, "LoRA members"). The plan it leads to depends on the members' architecture and config, the device type
and dtype, which of their tensors are the same in every member (a module all of them hold alike is kept once), the
adapters' configs (targets, ranks, ``modules_to_save``), and the code that traced and planned (hf-wide's own source,
and the versions of torch, transformers and peft), not on the weights' values, so it is kept under a key of those in
``$HF_WIDE_PLAN_CACHE`` (by default ``plans/`` in hf-wide's cache: ``$HF_WIDE_CACHE`` or ``~/.cache/hf-wide``)::

    key = plan_key(base_model, configs, fuse_options)   # adapters over a base: a hex digest
    key = checkpoints_key(member_0, differing, identical, fuse_options)   # full checkpoints, streamed
    key = models_key(members, fuse_options)             # full checkpoints loaded whole (pickle weights)
    plan = load_plan(key)                               # None where there is none, or it does not read
    store_plan(key, wide.plan)                          # after a verified fusion that traced

A cached plan is never trusted: :func:`hf_wide.fuse.fuse_models` builds by it only where it names these members'
modules and every module it keeps once holds the same tensors in every member, verifies what it built as any fusion,
and traces the members afresh where the check disagrees (a plan read from a saved ensemble, or cached for members
loaded whole, is used the same way); full checkpoints are streamed into the cached plan's wide model, unless it reads
once a tensor their files hold apart, and verified as after a trace (:func:`hf_wide.loading.verified`), fused anew
from the members where a module disagrees.
``HF_WIDE_DISABLE_PLAN_CACHE=1`` turns the cache off; nothing is read or written then.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import nn

from .download import cache_home
from .plan import WidePlan

logger = logging.getLogger(__name__)

KEY_VERSION = 1  # raised where what a key covers changes


def cache_folder() -> Path:
    """Where plans are kept: ``$HF_WIDE_PLAN_CACHE``, else ``plans/`` in hf-wide's cache folder."""
    folder = os.environ.get("HF_WIDE_PLAN_CACHE")
    if folder:
        return Path(folder)
    return cache_home() / "plans"


def enabled() -> bool:
    return os.environ.get("HF_WIDE_DISABLE_PLAN_CACHE", "").strip().lower() not in ("1", "true", "yes", "on")


def _version(package: str) -> str | None:
    """``package``'s installed version, None where it is not installed (peft is an extra)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def code_digest() -> str:
    """A digest of hf-wide's own source (its version number changes less often than the planner and builders)."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def plan_key(base: nn.Module, configs: Sequence[dict | None], options: dict) -> str:
    """A digest of what a plan of these adapters over ``base`` depends on: the base's class, config (not where it
    was loaded from), attention implementation, dtype and device type; each member's adapter config (None for a
    full member) less the base it names; the fusion's ``options``; and hf-wide's code and the versions of torch,
    transformers and peft."""
    adapters = [None if c is None else {k: v for k, v in c.items() if k not in ("base_model_name_or_path", "revision")}
                for c in configs]
    return _digest(base, adapters=adapters, options=sorted(options.items()))


def checkpoints_key(template: nn.Module, differing: Sequence[dict], identical: Iterable[str], options: dict) -> str:
    """A digest of what a plan of N full checkpoints depends on: member 0's (``template``'s) class, config, attention
    implementation, dtype and device type, as :func:`plan_key`; each member's config where it differs from member
    0's (``differing``: labels, say), less where it came from; the names of the tensors every member holds alike
    (``identical``: the modules kept once); the fusion's ``options``; hf-wide's code and the libraries' versions."""
    configs = [{k: v for k, v in d.items() if k not in PROVENANCE} for d in differing]
    return _digest(template, configs=configs, identical=sorted(identical), options=sorted(options.items()))


PROVENANCE = ("_name_or_path", "_commit_hash", "transformers_version")  # where a config came from, not what it says


def models_key(models: Sequence[nn.Module], options: dict) -> str:
    """:func:`checkpoints_key` of members loaded whole (pickle checkpoints, or tensor names transformers converts):
    their configs as they differ from member 0's, and the state tensors every member holds alike, by value."""
    from .checkpoints import state_tensors
    from .planner_rules import same_tensors
    from .saving import config_differences

    configs = [getattr(m, "config", None) for m in models]
    differing = [{} if c is None else config_differences(c, configs[0]) for c in configs]
    states = [m.state_dict(keep_vars=True) for m in models]
    alike = {name for name in state_tensors(models[0])
             if all(name in s for s in states) and same_tensors([s[name].detach() for s in states])}
    return checkpoints_key(models[0], differing, alike, options)


def _digest(model: nn.Module, **what) -> str:
    config = model.config.to_dict() if hasattr(model, "config") else {}
    for where in PROVENANCE:
        config.pop(where, None)
    tensor = next(iter(model.parameters()), None)
    what = {
        "key_version": KEY_VERSION,
        "versions": [code_digest(), *map(_version, ("torch", "transformers", "peft"))],
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config,
        "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
        "tensors": None if tensor is None else [str(tensor.dtype), tensor.device.type],
        **what,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()


def load_plan(key: str) -> WidePlan | None:
    """The plan kept under ``key``, or None: none kept, the cache off, or a file that does not read as a plan."""
    from .saving import plan_from_dict

    path = cache_folder() / f"{key}.json"
    if not enabled() or not path.is_file():
        return None
    try:
        plan = plan_from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as exc:  # (a torn or foreign file: traced, and written anew)
        logger.info("hf-wide: the cached plan %s does not read (%s): tracing", path, exc)
        return None
    logger.info("hf-wide: fusing by the plan cached in %s, verified", path)
    return plan


def store_plan(key: str, plan: WidePlan) -> None:
    """Keep ``plan`` under ``key`` (written whole, then renamed: a reader never sees part of it). A cache that
    cannot be written (a read-only home) is passed over: the next load traces again."""
    from .saving import plan_to_dict

    if not enabled():
        return
    folder = cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as file:
                json.dump(plan_to_dict(plan), file)
            os.replace(temporary, folder / f"{key}.json")
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as exc:
        logger.info("hf-wide: the plan was not cached in %s (%s)", folder, exc)
