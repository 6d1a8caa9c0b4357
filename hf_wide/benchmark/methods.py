"""The ways of running N members that the benchmark compares, and how each is timed and checked.

Every method is built once from the members and the shared inputs (B rows); after its first call (timed
apart: it compiles, for compiled ones) all methods are called round-robin (see :func:`time_interleaved`):

- ``sequential``: the N models one after another (what users do today);
- ``vmap``: ``torch.func.stack_module_state`` + ``functional_call`` under ``torch.vmap`` (the official recipe);
- ``wide`` / ``wide_compiled``: :class:`~hf_wide.WideModel`, eager and under ``torch.compile``;
- ``ideal`` / ``ideal_compiled``: member 0 alone on the N*B rows: the same FLOPs with one weight set,
  the bound no fusion can beat (DESIGN.md, "Performance model"); for LoRA members, the base alone;
- ``peft_mixed``: LoRA members only: PEFT's own mixed-adapter batch, one model holding every adapter, each
  row repeated once per adapter (``model(**x, adapter_names=[...])``).

Each method's output is checked once against the members run alone, so a wrong fast path shows up as a
large ``max_abs_diff`` rather than as a fast time.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..model import WideModel

Outputs = dict[str, torch.Tensor]  # output name -> (N, B, ...)


@dataclasses.dataclass
class Method:
    """A way of running all N members, built once and called many times."""

    run: Callable[[], Any]  # one forward of all N members
    outputs: Callable[[Any], Outputs]  # what run() returned, as (N, B, ...) tensors
    same_weights: bool = False  # every block of B rows used member 0's weights (the ideal)
    checked: bool = True  # its outputs are the members' (not so for the base of LoRA members, the ideal there)


def _tensors(output) -> dict[str, torch.Tensor]:
    """A transformers ModelOutput (a dict) or a plain tensor as {name: tensor}."""
    if isinstance(output, torch.Tensor):
        return {"output": output}
    return {k: v for k, v in output.items() if isinstance(v, torch.Tensor)}


def _repeat_rows(inputs: dict, n: int) -> dict:
    """(B, ...) tensors -> (N*B, ...), member-major, as the wide model folds them; other values unchanged."""
    def repeat(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.unsqueeze(0).expand(n, *v.shape).reshape(-1, *v.shape[1:])
        return v
    return {k: repeat(v) for k, v in inputs.items()}


def sequential(members: Sequence[nn.Module], inputs: dict) -> Method:
    def run():
        return [model(**inputs) for model in members]

    def outputs(outs):
        per_member = [_tensors(o) for o in outs]
        return {k: torch.stack([o[k] for o in per_member]) for k in per_member[0]}

    return Method(run, outputs)


def vmap(members: Sequence[nn.Module], inputs: dict) -> Method:
    params, buffers = torch.func.stack_module_state(list(members))  # each (N, *shape)
    # functional_call swaps the stacked tensors into member 0 for the call and restores its own after. The
    # tutorial's deepcopy to the meta device instead silently returns garbage for tied weights (lm_head).
    base = members[0]

    def one(p, b):
        return torch.func.functional_call(base, (p, b), (), inputs)  # inputs are shared, not vmapped

    batched = torch.vmap(one)

    def run():
        with warnings.catch_warnings():  # transformers' mask and attention code warns under vmap
            warnings.simplefilter("ignore")
            return batched(params, buffers)

    return Method(run, _tensors)


def wide(model: WideModel, inputs: dict, compiled: bool = False) -> Method:
    model = torch.compile(model) if compiled else model  # compiles at the first call
    return Method(lambda: model(**inputs), _tensors)


def ideal(member: nn.Module, inputs: dict, n: int, compiled: bool = False, checked: bool = True) -> Method:
    rows = _repeat_rows(inputs, n)
    model = torch.compile(member) if compiled else member

    def outputs(out):
        return {k: v.view(n, -1, *v.shape[1:]) for k, v in _tensors(out).items()}  # (N*B, ...) -> (N, B, ...)

    return Method(lambda: model(**rows), outputs, same_weights=True, checked=checked)


def peft_mixed(members: Sequence[nn.Module], inputs: dict) -> Method:
    """One PeftModel with every member's adapter; each row once per adapter, routed by ``adapter_names``."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    model = copy.deepcopy(members[0])
    names = [f"member{i}" for i in range(len(members))]
    for name, member in zip(names, members):
        model.add_adapter(name, member.peft_config["default"])
        set_peft_model_state_dict(model, get_peft_model_state_dict(member), adapter_name=name)
    model.eval()
    n, rows = len(members), _repeat_rows(inputs, len(members))
    batch = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape[0]
    adapter_names = [name for name in names for _ in range(batch)]

    def outputs(out):
        return {k: v.view(n, -1, *v.shape[1:]) for k, v in _tensors(out).items()}

    return Method(lambda: model(**rows, adapter_names=adapter_names), outputs)


COMPILED = ("wide_compiled", "ideal_compiled")


def builders(members: Sequence[nn.Module], inputs: dict, base: nn.Module | None = None
             ) -> dict[str, Callable[[], Method]]:
    """name -> a function that builds the method. ``wide`` and ``wide_compiled`` share one fused model.
    ``base``: what the ideal runs (the base of LoRA members; member 0 otherwise)."""
    fused = []

    def wide_model() -> WideModel:
        if not fused:
            fused.append(WideModel.from_models(members))
        return fused[0]

    n, base = len(members), members[0] if base is None else base
    found = {
        "sequential": lambda: sequential(members, inputs),
        "vmap": lambda: vmap(members, inputs),
        "wide": lambda: wide(wide_model(), inputs),
        "wide_compiled": lambda: wide(wide_model(), inputs, compiled=True),
        "ideal": lambda: ideal(base, inputs, n, checked=base is members[0]),
        "ideal_compiled": lambda: ideal(base, inputs, n, compiled=True, checked=base is members[0]),
    }
    if hasattr(members[0], "peft_config"):
        found["peft_mixed"] = lambda: peft_mixed(members, inputs)
    return found


METHOD_NAMES = ("sequential", "vmap", "wide", "wide_compiled", "ideal", "ideal_compiled", "peft_mixed")


def max_abs_diff(got: Outputs, reference: Outputs, same_weights: bool) -> float:
    """Largest |got - reference| over the outputs both have. With ``same_weights`` every member block of
    ``got`` is compared with member 0 of the reference."""
    common = [k for k in reference if k in got]
    if not common:
        raise ValueError(f"no output in common with the reference: got {sorted(got)}, expected {sorted(reference)}")
    diff = 0.0
    for k in common:
        ref = reference[k][:1] if same_weights else reference[k]  # (1 or N, B, ...)
        diff = max(diff, (got[k].float() - ref.float()).abs().max().item())
    return diff


def time_interleaved(runs: dict[str, Callable[[], Any]], target_s: float, min_runs: int = 5,
                     max_runs: int = 1000, burst: int = 3, warm: int = 3,
                     ) -> tuple[dict[str, tuple[float, int]], dict[str, str]]:
    """Median milliseconds of each ``runs[name]()`` and its number of runs, plus errors by name.

    Runs go round-robin in bursts: each round calls every method ``warm + burst`` times back to back and
    times the last ``burst`` calls. Round-robin makes load from elsewhere on the machine slow every
    method alike, so the ratios stay meaningful; the untimed calls of a burst bring the method's own
    weights and buffers back, so each is timed in its steady state, as it runs when served alone, not in
    the caches and heap left by the method before it. One untimed call was not enough: after the members
    in sequence and vmap, the wide model of 2 tiny Llama members (seq 16) measured 1.20-1.24x the ideal
    with one, 1.12-1.15x with three, and 1.12-1.14x with the two timed alone. Rounds go on until
    ``target_s`` per method has passed, with at least ``min_runs`` timed calls. The caller has made each
    first (slow) call already.
    """
    runs, errors = dict(runs), {}
    times: dict[str, list[float]] = {name: [] for name in runs}
    start, rounds = time.perf_counter(), -1  # round -1 is a warm-up
    while runs and (rounds * burst < min_runs
                    or (time.perf_counter() - start < target_s * len(times) and rounds * burst < max_runs)):
        for name, fn in list(runs.items()):
            try:
                for _ in range(warm):  # untimed: back to this method's steady state
                    fn()
                for _ in range(burst):
                    t0 = time.perf_counter()
                    fn()
                    if rounds >= 0:
                        times[name].append(time.perf_counter() - t0)
            except Exception as exc:  # record and drop the method; the others go on
                errors[name] = _error(exc)
                del runs[name]
        rounds += 1
    return {name: (statistics.median(ts) * 1e3, len(ts)) for name, ts in times.items() if name in runs}, errors


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()}"


def blank_record(skipped: str | None = None) -> dict:
    """What a method reports; ``skipped`` says why it did not run (``error``: why it failed)."""
    return {"ms": None, "runs": 0, "gflops": None, "build_s": None, "first_call_s": None, "max_abs_diff": None,
            "error": None, "skipped": skipped}


def synchronized(run: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``run`` returning only when the device has finished what it queued (CUDA runs asynchronously: a host clock
    around the bare call times the launches)."""
    module = getattr(torch, device.type, None)
    if device.type == "cpu" or not hasattr(module, "synchronize"):
        return run

    def call():
        out = run()
        module.synchronize(device)
        return out

    return call


def measure(members: Sequence[nn.Module], inputs: dict, compiled: bool, target_s: float,
            base: nn.Module | None = None) -> dict[str, dict]:
    """Every method on ``members`` and ``inputs`` (B rows): its build time, its first call (compilation,
    for compiled ones), its agreement with the members run alone, and its steady-state median.
    A failure is recorded with its error string instead of raised. ``base``: the ideal's model (LoRA).
    Everything runs where the members are (their first parameter's device), timed to the device's completion."""
    device = next(members[0].parameters()).device
    records = {name: blank_record() for name in METHOD_NAMES}
    records["peft_mixed"]["skipped"] = "the members are not LoRA adapters"
    methods: dict[str, Method] = {}
    reference = None  # (N, B, ...) per output: the members run alone, from the sequential method
    if compiled:
        torch._dynamo.reset()  # fresh caches: honest compile times, no recompile limit across configs
    for name, build in builders(members, inputs, base).items():
        records[name]["skipped"] = None
        record = records[name]
        if name in COMPILED and not compiled:
            record["skipped"] = "not compiled in this run (see --compile)"
            continue
        try:
            t0 = time.perf_counter()
            method = build()
            method.run = synchronized(method.run, device)
            record["build_s"] = time.perf_counter() - t0
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = method.run()
                record["first_call_s"] = time.perf_counter() - t0
                outputs = method.outputs(out)
            if name == "sequential":
                reference = outputs
            elif reference is None:
                raise RuntimeError("no reference to check against: the sequential run failed")
            if method.checked:  # the base of LoRA members computes other numbers: nothing to check
                record["max_abs_diff"] = max_abs_diff(outputs, reference, method.same_weights)
            methods[name] = method
        except Exception as exc:  # any failure (vmap's batching rules, compile errors) is a result to report
            record["error"] = _error(exc)
    with torch.inference_mode():
        timings, errors = time_interleaved({name: m.run for name, m in methods.items()}, target_s)
    for name, (ms, runs) in timings.items():
        records[name].update(ms=ms, runs=runs)
    for name, error in errors.items():
        records[name]["error"] = error
    return records


def matmul_gflops(size: int = 2048, runs: int = 5, device: torch.device | str = "cpu") -> float:
    """The device's float32 matmul throughput: median GFLOP/s of a (size x size) @ (size x size)."""
    device = torch.device(device)
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    with torch.inference_mode():
        timings, _ = time_interleaved({"matmul": synchronized(lambda: a @ b, device)}, target_s=0.0, min_runs=runs)
    ms, _ = timings["matmul"]
    return 2 * size**3 / (ms / 1e3) / 1e9
