"""``hf-wide fuse``: the members fused into one repo, saved to a folder or pushed to the Hub, which
``WideModel.from_pretrained`` (and ``hf-wide run`` and ``serve``) load back as one id."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from .cli import DTYPE_NAMES, TOKEN_HELP, add_adapter_options, as_flags


def add_arguments(fuse: argparse.ArgumentParser) -> None:
    """``hf-wide fuse``'s arguments (:data:`hf_wide.cli.COMMANDS`)."""
    fuse.description = (
        "Downloads (or reads) the members, fuses and verifies them as WideModel.from_pretrained does, prints what "
        "became of their modules, and writes the fused repo (stacked weights, a config with an hf_wide section, the "
        "tokenizer, a model card naming the members at their commits) to --output, to the Hub repo --push-to-hub "
        "(created if needed, in one commit), or both. Adapters of one base are saved as their base's id and their own "
        "weights, not the base's.")
    fuse.add_argument("models", nargs="+", metavar="ID",
                      help="member repo ids or local folders, or PEFT adapters of one base")
    fuse.add_argument("--output", metavar="DIR", help="save the fused repo to this folder")
    fuse.add_argument("--push-to-hub", metavar="REPO_ID", type=_repo_id, help="upload the fused repo to this Hub repo")
    fuse.add_argument("--revision", nargs="+", metavar="REV",
                      help="the members' revision (a branch, tag or commit): one for all, or one per member")
    fuse.add_argument("--subfolder", nargs="+", metavar="DIR",
                      help="where in its repo each member is (a training run's checkpoint-N, say): one for all, or "
                           "one per member")
    add_adapter_options(fuse)
    fuse.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default=None,
                      help="load the members in this dtype (default: transformers' default)")
    fuse.add_argument("--offline", action="store_true", help="use the local cache only")
    fuse.add_argument("--token", default=None, help=TOKEN_HELP)
    fuse.add_argument("--private", action="store_true", help="create the Hub repo private")
    fuse.add_argument("--commit-message", default=None)
    fuse.add_argument("--create-pr", action="store_true", help="push to a pull request, not to main")
    fuse.add_argument("--max-shard-size", type=_size, default="5GB",
                      help="largest weight file: 5GB, 500MB, ... or a number of bytes (default 5GB)")
    fuse.add_argument("--allow-pickle", action="store_true", help="read members saved as pickles (.bin) only")
    fuse.add_argument("--trust-remote-code", action="store_true")
    fuse.add_argument("--allow-label-mismatch", action="store_true",
                      help="fuse members whose label names differ (their outputs are then not one label space)")
    fuse.add_argument("--plan", action="store_true", help="print the whole plan, not only its summary")
    fuse.set_defaults(func=_fuse)


def _fuse(args: argparse.Namespace) -> int:
    from .cli import BAD_FILES
    from .model import WideModel, WideValidationError

    def error(message) -> int:
        print(f"hf-wide fuse: error: {message}", file=sys.stderr)
        return 2

    if args.output is None and args.push_to_hub is None:
        return error("say where the fused repo goes: --output DIR, --push-to-hub REPO_ID, or both.")
    # Refused before the members load and fuse, not after (or, for the push's options, not ignored)
    unpushed = [flag for flag, given in (("--private", args.private), ("--create-pr", args.create_pr),
                                         ("--commit-message", args.commit_message is not None)) if given]
    if unpushed and args.push_to_hub is None:
        return error(f"no --push-to-hub REPO_ID for {', '.join(unpushed)} to apply to.")
    if args.output is not None and (not_a_folder := _file_in(Path(args.output))) is not None:
        return error(f"--output {args.output}: {not_a_folder} is a file, not a folder.")
    revision = args.revision[0] if args.revision and len(args.revision) == 1 else args.revision
    subfolder = args.subfolder[0] if args.subfolder and len(args.subfolder) == 1 else args.subfolder
    try:
        wide = WideModel.from_pretrained(
            args.models, revision=revision, subfolder=subfolder, dtype=args.dtype, token=args.token,
            local_files_only=args.offline, allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code,
            allow_label_mismatch=args.allow_label_mismatch, base_model=args.base_model,
            base_revision=args.base_revision, merge=args.merge)
        print(wide.plan if args.plan else wide.plan.summary())
        if args.output is not None:
            _save(wide, Path(args.output), args.max_shard_size)
            print(f"Saved the fused repo to {args.output}")
        if args.push_to_hub is not None:
            try:
                commit = wide.push_to_hub(args.push_to_hub, private=True if args.private else None,
                                          token=args.token, commit_message=args.commit_message,
                                          create_pr=args.create_pr, max_shard_size=args.max_shard_size)
            except (ValueError, TypeError, OSError, *BAD_FILES):
                raise
            except Exception as exc:  # the HTTP library's own (no answer from the Hub, a timeout): no OSError
                return error(f"could not push to {args.push_to_hub}: {type(exc).__name__}: {exc}")
            print(f"Pushed the fused repo to {commit.pr_url or commit.commit_url}")
    except (ValueError, TypeError, OSError, NotImplementedError, WideValidationError, *BAD_FILES) as exc:
        return error(as_flags(exc))  # (the Hub's errors are OSErrors; an adapter PEFT holds that hf-wide does not run)
    return 0


def _size(text: str) -> int:
    """argparse's type of ``--max-shard-size``: bytes, read as huggingface_hub reads the size that splits the weights
    into shards (``5GB``, ``500MB``: units of 1000), or a number of bytes; checked before the members load."""
    from huggingface_hub.serialization._base import parse_size_to_int  # (what split_torch_state_dict_into_shards reads)

    try:
        size = int(text) if text.strip().isdigit() else parse_size_to_int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no size: give one such as 5GB, 500MB or 100KB (TB, GB, MB, "
                                         "KB), or a number of bytes")
    return size


def _repo_id(text: str) -> str:
    """argparse's type of ``--push-to-hub``: a Hub repo id as huggingface_hub checks it, before the members load."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _file_in(output: Path) -> Path | None:
    """The file that stands where ``output`` or one of its parents should be a folder, if any."""
    existing = next(p for p in [output, *output.parents] if p.exists())
    return None if existing.is_dir() else existing


def _save(wide, output: Path, max_shard_size: int) -> None:
    """``wide`` saved to ``output``; if that fails, the folders the save created are removed again, not left
    empty or half written (a folder that was there before is left as it is)."""
    created = next((p for p in reversed([output, *output.parents]) if not p.exists()), None)  # the outermost new one
    try:
        wide.save_pretrained(output, max_shard_size=max_shard_size)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
