"""The cache path, checked once at fusion: what verification does not run.

Verification runs the sample without a cache (a cache would be extended by every call), so the path a generating
model takes with one is checked here: a prefill of the sample and one decoding step with the cache it returned,
the wide model against every member doing the same alone. That path is the wide model's own code (a KV cache of
N*B rows; each member's rows of a state-space model's convolution and recurrent states, through
:mod:`hf_wide.primitives.member_cache`), and a state it shares wrongly between members shows nowhere else: Mamba's
mixers once read member 0's state as every member's past, exact without a cache and wrong with one. A
disagreement refuses the fusion, naming the member; a wide model that cannot run with a cache at all says so
when it is asked to, as the member would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .cache_path import cache_name, decode, token_ids_name
from .inputs import CacheRowsError
from .model import WideValidationError, first_tensor
from .compare import tf32_possible, tolerance
from .versions import CACHE_NAMES

__all__ = ["cache_name", "check_cache", "require_cache_agrees"]


def check_cache(wide, models: Sequence[nn.Module], names: Sequence[str], kwargs: dict) -> str | None:
    """None if the wide model with a cache (a prefill of the sample ``kwargs``, then one step) gives every member's
    output; else what differs. Models without a cache, and samples without token ids, are not checked."""
    name = cache_name(models[0])
    kwargs = {k: v for k, v in kwargs.items() if k not in ("use_cache", *CACHE_NAMES)}  # the sample's own say
    ids = token_ids_name(kwargs)
    if name is None or ids is None:
        return None
    with torch.no_grad():
        try:
            got = _two_steps(wide, name, ids, kwargs)
        except CacheRowsError as exc:  # its own cache, from the prefill: made wrong (a state the members shared)
            return f"{names[0]}: with a cache ({name}), the fused model's own cache differs from its members' ({exc})"
        except Exception:  # the wide model refuses a cache (a static one, a layer it cannot split): loud when used
            return None
        if got is None:
            return None
        for i, model in enumerate(models):
            try:
                want = _two_steps(model, name, ids, kwargs)
            except Exception:  # the member itself cannot: nothing to hold the wide model to
                return None
            if want is None:
                return None
            for step, (out, ref) in enumerate(zip(got, want)):
                what = "the prefill" if step == 0 else "a decoding step"
                if out[i].shape != ref.shape:
                    return (f"{names[i]}: with a cache ({name}), the fused model's output on {what} has shape "
                            f"{tuple(out[i].shape)}, the member's {tuple(ref.shape)}")
                diff = (out[i].float() - ref.float()).abs().max().item()
                if not diff <= tolerance(ref, tf32_possible(models[i])):
                    if not _repeats(model, name, ids, kwargs, want, tf32_possible(models[i])):
                        return None  # the member differs from itself (Reformer's hashing unseeded: random rotations)
                    return (f"{names[i]}: with a cache ({name}), the fused model's output on {what} differs from the "
                            f"member run alone by {diff:.3g} (without one it agrees)")
    return None


def _repeats(model: nn.Module, name: str, ids: str, kwargs: dict, outputs: tuple, tf32: bool) -> bool:
    """Whether ``model`` gives ``outputs`` whatever the random state: run again from three seeds (the caller's random
    state kept). A member that draws random numbers in eval mode gives another output from each (Reformer's unseeded
    hashing: one run again alone agreed with the first by chance, once in six), and no fused model can be held to
    it; one that seeds itself (Reformer's ``hash_seed``) gives the same."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    runs = []
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        for seed in range(3):
            torch.manual_seed(seed)
            runs.append(_two_steps(model, name, ids, kwargs))
    return all(again is not None and all(
        a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= tolerance(b, tf32)
        for a, b in zip(again, outputs)) for again in runs)


def require_cache_agrees(wide, models: Sequence[nn.Module], names: Sequence[str], kwargs: dict) -> None:
    """:func:`check_cache`, refusing the fusion with a :class:`WideValidationError` where the cache path differs."""
    problem = check_cache(wide, models, names, kwargs)
    if problem:
        raise WideValidationError(f"hf-wide cannot fuse these members exactly: {problem}. Plan:\n{wide.plan}")


def _two_steps(model: nn.Module, name: str, ids: str, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first output tensor of a prefill of ``kwargs`` with a cache, and of one more token with it; None if the
    model returned no cache (an encoder given ``use_cache``)."""
    outputs = decode(model, kwargs, ids, name)
    return None if outputs is None else (first_tensor(outputs[0]), first_tensor(outputs[1]))
