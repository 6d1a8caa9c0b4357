"""Where the small-batch gap to the ideal goes: ``python -m hf_wide.benchmark.weight_traffic``.

At small batches the wide model loses to the ideal (one checkpoint on all N*B rows) for two reasons that
a plain timing cannot tell apart: the fused ops themselves (batched matmuls over N small blocks, per-member
affines), and memory: the wide model reads N weight sets per forward where the ideal reads one, which stays
in cache. This script separates them with a control, ``one set``: the same wide model whose matmul weights
(every ``WideLinear`` and fused QKV weight, ``(N, D_out, D_in)``) are replaced by member 0's, expanded to N
without a copy. It runs exactly the wide model's kernels on exactly its shapes, but streams one weight set.
Its outputs are not the members' (every member computes with member 0's matmul weights), so it is a timing
control only; the wide model's outputs are checked against the members run alone.

- ``one set / ideal``: what fusing costs with the weight traffic taken away;
- ``wide / one set``: what reading N weight sets costs.

Eager and compiled (``torch.compile``, default options), timed round-robin like ``hf-wide benchmark``.

Why the N weight sets cost more than their bytes: ``cache retention`` (printed first) times one thread
re-reading a buffer the size of one member's weights and of eight members', right after its last read and
after idle gaps in which this process touches no memory. On a machine of one's own, a buffer that fits the
last-level cache reads as fast after any gap; where other tenants share the caches, it falls out of them
while the process waits, and a wide forward waits between one use of a layer's weights and the next.
``matmuls`` (eager) times the batched matmuls of the wide model and of the control inside their forwards
and replayed back to back (the same calls on the same tensors, every weight re-read at once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..model import WideModel
from ..primitives.embedding import WideEmbedding
from ..primitives.linear import WideLinear
from .configs import ModelSpec, make_inputs
from .methods import time_interleaved

CONFIGS = [("bert", 128, 8, 1, 16), ("llama", 128, 8, 1, 16), ("bert", 128, 2, 1, 16)]  # family, hidden, N, B, seq


RETENTION_MB = (1.6, 13.0)  # one BERT h128 member's matmul weights; eight members'
RETENTION_GAPS_US = (0, 500, 2000, 10000)


def cache_retention(sizes_mb=RETENTION_MB, gaps_us=RETENTION_GAPS_US, reads: int = 100) -> list[dict]:
    """GB/s of one thread summing a float32 buffer of each size, ``gap`` microseconds after its previous read
    (the median of ``reads``). The gap spins on the clock: no memory traffic, no sleep, the core stays busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    records = []
    try:
        for size_mb in sizes_mb:
            buffer = torch.ones(int(size_mb * 2**20) // 4)
            buffer.sum()  # faulted in and cached
            for gap_us in gaps_us:
                times = []
                for _ in range(reads):
                    end = time.perf_counter() + gap_us * 1e-6
                    while time.perf_counter() < end:
                        pass
                    start = time.perf_counter()
                    buffer.sum()
                    times.append(time.perf_counter() - start)
                read_s = sorted(times)[len(times) // 2]
                records.append({"mb": size_mb, "gap_us": gap_us, "read_us": read_s * 1e6,
                                "gb_per_s": buffer.numel() * 4 / read_s / 1e9})
    finally:
        torch.set_num_threads(threads)
    return records


def format_retention(records: list[dict]) -> str:
    lines = ["cache retention (1 thread re-reads a buffer after an idle gap):"]
    for size_mb in dict.fromkeys(r["mb"] for r in records):
        rows = [r for r in records if r["mb"] == size_mb]
        reads = ", ".join(f"{r['gap_us'] / 1000:g} ms: {r['gb_per_s']:.0f}" for r in rows)
        lines.append(f"  {size_mb:g} MB, GB/s after a gap of {reads}")
    return "\n".join(lines)


MATMULS = (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)


class _MatmulTimer(TorchDispatchMode):
    """Adds up the time of every batched matmul it sees, and keeps the calls."""

    def __init__(self):
        super().__init__()
        self.seconds, self.calls = 0.0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in MATMULS:
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls.append((func, args, kwargs))
        return out


def matmul_ms(model, inputs: dict, forwards: int = 30) -> dict:
    """ms per forward of ``model``'s batched matmuls: ``in_forward``, timed inside its forwards (the timer
    adds a little Python to every op, so the gaps between matmuls are somewhat longer than unobserved), and
    ``back_to_back``, the calls of one forward replayed on the same tensors with nothing in between."""
    with torch.inference_mode():
        model(**inputs)
        timer = _MatmulTimer()
        with timer:
            for _ in range(forwards):
                model(**inputs)
        calls = timer.calls[: len(timer.calls) // forwards]
        for func, args, kwargs in calls:
            func(*args, **kwargs)
        start = time.perf_counter()
        for _ in range(forwards):
            for func, args, kwargs in calls:
                func(*args, **kwargs)
        back_to_back = (time.perf_counter() - start) / forwards
    return {"in_forward": timer.seconds / forwards * 1e3, "back_to_back": back_to_back * 1e3}


def one_weight_set(members) -> WideModel:
    """A wide model of ``members`` whose matmul weights all view member 0's: the timing control."""
    wide = WideModel.from_models(members).eval()
    tables = {id(m.weight) for m in wide.modules() if isinstance(m, WideEmbedding)}  # a tied LM head stays
    with torch.no_grad():
        for module in wide.modules():
            param = module.weight if isinstance(module, WideLinear) else getattr(module, "qkv_weight", None)
            if param is not None and id(param) not in tables:
                param.data = param.data[:1].expand(param.shape)  # (1, ...) -> (N, ...): a view, one set in memory
    return wide


def measure(family: str, hidden: int, n: int, batch: int, seq: int, target_s: float, compiled: bool) -> dict:
    spec = ModelSpec(family, hidden)
    members = [spec.build(seed) for seed in range(n)]
    inputs = make_inputs(members[0], batch, seq)
    rows = {k: torch.cat([v] * n) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    wide, control = WideModel.from_models(members).eval(), one_weight_set(members)
    runs = {"wide": lambda: wide(**inputs), "one_set": lambda: control(**inputs),
            "ideal": lambda: members[0](**rows)}
    if compiled:
        torch._dynamo.reset()
        wide_c, control_c, ideal_c = torch.compile(wide), torch.compile(control), torch.compile(members[0])
        runs.update({"wide_c": lambda: wide_c(**inputs), "one_set_c": lambda: control_c(**inputs),
                     "ideal_c": lambda: ideal_c(**rows)})
    with torch.inference_mode():
        got = wide(**inputs).logits
        diff = max((got[i] - members[i](**inputs).logits).abs().max().item() for i in range(n))
        for run in runs.values():  # first calls (compiling) are not timed
            run()
        timings, errors = time_interleaved(runs, target_s)
    if errors:
        raise RuntimeError(f"{family} N={n}: {errors}")
    rounds = [{"wide": matmul_ms(wide, inputs), "one_set": matmul_ms(control, inputs)} for _ in range(3)]
    matmuls = {name: {where: statistics.median(r[name][where] for r in rounds) for where in rounds[0][name]}
               for name in rounds[0]}
    ms = {name: t for name, (t, _) in timings.items()}
    record = {"config": spec.name, "n": n, "batch": batch, "seq": seq, "threads": torch.get_num_threads(),
              "ms": ms, "matmul_ms": matmuls, "max_abs_diff": diff}
    for suffix in ("", "_c") if compiled else ("",):
        record[f"fusion{suffix}"] = ms[f"one_set{suffix}"] / ms[f"ideal{suffix}"]
        record[f"weights{suffix}"] = ms[f"wide{suffix}"] / ms[f"one_set{suffix}"]
        record[f"wide_over_ideal{suffix}"] = ms[f"wide{suffix}"] / ms[f"ideal{suffix}"]
    return record


def format_record(r: dict) -> str:
    line = f"{r['config']} N={r['n']} B={r['batch']} seq={r['seq']} (max abs diff {r['max_abs_diff']:.1e})"
    for suffix, what in (("", "eager"), ("_c", "compiled")):
        if f"fusion{suffix}" in r:
            ms = r["ms"]
            line += (f"\n  {what:8s} wide {ms['wide' + suffix]:.2f} ms, one set {ms['one_set' + suffix]:.2f} ms, "
                     f"ideal {ms['ideal' + suffix]:.2f} ms: wide/ideal {r['wide_over_ideal' + suffix]:.2f} = "
                     f"fusion {r['fusion' + suffix]:.2f} x weight traffic {r['weights' + suffix]:.2f}")
    wide, one_set = r["matmul_ms"]["wide"], r["matmul_ms"]["one_set"]
    line += (f"\n  matmuls  in the forward: wide {wide['in_forward']:.2f} ms, one set {one_set['in_forward']:.2f} ms"
             f" ({wide['in_forward'] / one_set['in_forward']:.2f}x); back to back: {wide['back_to_back']:.2f} ms,"
             f" {one_set['back_to_back']:.2f} ms ({wide['back_to_back'] / one_set['back_to_back']:.2f}x)")
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-s", type=float, default=1.0, help="timing per method (seconds)")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    retention = cache_retention(RETENTION_MB, RETENTION_GAPS_US)
    print(format_retention(retention), flush=True)
    records = []
    for config in CONFIGS:
        records.append(measure(*config, target_s=args.target_s, compiled=not args.no_compile))
        print(format_record(records[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cache_retention": retention, "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
