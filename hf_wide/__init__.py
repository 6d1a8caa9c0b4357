"""hf-wide: run N fine-tuned checkpoints of one architecture as one wide model."""

from .versions import require_supported_transformers

require_supported_transformers()  # before anything builds on transformers: see hf_wide/versions.py

from . import blocks, primitives, rewrites  # noqa: F401  (fill the registries)
from .compat import IncompatibleMembersError
from .cpu import tune_cpu_allocator
from .inputs import PerMember
from .model import WideModel, WideValidationError
from .pipelines import calibrate, pipeline
from .plan import Kind, WidePlan
from .registry import register_wide

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "WideTrainer":  # transformers' Trainer (and accelerate) imported only when asked for
        from .trainer import WideTrainer

        return WideTrainer
    raise AttributeError(f"module 'hf_wide' has no attribute {name!r}")


__all__ = [
    "IncompatibleMembersError",
    "Kind",
    "PerMember",
    "WideModel",
    "WidePlan",
    "WideTrainer",
    "WideValidationError",
    "calibrate",
    "pipeline",
    "register_wide",
    "tune_cpu_allocator",
]
