"""The ``hf-wide`` command line. Front end only: parse, call the public API, print."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Collection
from pathlib import Path

from safetensors import SafetensorError

from . import __version__
from .cpu import tune_cpu_allocator

SUBFOLDER_HELP = "where in its repo each member is (a training run's checkpoint-N, say): one for all, or one per member"
TOKEN_HELP = "a Hub token (default: HF_TOKEN or the one `hf auth login` saved)"
# hf_wide.placement.DTYPES by name (tests/test_cli.py holds them equal): the commands' --help imports no torch
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
LABEL_MISMATCH_HELP = "take members whose id2label holds the same labels in another order (realigned by name)"
# What a member's files can raise beyond ValueError and OSError: a checkpoint cut short (hf-wide's reader, or
# safetensors' own on its header)
BAD_FILES = (EOFError, SafetensorError)


def _trace(args: argparse.Namespace) -> int:
    from .compat import check_compatible
    from .download import download_members
    from .hub import load_members
    from .planner import plan_members

    try:
        subfolder = args.subfolder[0] if args.subfolder and len(args.subfolder) == 1 else args.subfolder
        where = {"revision": args.revision, "subfolder": subfolder, "local_files_only": args.offline,
                 "token": args.token}
        if _print_saved_plan(args.models, download_members(args.models, **where)):
            return 0
        models, ids, _ = load_members(args.models, **where)
        check_compatible(models, ids, allow_label_mismatch=True)  # the plan is one for all: labels aside
    except (ValueError, TypeError, OSError, NotImplementedError, *BAD_FILES) as exc:  # a member not found or cut
        print(f"hf-wide trace: error: {as_flags(exc)}", file=sys.stderr)  # short, other architectures, adapters
        return 2
    plan = plan_members(models, share_identical=len(models) > 1)
    print(plan)
    return 0


def _print_saved_plan(ids: list[str], folders: list[Path]) -> bool:
    """Print the plan a fused repo was saved with and return True; False for members. A fused repo's weights are no
    checkpoint transformers loads (they are stacked), so its plan is read from its config, not traced again."""
    from .saving import plan_from_dict, read_section

    sections = [read_section(folder) for folder in folders]
    fused = [i for i, section in enumerate(sections) if section is not None]
    if not fused:
        return False
    if len(ids) > 1:
        raise ValueError(f"{ids[fused[0]]} is a fused hf-wide repo: trace it on its own, not as a member.")
    if "plan" not in sections[0]:  # (a KeyError's traceback)
        raise ValueError(f"{ids[0]} is an ensemble of adapters saved without its plan, by an earlier hf-wide: trace "
                         "its adapters (its members/member-*/ folders), or load it and save it again, which stores "
                         "its plan.")
    print(f"{ids[0]} is a fused hf-wide repo of {sections[0]['num_members']} members "
          f"({', '.join(sections[0]['member_ids'])}); the plan it was saved with:")
    print(plan_from_dict(sections[0]["plan"]))
    return True


def _env(args: argparse.Namespace) -> int:
    from .versions import environment

    print("\nCopy-and-paste the text below in your GitHub issue.\n")
    for name, value in environment().items():
        print(f"- {name}: {value}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    try:
        run_demo(members_dir=args.members_dir, num_members=args.members)
    except OSError as exc:  # --members-dir is a file (refused before any training), or cannot be written
        print(f"hf-wide demo: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _make_demo_members(args: argparse.Namespace) -> int:
    from .demo import make_demo_members

    try:
        make_demo_members(args.output, num_members=args.members, seed=args.seed)
    except OSError as exc:  # OUTPUT is a file (refused before any training), or cannot be written
        print(f"hf-wide make-demo-members: error: {exc}", file=sys.stderr)
        return 2
    return 0


# The options of from_pretrained an error may name, as the command line spells them
FLAGS = {"merge=True": "--merge", "allow_pickle=True": "--allow-pickle", "base_model=": "--base-model ",
         "base_revision=": "--base-revision ", "token=": "--token ", "dtype=": "--dtype "}


def as_flags(error: BaseException | str) -> str:
    """An error's message with the options of ``from_pretrained`` it names spelt as the command's flags."""
    message = str(error)
    for option, flag in FLAGS.items():
        message = re.sub(rf"(?<![\w.]){re.escape(option)}", flag, message)
    return message


def add_adapter_options(parser: argparse.ArgumentParser) -> None:
    """``--base-model``, ``--base-revision`` and ``--merge``: where adapters among the members are loaded."""
    parser.add_argument("--base-model", metavar="ID",
                        help="adapters: the base to load them on (default: the one they name)")
    parser.add_argument("--base-revision", metavar="REV", help="adapters: the base's revision")
    parser.add_argument("--merge", action="store_true",
                        help="adapters: merge each into its own copy of the base (N full weight sets)")


def _count(text: str) -> int:
    """argparse's type of a count (tokens, labels, a batch): a whole number of at least 1."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return number


# The commands whose code lives in modules of their own: each one's help line, and the module whose
# ``add_arguments(parser)`` gives its arguments. That module is imported for its own command only: the pipelines, the
# benchmark and torch take seconds to import, which `hf-wide --help`, `env` or `trace` need not wait for.
COMMANDS = {
    "run": ("run a pipeline on N members: ensemble answer, member answers, uncertainty", "hf_wide.cli_run"),
    "fuse": ("fuse the members into one repo: save it to a folder or push it to the Hub", "hf_wide.cli_fuse"),
    "benchmark": ("time wide against sequential, vmap and the ideal (one model on N*B rows)", "hf_wide.benchmark.cli"),
    "serve": ("serve the ensemble over HTTP (Hugging Face Inference API payloads) on Ray Serve", "hf_wide.serving.cli"),
}


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. ``commands``: those of :data:`COMMANDS` to give their arguments (default: all); the
    others are listed, with their help, and their modules are not imported."""
    parser = argparse.ArgumentParser(prog="hf-wide", description="Run N fine-tuned checkpoints as one wide model.")
    parser.add_argument("--version", action="version", version=f"hf-wide {__version__}")
    parser.add_argument("--default-allocator", action="store_true",
                        help="keep the C library's malloc settings (by default glibc keeps freed memory for reuse: "
                             "large CPU batches run faster, the process stays at its peak memory; see hf_wide.cpu)")
    sub = parser.add_subparsers(dest="command", required=True)

    trace = sub.add_parser("trace", help="print the plan: what becomes of every module")
    trace.add_argument("models", nargs="+", help="Hub repo ids or local folders (one shows the architecture's plan)")
    trace.add_argument("--revision", default=None)
    trace.add_argument("--offline", action="store_true", help="use the local cache only")
    trace.add_argument("--token", default=None, help=TOKEN_HELP)
    trace.add_argument("--subfolder", nargs="+", metavar="DIR", default=None, help=SUBFOLDER_HELP)
    trace.set_defaults(func=_trace)

    demo = sub.add_parser("demo", help="fuse the embedded default ensemble and show what it does")
    demo.add_argument("--members-dir", default=None, help="where the demo members are cached")
    demo.add_argument("--members", type=_count, default=8, help="how many members to fuse (default 8)")
    demo.set_defaults(func=_demo)

    make = sub.add_parser("make-demo-members", help="train the embedded default: N digit classifiers")
    make.add_argument("output")
    make.add_argument("--members", type=_count, default=8, help="how many members to train (default 8)")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make_demo_members)

    for name, (line, module) in COMMANDS.items():
        command = sub.add_parser(name, help=line)
        if commands is None or name in commands:
            importlib.import_module(module).add_arguments(command)

    env = sub.add_parser("env", help="print the versions and settings a bug report needs",
                         description="Prints hf-wide's, Python's and the libraries' versions, the accelerator and the "
                                     "Hub settings, to paste into a bug report.")
    env.set_defaults(func=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = [word for word in argv if not word.startswith("-")][:1]  # the command (the options before it take no value)
    args = build_parser(named).parse_args(argv)
    if not args.default_allocator:
        tune_cpu_allocator()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
