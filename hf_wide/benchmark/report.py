"""Reporting the benchmark: machine facts, the terminal tables, the JSON file and the speedup plot."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import time
from collections import defaultdict

import torch
import transformers

from ..cpu import allocator_state
from .methods import METHOD_NAMES

SLOW_VS_IDEAL = 1.3  # wide more than this much slower than the ideal is worth optimising
BUSY_CPUS = 0.25  # other processes using more CPUs than this on average make the timings unreliable
ATOL = 1e-3  # float32: a method whose outputs differ from the members run alone by more is wrong
SHORT = {"sequential": "seq", "vmap": "vmap", "wide": "wide", "wide_compiled": "wide_c", "ideal": "ideal",
         "ideal_compiled": "ideal_c", "peft_mixed": "peft_mix"}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall seconds, CPU-seconds the whole machine has been busy, CPU-seconds of this process and its
    children), or None where /proc/stat is missing (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    return time.monotonic(), busy, ours


def other_cpus(before, after) -> float | None:
    """How many CPUs other processes kept busy on average between two snapshots."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others / (after[0] - before[0]))


def device_name(device: torch.device) -> str:
    """The accelerator's name (``NVIDIA H100 80GB HBM3``), or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model() if device.type == "cpu" else str(device)


def machine_info(matmul_gflops: float, others_before: float | None, others_during: float | None,
                 device: torch.device = torch.device("cpu")) -> dict:
    """Facts that make the numbers comparable. ``others_*``: CPUs used by other processes just before
    the benchmark and while it ran (None where unknown); ``matmul_gflops`` was measured on ``device``."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "matmul_gflops": round(matmul_gflops, 1),
        "cpu_allocator": allocator_state(),
        "other_cpus_before": None if others_before is None else round(others_before, 2),
        "other_cpus_during": None if others_during is None else round(others_during, 2),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def ms_cell(method: dict) -> str:
    if method.get("skipped"):
        return "-"
    return "err" if method["ms"] is None else f"{method['ms']:.2f}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _rows_to_text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def format_table(records: list[dict], machine: dict, notes: list[str] = ()) -> str:
    """Milliseconds per method and the ratios, then GFLOP/s, compile seconds and output agreement."""
    on = "" if machine.get("device", "cpu") == "cpu" else f"on {machine['device_name']} ({machine['device']}), "
    head = (f"torch {machine['torch']}, {on}{machine['threads']} threads, {machine['cpu']}, "
            f"float32 matmul {machine['matmul_gflops']} GFLOP/s, {machine['date']}\n"
            f"CPU allocator: {machine['cpu_allocator']}")
    key = ["config", "N", "B", "seq"]
    times = _rows_to_text(
        key + [f"{SHORT[m]} ms" for m in METHOD_NAMES] + ["seq/wide", "wide/ideal", "wide_c/ideal_c"],
        [[r["config"], str(r["n"]), str(r["batch"]), str(r["seq"]), *(ms_cell(r["methods"][m]) for m in METHOD_NAMES),
          _ratio(r["sequential_over_wide"]), _ratio(r["wide_over_ideal"]),
          _ratio(r["wide_compiled_over_ideal_compiled"])] for r in records])
    rates = _rows_to_text(
        key + ["MFLOP/member"] + [f"{SHORT[m]} GF/s" for m in METHOD_NAMES]
        + ["fuse s", "wide_c compile s", "ideal_c compile s", "max abs diff"],
        [[r["config"], str(r["n"]), str(r["batch"]), str(r["seq"]), f"{r['flops_member'] / 1e6:.1f}",
          *(_gflops(r["methods"][m]) for m in METHOD_NAMES), _seconds(r["methods"]["wide"]["build_s"]),
          *(_seconds(r["methods"][m]["first_call_s"]) for m in ("wide_compiled", "ideal_compiled")),
          "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"] for r in records])
    others = [machine[k] for k in ("other_cpus_before", "other_cpus_during") if machine[k] is not None]
    if max(others, default=0.0) > BUSY_CPUS:
        head += (f"\nWARNING: other processes kept {machine['other_cpus_before']} CPUs busy before the benchmark and "
                 f"{machine['other_cpus_during']} while it ran (of {machine['cpu_count']}): timings are unreliable.")
    sections = [head, "", "Median ms per forward of all N members (ideal: one member on N*B rows):", times, "",
                "Achieved GFLOP/s, seconds to fuse and to compile (first call, with torch's on-disk compile cache "
                "as found), largest difference from the members run alone:", rates]
    notes = [*notes, *failures(records), *flags(records)]
    return "\n".join(sections + ([""] + notes if notes else []))


def _gflops(method: dict) -> str:
    return "-" if method.get("gflops") is None else f"{method['gflops']:.1f}"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def failures(records: list[dict]) -> list[str]:
    """One line per (method, error message), with the configs it happened on."""
    by_error = defaultdict(list)
    for r in records:
        for name, m in r["methods"].items():
            if m["error"]:
                by_error[(name, m["error"].splitlines()[0][:300])].append(label(r))
    lines = [f"{name} FAILED on {len(labels)} config(s) ({', '.join(labels[:3])}{', ...' if len(labels) > 3 else ''}): "
             f"{msg}" for (name, msg), labels in by_error.items()]
    skipped = sum(not r["compiled"] for r in records)
    if skipped:
        lines.append(f"wide_c and ideal_c: not compiled on {skipped} of {len(records)} config(s) (see --compile)")
    return lines


def mismatches(records: list[dict]) -> list[str]:
    """Methods whose outputs differ from the members run alone by more than ``ATOL``: a wrong fast path."""
    return [f"OUTPUT MISMATCH: {label(r)}: {name} differs by {m['max_abs_diff']:.3g} (tolerance {ATOL})"
            for r in records for name, m in r["methods"].items()
            if m["max_abs_diff"] is not None and not m["max_abs_diff"] <= ATOL]


def flags(records: list[dict]) -> list[str]:
    """Mismatches, then configs where wide loses to the sequential loop or is far from the ideal: what to
    optimise next."""
    lines = mismatches(records)
    for r in records:
        for suffix, tag in (("", "eager"), ("_compiled", "compiled")):
            seq_ms, wide_ms = r["methods"]["sequential"]["ms"], r["methods"]["wide" + suffix]["ms"]
            ideal_ms = r["methods"]["ideal" + suffix]["ms"]
            if wide_ms is None:
                continue
            if seq_ms is not None and wide_ms > seq_ms:
                lines.append(f"SLOWER THAN SEQUENTIAL ({tag}): {label(r)}: wide {wide_ms:.2f} ms vs {seq_ms:.2f} ms")
            if ideal_ms is not None and wide_ms > SLOW_VS_IDEAL * ideal_ms:
                lines.append(f"FAR FROM IDEAL ({tag}): {label(r)}: wide {wide_ms:.2f} ms = "
                             f"{wide_ms / ideal_ms:.2f}x ideal {ideal_ms:.2f} ms")
    return lines


def label(record: dict) -> str:
    return f"{record['config']} N={record['n']} B={record['batch']} seq={record['seq']}"


def write_json(path: str, records: list[dict], machine: dict, preset: str | None) -> None:
    with open(path, "w") as f:
        json.dump({"machine": machine, "preset": preset, "records": records}, f, indent=2)
        f.write("\n")


def write_plot(path: str, records: list[dict]) -> str | None:
    """Speedup of wide over sequential against N, one line per (config, B, seq); compiled wide as crosses.
    Returns None when written, or why not (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): skipped the plot"
    groups = defaultdict(list)  # (config, B, seq) -> [(N, eager speedup, compiled speedup)]
    for r in records:
        compiled = r["methods"]["wide_compiled"]["ms"]
        seq_ms = r["methods"]["sequential"]["ms"]
        groups[(r["config"], r["batch"], r["seq"])].append(
            (r["n"], r["sequential_over_wide"], None if compiled is None or seq_ms is None else seq_ms / compiled))
    fig, ax = plt.subplots(figsize=(9, 6))
    for (config, batch, seq), points in sorted(groups.items()):
        points.sort()
        eager = [(n, s) for n, s, _ in points if s is not None]
        line = ax.plot([n for n, _ in eager], [s for _, s in eager], marker="o", label=f"{config} B={batch} seq={seq}")
        compiled = [(n, c) for n, _, c in points if c is not None]
        if compiled:
            ax.scatter([n for n, _ in compiled], [c for _, c in compiled], marker="x", s=60, color=line[0].get_color())
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ns = sorted({r["n"] for r in records})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("N (members)")
    ax.set_ylabel("speedup of wide over sequential (x: compiled)")
    ax.set_title("hf-wide: wide vs N models run one after another")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
