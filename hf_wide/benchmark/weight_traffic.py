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
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..model import WideModel
from ..primitives.embedding import WideEmbedding
from ..primitives.linear import WideLinear
from .configs import ModelSpec, make_inputs
from .methods import time_interleaved

CONFIGS = [("bert", 128, 8, 1, 16), ("llama", 128, 8, 1, 16), ("bert", 128, 2, 1, 16)]  # family, hidden, N, B, seq


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
    ms = {name: t for name, (t, _) in timings.items()}
    record = {"config": spec.name, "n": n, "batch": batch, "seq": seq, "threads": torch.get_num_threads(),
              "ms": ms, "max_abs_diff": diff}
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
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-s", type=float, default=1.0, help="timing per method (seconds)")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    records = []
    for config in CONFIGS:
        records.append(measure(*config, target_s=args.target_s, compiled=not args.no_compile))
        print(format_record(records[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
