"""``hf-wide benchmark``'s command line (:data:`hf_wide.cli.COMMANDS`): its arguments parse without torch."""

from __future__ import annotations

import argparse
import sys

from . import COMPILE_POLICIES, PRESETS


def _cli(args: argparse.Namespace) -> int:
    from . import report
    from .runner import run_benchmark

    if args.pipeline:
        from .pipeline import run_pipeline_benchmark

        run_pipeline_benchmark(threads=args.threads, json_path=args.json)
        return 0
    from ..compat import IncompatibleMembersError
    from ..download import MemberLoadError

    try:
        records = run_benchmark(args.preset, models=args.models, batch=args.batch, seq=args.seq,
                                compile=args.compile, threads=args.threads, max_gflop=args.max_gflop,
                                offline=args.offline, device=args.device, json_path=args.json,
                                plot_path=args.plot)
    except (MemberLoadError, IncompatibleMembersError, ValueError) as exc:  # --models: missing, mixed, under --seq
        print(f"hf-wide benchmark: error: {exc}", file=sys.stderr)
        return 2
    return 1 if report.mismatches(records) else 0


def _device(text: str) -> str:
    """argparse's type of ``--device``: a device torch knows and this build of it has, checked before any timing."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is no torch device: cpu, cuda, cuda:1, mps, ...") from None
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu: is_available, device_count
    if device.type == "cpu" or backend is None or not hasattr(backend, "is_available"):
        return text
    if not backend.is_available():
        raise argparse.ArgumentTypeError(f"torch {torch.__version__} sees no {device.type} device here")
    if device.index is not None and device.index >= backend.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {backend.device_count()} {device.type} device(s)")
    return text


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """``hf-wide benchmark``'s arguments (:data:`hf_wide.cli.COMMANDS`; its ``func`` runs it)."""
    from ..cli import _count

    bench.description = (
        "Times, on the same inputs: the N checkpoints one after another (sequential), the torch.func vmap recipe, "
        "the wide model eager and compiled, and the ideal: one checkpoint on all N*B rows, eager and compiled. "
        "Prints a table; every method's outputs are checked against the members run alone (exit code 1 when one "
        "differs).")
    bench.add_argument("--preset", choices=PRESETS, default="quick",
                       help="tiny: seconds, for tests; quick: under 2 minutes; full: the whole grid (long); "
                            "lora: the LoRA configs, each method timed longer (2 minutes)")
    bench.add_argument("--models", nargs="+", metavar="ID", help="benchmark these checkpoints instead of a preset")
    bench.add_argument("--batch", type=_count, default=8, help="batch size B for --models")
    bench.add_argument("--seq", type=_count, default=64, help="sequence length for --models")
    bench.add_argument("--compile", choices=COMPILE_POLICIES, default=None,
                       help="which configs run under torch.compile (default: the preset's; subset: one per family)")
    bench.add_argument("--max-gflop", type=float, default=None,
                       help="skip preset configs whose forward of all N members needs more GFLOP (default: preset's)")
    bench.add_argument("--threads", type=_count, default=None, help="torch.set_num_threads (default: torch's)")
    bench.add_argument("--offline", action="store_true", help="--models from the local cache only")
    bench.add_argument("--device", type=_device, default="cpu",
                       help="where every method runs: cpu (default), cuda, cuda:1, ...")
    bench.add_argument("--json", metavar="PATH", help="write the records and machine info as JSON")
    bench.add_argument("--pipeline", action="store_true",
                       help="time the pipelines instead: 2,000 texts with 8 BERT members against 8 transformers "
                            "pipelines, and ensemble decoding with 4 Llama members against stepping them apart")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG of the speedup over sequential vs N (matplotlib)")
    bench.set_defaults(func=_cli)
