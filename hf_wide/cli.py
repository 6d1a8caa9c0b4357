"""The ``hf-wide`` command line. Front end only: parse, call the public API, print."""

from __future__ import annotations

import argparse
import sys


def _trace(args: argparse.Namespace) -> int:
    from .hub import load_members
    from .planner import plan_members

    models, _, _ = load_members(args.models, revision=args.revision, local_files_only=args.offline)
    plan = plan_members(models, share_identical=len(models) > 1)
    print(plan)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(members_dir=args.members_dir, num_members=args.members)
    return 0


def _make_demo_members(args: argparse.Namespace) -> int:
    from .demo import make_demo_members

    make_demo_members(args.output, num_members=args.members, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-wide", description="Run N fine-tuned checkpoints as one wide model.")
    sub = parser.add_subparsers(dest="command", required=True)

    trace = sub.add_parser("trace", help="print the plan: what becomes of every module")
    trace.add_argument("models", nargs="+", help="Hub repo ids or local folders (one shows the architecture's plan)")
    trace.add_argument("--revision", default=None)
    trace.add_argument("--offline", action="store_true", help="use the local cache only")
    trace.set_defaults(func=_trace)

    demo = sub.add_parser("demo", help="fuse the embedded default ensemble and show what it does")
    demo.add_argument("--members-dir", default=None, help="where the demo members are cached")
    demo.add_argument("--members", type=int, default=8)
    demo.set_defaults(func=_demo)

    make = sub.add_parser("make-demo-members", help="train the embedded default: N digit classifiers")
    make.add_argument("output")
    make.add_argument("--members", type=int, default=8)
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make_demo_members)

    from .benchmark import register_cli

    register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
