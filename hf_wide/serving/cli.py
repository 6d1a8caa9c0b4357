"""``hf-wide serve``: the command line of :func:`hf_wide.serving.serve`."""

from __future__ import annotations

import argparse
import sys

from . import BATCH_WAIT_MS
from .tasks import FORMATS


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """``hf-wide serve``'s arguments (:data:`hf_wide.cli.COMMANDS`)."""
    from ..cli import LABEL_MISMATCH_HELP, _count

    serve.description = (
        "Fuses the members into one wide model and serves TASK at http://HOST:PORT/ (POST, the payloads "
        "huggingface_hub.InferenceClient sends), /health and /info, batching concurrent requests into one forward "
        "with Ray Serve. Ctrl-C (or SIGTERM) stops it. Needs: pip install \"hf-wide[serve]\".")
    serve.add_argument("models", nargs="+", metavar="ID", help="member repo ids or local folders, a fused repo, or adapters")
    serve.add_argument("--task", default="text-classification", choices=sorted(FORMATS))
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--combine", default="mean", help="mean, logit_mean, vote, weighted or median")
    serve.add_argument("--weights", type=float, nargs="+", default=None, metavar="W",
                       help="one weight per member, for --combine weighted")
    serve.add_argument("--compile", action="store_true", help="torch.compile the wide model in each replica")
    serve.add_argument("--replicas", type=_count, default=1, help="Ray Serve replicas (each holds the wide model)")
    serve.add_argument("--num-cpus", type=float, default=None,
                       help="CPUs Ray reserves for each replica, and its torch threads (default: Ray's, 1)")
    serve.add_argument("--max-batch-size", type=_count, default=32, help="requests batched into one forward, at most")
    serve.add_argument("--batch-wait-ms", type=float, default=BATCH_WAIT_MS,
                       help="how long a batch waits for more requests once the replica takes its first")
    serve.add_argument("--address", default=None,
                       help="join the Ray cluster at this address ('auto': the local one); default: start Ray here")
    serve.add_argument("--high-throughput", action="store_true",
                       help="Ray Serve's high-throughput mode for the Ray this starts: HAProxy on the port, sending "
                            "each request straight to a replica")
    serve.add_argument("--revision", default=None)
    serve.add_argument("--subfolder", nargs="+", metavar="DIR", default=None,
                       help="where in its repo each member is (a training run's checkpoint-N, say): one for all, or "
                            "one per member")
    serve.add_argument("--allow-label-mismatch", action="store_true", help=LABEL_MISMATCH_HELP)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from ..download import MemberLoadError
    from . import HIGH_THROUGHPUT_HINT, INSTALL, PortInUse, ServeStartError, serve

    try:
        import ray  # noqa: F401
    except ImportError:
        print(f"hf-wide serve: error: {INSTALL}", file=sys.stderr)
        return 2
    options = {"combine": args.combine, "compile": args.compile}
    if args.weights is not None:
        options["weights"] = args.weights
    if args.revision is not None:
        options["revision"] = args.revision
    if args.allow_label_mismatch:
        options["allow_label_mismatch"] = True
    if args.subfolder:
        options["subfolder"] = args.subfolder[0] if len(args.subfolder) == 1 else args.subfolder
    if args.high_throughput and args.address is not None:
        print(f"hf-wide serve: error: --high-throughput applies to the Ray this command starts, not to one at "
              f"--address: {HIGH_THROUGHPUT_HINT}", file=sys.stderr)
        return 2

    def ready():  # once the replicas answer: an option serve refuses, before Ray starts, prints no banner first
        print(f"hf-wide serve: {args.task} on http://{args.host}:{args.port}/ (Ctrl-C stops)", file=sys.stderr)

    try:
        serve(args.models, args.task, host=args.host, port=args.port, address=args.address, replicas=args.replicas,
              num_cpus=args.num_cpus, max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms,
              high_throughput=args.high_throughput, ready=ready, **options)
    except PortInUse as exc:
        print(f"hf-wide serve: error: {exc.strerror}: choose another --port.", file=sys.stderr)
        return 2
    except (ValueError, MemberLoadError) as exc:  # an option, a member not found, members without the task's head
        print(f"hf-wide serve: error: {exc}", file=sys.stderr)
        return 2
    except ServeStartError as exc:
        print(f"hf-wide serve: error: {exc}", file=sys.stderr)
        return 1
    return 0
