"""The transformers releases hf-wide follows, checked when it is imported, and the names that changed between them.

transformers 5.24 renamed the cache its models and layers take and return (``past_key_values``, and Mamba's
``cache_params``, became ``cache``; the old names stay as deprecated aliases). hf-wide's fused blocks take the layers'
place, so they read the cache under either name: a block that missed it would decode without its cache, every token
after the first wrong, with no error. A release hf-wide has not been run against may rename more, so it is refused at
import rather than let a wide model give wrong numbers.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

TRANSFORMERS_BELOW = (5, 25)  # the first release hf-wide does not follow yet
CACHE_NAMES = ("cache", "past_key_values", "cache_params",  # 5.24 on; before it (Mamba: cache_params)
               "past_buckets_states")  # Reformer's, in every release


def require_supported_transformers(version: str | None = None) -> None:
    """Raise ImportError if ``version`` (the installed transformers by default) is one hf-wide does not follow."""
    version = version or transformers.__version__
    if Version(version).release[:2] >= TRANSFORMERS_BELOW:
        below = ".".join(map(str, TRANSFORMERS_BELOW))
        raise ImportError(
            f"hf-wide supports transformers 5.x below {below}; {version} is installed, a release hf-wide has not been "
            "run against. Its fused blocks stand in for transformers' layers and must take the same arguments (5.24 "
            "renamed the cache, past_key_values -> cache): a renamed one they missed would give wrong numbers, with "
            f"no error. Install a supported release: pip install 'transformers>=5,<{below}'")


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a layer was called with, under any of :data:`CACHE_NAMES`, removed from ``kwargs``; None if none."""
    given = [kwargs.pop(name) for name in CACHE_NAMES if name in kwargs]
    given = [cache for cache in given if cache is not None]
    if len(given) > 1:
        raise TypeError(f"a cache was given under two names ({', '.join(CACHE_NAMES)}): pass it as one")
    return given[0] if given else None


# The libraries a wide model's numbers depend on, or that hf-wide's extras bring, in the order `hf-wide env` lists them
LIBRARIES = ("torch", "transformers", "huggingface_hub", "safetensors", "accelerate", "peft", "gradio", "ray")


def environment() -> dict[str, str]:
    """What a bug report needs (``hf-wide env``, as ``transformers env``): hf-wide's, Python's and the libraries'
    versions, the accelerator, and the Hub settings (the endpoint, the cache, offline mode; never the token)."""
    import importlib.metadata
    import platform

    import huggingface_hub.constants as hub
    import torch

    from . import __version__

    found = {"hf-wide": __version__, "Python": platform.python_version(), "Platform": platform.platform()}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["transformers supported"] = f">=5,<{'.'.join(map(str, TRANSFORMERS_BELOW))}"
    if torch.cuda.is_available():
        found["Accelerator"] = f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    elif torch.backends.mps.is_available():
        found["Accelerator"] = "MPS"
    else:
        found["Accelerator"] = f"none (CPU, {torch.get_num_threads()} torch threads)"
    found["Hub endpoint"] = hub.ENDPOINT
    found["Hub cache"] = hub.HF_HUB_CACHE
    found["Hub offline"] = str(hub.HF_HUB_OFFLINE)
    return found
