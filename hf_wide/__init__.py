"""hf-wide: run N fine-tuned checkpoints of one architecture as one wide model.

The names below are imported on first use (PEP 562), as transformers' are: ``import hf_wide`` or one light module
(``hf_wide.cpu``) stays clear of torch's and transformers' modelling code (1.5 s instead of 10 on a 2-core machine).
hf-wide's own builders register when a lookup first needs them (:mod:`hf_wide.registry`)."""

import importlib

from .versions import require_supported_transformers

require_supported_transformers()  # before anything builds on transformers: see hf_wide/versions.py

__version__ = "0.1.0"

_EXPORTS = {  # name -> the module of hf_wide that defines it
    "IncompatibleMembersError": "compat",
    "Kind": "plan",
    "PerMember": "inputs",
    "WideModel": "model",
    "WidePlan": "plan",
    "WideTrainer": "trainer",  # with transformers' Trainer (and accelerate)
    "WideValidationError": "model",
    "calibrate": "pipelines",
    "pipeline": "pipelines",
    "register_wide": "registry",
    "tune_cpu_allocator": "cpu",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):  # a submodule not imported yet, as `import hf_wide` once made them all attributes
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
