"""The preset grids and ``--models`` timed method by method: :func:`run_benchmark` (``hf_wide.benchmark``)."""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn

from ..tracer import module_flops
from . import COMPILE_POLICIES, report
from .configs import BenchConfig, apply_compile_policy, make_inputs, preset_configs
from .methods import matmul_gflops, measure

MODELS_TARGET_S = 1.0  # timing target per method for user checkpoints (--models)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _measure_config(label: dict, members: Sequence[nn.Module], inputs: dict, flops: int, compiled: bool,
                    target_s: float, base: nn.Module | None = None) -> dict:
    """One record: every method on ``members`` and ``inputs`` (B rows), timed and checked.
    ``flops``: one member's forward on the inputs; ``base``: the ideal's model, for LoRA members."""
    n = len(members)
    methods = measure(members, inputs, compiled, target_s, base)
    for method in methods.values():
        method["gflops"] = None if method["ms"] is None else n * flops / (method["ms"] / 1e3) / 1e9
    ms = {name: m["ms"] for name, m in methods.items()}
    diffs = [m["max_abs_diff"] for m in methods.values() if m["max_abs_diff"] is not None]
    return {
        **label,
        "n": n,
        "threads": torch.get_num_threads(),
        "flops_member": flops,
        "flops_total": n * flops,
        "compiled": compiled,
        "methods": methods,
        "max_abs_diff": max(diffs, default=None),
        "sequential_over_wide": _ratio(ms["sequential"], ms["wide"]),
        "wide_over_ideal": _ratio(ms["wide"], ms["ideal"]),
        "sequential_over_wide_compiled": _ratio(ms["sequential"], ms["wide_compiled"]),
        "wide_compiled_over_ideal_compiled": _ratio(ms["wide_compiled"], ms["ideal_compiled"]),
        "peft_mixed_over_wide": _ratio(ms["peft_mixed"], ms["wide"]),
    }


def _to(device: torch.device, inputs: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _preset_records(configs: list[BenchConfig], target_s: float, max_gflop: float,
                    device: torch.device = torch.device("cpu")) -> tuple[list[dict], list[str]]:
    """The records of the configs within the FLOP budget, and a note for each one skipped; members, base and
    inputs on ``device``."""
    records, skipped = [], []
    for i, config in enumerate(configs, 1):
        start = time.perf_counter()
        label = {"config": config.spec.name, "family": config.spec.family, "hidden": config.spec.hidden,
                 "layers": config.spec.layers, "models": None, "batch": config.batch, "seq": config.seq}
        if config.spec.lora and importlib.util.find_spec("peft") is None:
            skipped.append(f"{report.label({**label, 'n': config.n})} (peft is not installed: "
                           "pip install 'hf-wide[lora]')")
            continue
        first = config.spec.build(0)
        inputs = make_inputs(first, config.batch, config.seq)
        flops = module_flops(first, (), inputs)[""]
        if config.n * flops > max_gflop * 1e9:
            skipped.append(f"{report.label({**label, 'n': config.n})} ({config.n * flops / 1e9:.0f} GFLOP)")
            continue
        members = [model.to(device) for model in [first, *(config.spec.build(seed) for seed in range(1, config.n))]]
        base = config.spec.base().to(device) if config.spec.lora else None
        records.append(_measure_config(label, members, _to(device, inputs), flops, config.compile, target_s, base))
        del first, members, inputs
        gc.collect()
        _progress(f"[{i}/{len(configs)}]", records[-1], time.perf_counter() - start)
    return records, skipped


def _models_records(model_ids: Sequence[str], batch: int, seq: int, compiled: bool, offline: bool,
                    device: torch.device) -> list[dict]:
    from ..compat import check_compatible
    from ..hub import load_members

    members, ids = load_members(model_ids, local_files_only=offline)[:2]  # (models, ids[, revisions])
    check_compatible(members, ids, allow_label_mismatch=True)  # timing: labels aside
    _check_positions(members[0], seq)
    for model in members:
        model.eval()
    label = {"config": type(members[0]).__name__, "family": None, "hidden": None, "layers": None,
             "models": list(ids), "batch": batch, "seq": seq}
    start = time.perf_counter()
    inputs = make_inputs(members[0], batch, seq)
    flops = module_flops(members[0], (), inputs)[""]
    members = [model.to(device) for model in members]
    record = _measure_config(label, members, _to(device, inputs), flops, compiled, MODELS_TARGET_S)
    _progress("[1/1]", record, time.perf_counter() - start)
    return [record]


def _check_positions(model: nn.Module, seq: int) -> None:
    """Refuse token inputs longer than the model's positions: its position embeddings have no row for them."""
    if getattr(model, "main_input_name", None) != "input_ids":  # (images, audio: no --seq)
        return
    for name in ("max_position_embeddings", "n_positions"):  # (GPT-2's name for it)
        limit = getattr(model.config, name, None)
        if isinstance(limit, int) and seq > limit:
            raise ValueError(f"seq {seq} is longer than the {limit} positions of {type(model).__name__} "
                             f"(config.{name}): give a sequence length of at most {limit} (--seq).")


def _progress(prefix: str, record: dict, seconds: float) -> None:
    times = ", ".join(f"{report.SHORT[name]} {report.ms_cell(m)}" for name, m in record["methods"].items())
    print(f"{prefix} {report.label(record)}: {times} ms ({seconds:.1f} s)", file=sys.stderr, flush=True)


def run_benchmark(
    preset: str = "quick",
    *,
    models: Sequence[str] | None = None,
    batch: int = 8,
    seq: int = 64,
    compile: str | None = None,
    threads: int | None = None,
    max_gflop: float | None = None,
    offline: bool = False,
    device: str | torch.device = "cpu",
    json_path: str | None = None,
    plot_path: str | None = None,
) -> list[dict]:
    """Run a preset (``tiny``, ``quick``, ``full``, ``lora``), or the checkpoints ``models`` on ``batch`` x ``seq``
    inputs; print the tables and return one record per configuration.

    ``compile`` (``all``, ``subset``, ``none``) overrides the preset's choice of configs to run under
    ``torch.compile``; ``max_gflop`` its budget (configs whose forward of all N members needs more GFLOP are
    skipped); ``threads`` sets ``torch.set_num_threads`` first. ``device``: where every method runs (members, base
    and inputs are built on the CPU and moved there; times are to the device's completion).
    """
    device = torch.device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    preset_name = None if models else preset
    idle_start = report.cpu_snapshot()
    time.sleep(0.5)  # what other processes use while this one sleeps
    start = report.cpu_snapshot()
    matmul = matmul_gflops(device=device)
    notes = []
    if models:
        if compile not in (None, *COMPILE_POLICIES):
            raise ValueError(f"Unknown compile policy {compile!r}; supported: {COMPILE_POLICIES}")
        records = _models_records(models, batch, seq, compile != "none", offline, device)
    else:
        chosen = preset_configs(preset)
        budget = chosen.max_gflop if max_gflop is None else max_gflop
        configs = apply_compile_policy(chosen.configs, compile or chosen.compile)
        records, skipped = _preset_records(configs, chosen.target_s, budget, device)
        if skipped:
            notes.append(f"skipped {len(skipped)} config(s), over the budget of {budget:g} GFLOP per forward of all "
                         f"members (see --max-gflop) or as noted: {', '.join(skipped)}")
    others_before, others_during = report.other_cpus(idle_start, start), report.other_cpus(start, report.cpu_snapshot())
    machine = report.machine_info(matmul, others_before, others_during, device)
    print(report.format_table(records, machine, notes))
    if json_path:
        report.write_json(json_path, records, machine, preset_name)
        print(f"\nwrote {json_path}")
    if plot_path:
        why_not = report.write_plot(plot_path, records)
        print(f"\n{why_not}" if why_not else f"\nwrote {plot_path}")
    return records
