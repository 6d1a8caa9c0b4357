"""``hf-wide benchmark``: how fast is the wide model, against what users do today and against the bound?

In one process, on the same inputs, every configuration is run as: the N checkpoints one after another
(``sequential``), the ``torch.func`` vmap recipe (``vmap``), the wide model eager and compiled, and the
``ideal``: one checkpoint on the whole N*B batch, eager and compiled (DESIGN.md, "Performance model").

    from hf_wide.benchmark import run_benchmark
    records = run_benchmark("quick", json_path="bench.json", plot_path="speedup.png")

Times are medians under ``torch.inference_mode()`` after warm-up; compile time is reported apart. The package
imports its timing code (torch, transformers) when :func:`run_benchmark` is first asked for, so that
``hf-wide benchmark --help`` (``cli.py``) is quick.
"""

from __future__ import annotations

PRESETS = ("tiny", "quick", "full", "lora")  # configs.preset_configs
COMPILE_POLICIES = ("all", "subset", "none")  # configs.apply_compile_policy

__all__ = ["run_benchmark", "PRESETS", "COMPILE_POLICIES"]


def __getattr__(name: str):
    if name == "run_benchmark":
        from .runner import run_benchmark

        return run_benchmark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
