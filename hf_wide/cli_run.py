"""``hf-wide run``: a pipeline on the members, its answers printed as a table or JSON lines."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from .cli import (BAD_FILES, DTYPE_NAMES, LABEL_MISMATCH_HELP, SUBFOLDER_HELP, TOKEN_HELP, _count, add_adapter_options,
                  as_flags)

# The choices, by name: the pipelines (and torch under them) take seconds to import, which `hf-wide run --help`
# need not wait for. tests/test_cli_run.py holds them to hf_wide.pipelines.TASKS and AggregationStrategy.
TASK_NAMES = ("feature-extraction", "image-classification", "text-classification", "text-generation",
              "token-classification")
AGGREGATIONS = ("none", "simple", "first", "average", "max")


def add_arguments(run: argparse.ArgumentParser) -> None:
    """``hf-wide run``'s arguments (:data:`hf_wide.cli.COMMANDS`)."""
    run.description = ("Runs TASK on the members fused into one wide model and prints, per input, the ensemble's "
                       "answer, every member's answer and the uncertainty (a table, or JSON lines with --json); the "
                       "throughput goes to stderr.")
    run.add_argument("task", choices=TASK_NAMES)
    run.add_argument("--model", nargs="+", required=True, metavar="ID", help="member repo ids or local folders")
    run.add_argument("--input", required=True, metavar="FILE_OR_TEXT",
                     help="a text file (one input per line), an image file or folder of images, or else the text "
                          "(a word with a file suffix, such as inputs.txt, is a file that must be there)")
    run.add_argument("--combine", default="mean", help="mean, logit_mean, vote, weighted, median or none")
    run.add_argument("--weights", type=float, nargs="+", default=None, help="one weight per member (weighted)")
    run.add_argument("--json", action="store_true", help="print one JSON object per input instead of a table")
    run.add_argument("--batch-size", type=_count, default=32)
    run.add_argument("--top-k", type=_count, default=None, help="classification: also list the k best labels")
    run.add_argument("--aggregation", default=None, choices=AGGREGATIONS,
                     help="token-classification: how tokens become entities (default simple)")
    run.add_argument("--max-new-tokens", type=_count, default=None,
                     help="text-generation: tokens to generate (default: the members' own, else 20)")
    run.add_argument("--tokenizer", metavar="ID", default=None,
                     help="text tasks: the tokenizer to read the inputs with, a repo id or folder (default: the "
                          "members' own, or their base's)")
    run.add_argument("--image-processor", metavar="ID", default=None,
                     help="image-classification: the image processor, a repo id or folder (default: the members' own)")
    run.add_argument("--dtype", choices=[*DTYPE_NAMES, "auto"], default=None,
                     help="load the members in this dtype (default: transformers' default)")
    run.add_argument("--revision", default=None)
    run.add_argument("--subfolder", nargs="+", metavar="DIR", default=None, help=SUBFOLDER_HELP)
    run.add_argument("--offline", action="store_true", help="use the local cache only")
    run.add_argument("--token", default=None, help=TOKEN_HELP)
    run.add_argument("--trust-remote-code", action="store_true")
    add_adapter_options(run)
    run.add_argument("--allow-label-mismatch", action="store_true", help=LABEL_MISMATCH_HELP)
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .pipelines import pipeline

    if args.weights is not None and args.combine != "weighted":  # the pipeline would run the rule without them
        print(f"hf-wide run: error: --weights apply to --combine weighted, not to --combine {args.combine}.",
              file=sys.stderr)
        return 2
    try:
        options = _call_options(args)
        inputs = _read_inputs(args.task, args.input)
        subfolder = args.subfolder[0] if args.subfolder and len(args.subfolder) == 1 else args.subfolder
        model_kwargs = {"local_files_only": args.offline, "trust_remote_code": args.trust_remote_code,
                        "base_model": args.base_model, "base_revision": args.base_revision, "merge": args.merge,
                        **({"subfolder": subfolder} if subfolder else {})}
        pipe = pipeline(args.task, model=args.model, revision=args.revision, token=args.token, dtype=args.dtype,
                        tokenizer=args.tokenizer, image_processor=args.image_processor, combine=args.combine,
                        weights=args.weights, batch_size=args.batch_size,
                        allow_label_mismatch=args.allow_label_mismatch, model_kwargs=model_kwargs)
        start = time.perf_counter()
        results = pipe(inputs, **options)
        seconds = time.perf_counter() - start
    except (ValueError, TypeError, OSError, NotImplementedError, *BAD_FILES) as exc:
        print(f"hf-wide run: error: {as_flags(exc)}", file=sys.stderr)
        return 2
    if args.json:
        for item, result in zip(inputs, results):
            print(json.dumps({"input": str(item), **result}))
    else:
        names = [Path(item).name if args.task == "image-classification" else _short(item) for item in inputs]
        _print_table(["input", "ensemble", "members", "uncertainty"],
                     [[name, *_cells(args.task, result)] for name, result in zip(names, results)])
    print(f"{len(inputs)} input(s), {pipe.model.num_members} members: {seconds:.2f} s, "
          f"{len(inputs) / seconds:.1f} items/s", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- hf-wide run: inputs and output
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
SHORT_NAMES = {"predictive_entropy": "H", "expected_entropy": "E[H]", "mutual_information": "MI",
               "member_std": "std", "agreement": "agree"}
CELL_CHARS = 80


def _read_inputs(task: str, value: str) -> list[str]:
    """FILE_OR_TEXT: a folder of images, an image file, a text file (one input per line), or the text."""
    path = Path(value)
    try:
        is_dir, is_file = (path.is_dir(), path.is_file()) if value.strip() else (False, False)
    except OSError:  # a long literal text is no file name
        is_dir = is_file = False
    images = task == "image-classification"
    if is_dir:
        if not images:
            raise ValueError(f"{value} is a folder: {task} reads a text file (one input per line) or a text.")
        found = sorted(str(p) for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise ValueError(f"No image files ({', '.join(sorted(IMAGE_SUFFIXES))}) in {value}.")
        return found
    if is_file and images and path.suffix.lower() in IMAGE_SUFFIXES:
        return [str(path)]
    if is_file:
        # utf-8-sig: a byte-order mark (Notepad's UTF-8) is no part of the first input
        lines = [line.strip() for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{value} has no non-empty lines.")
        return lines
    if images:
        raise FileNotFoundError(f"No image file or folder at {value}.")
    if _file_name_like(value):  # a misspelt file name must not be classified as the text itself
        raise FileNotFoundError(f"No file {value}: --input reads a file of that name, one input per line (a text "
                                f"to run has a space in it, or no file suffix).")
    return [value]


def _file_name_like(value: str) -> bool:
    """One word ending in a file suffix (``inputs.txt``, ``data/reviews.csv``): a path, not a text."""
    suffix = Path(value).suffix.lower()
    return not any(c.isspace() for c in value) and suffix in {".txt", ".text", ".csv", ".tsv", ".json", ".jsonl"}


# hf-wide run's options of one task or two: flag -> (the tasks it applies to, as its refusal names them)
TEXT_TASKS = ("text-classification", "token-classification", "feature-extraction", "text-generation")
TASK_OPTIONS = {"--top-k": (("text-classification", "image-classification"), "text- and image-classification"),
                "--tokenizer": (TEXT_TASKS, "the text tasks"),
                "--image-processor": (("image-classification",), "image-classification"),
                "--aggregation": (("token-classification",), "token-classification"),
                "--max-new-tokens": (("text-generation",), "text-generation")}


def _call_options(args: argparse.Namespace) -> dict:
    """The task's own options from the command line; another task's is refused, not ignored."""
    for flag, (tasks, named) in TASK_OPTIONS.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None and args.task not in tasks:
            raise ValueError(f"{flag} applies to {named}, not to {args.task}.")
    if args.task in ("text-classification", "image-classification"):
        return {} if args.top_k is None else {"top_k": args.top_k}
    if args.task == "token-classification":
        return {"aggregation_strategy": args.aggregation or "simple"}
    if args.task == "text-generation":  # the members' own continuations too, beside the ensemble's
        options = {"return_members": args.combine != "none"}
        if args.max_new_tokens is not None:  # else the members' own (or what their max_length leaves), else 20
            options["max_new_tokens"] = args.max_new_tokens
        return options
    return {}

def _answer(task: str, result: dict) -> str:
    """One answer (the ensemble's or a member's) as a short string."""
    if task == "token-classification":
        entities = result if isinstance(result, list) else result["entities"]
        return "; ".join(f"{e['word']}/{e.get('entity_group', e.get('entity'))} ({e['score']:.2f})"
                         for e in entities) or "(no entities)"
    if task == "feature-extraction":
        vector = result if isinstance(result, list) else result["embedding"]
        return f"dim {len(vector)}, norm {math.sqrt(sum(float(v) ** 2 for v in _flat(vector))):.3f}"
    if task == "text-generation":
        return result["generated_text"]
    if "labels" in result:  # multi-label
        return ", ".join(f"{x['label']} ({x['score']:.2f})" for x in result["labels"]) or "(none)"
    return f"{result['label']} ({result['score']:.2f})"


def _ranked(result: dict) -> str:
    """The k best labels of a classification run with --top-k, on a line of their own after its answer."""
    best = result.get("top_k")
    return "" if not best else f"\ntop {len(best)}: " + ", ".join(f"{x['label']} ({x['score']:.2f})" for x in best)


def _cells(task: str, result: dict) -> list[str]:
    """The ensemble, members and uncertainty cells of one input's row."""
    ensemble = "-" if set(result) <= {"members"} else _answer(task, result) + _ranked(result)
    members = "\n".join(f"m{i}: {_answer(task, m)}" for i, m in enumerate(result.get("members", [])))
    if task == "token-classification":  # the mean over the ensemble's entities
        found = [e["uncertainty"] for e in result.get("entities", [])]
        uncertainty = {k: sum(u[k] for u in found) / len(found) for k in SHORT_NAMES} if found else {}
    else:
        uncertainty = result.get("uncertainty", {})
    measures = " ".join(f"{SHORT_NAMES[k]} {v:.3f}" for k, v in uncertainty.items())
    if task == "feature-extraction" and "embedding" in result and result["embedding"]:
        cosines = [_cosine(_flat(m), _flat(result["embedding"])) for m in result["members"]]
        measures = f"cos to ensemble: min {min(cosines):.3f} mean {sum(cosines) / len(cosines):.3f}"
    return [ensemble, members or "-", measures or "-"]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / max(math.sqrt(sum(x * x for x in a) * sum(y * y for y in b)), 1e-12)


def _flat(values) -> list:
    return [x for v in values for x in _flat(v)] if isinstance(values, list) else [values]


def _short(text: str, limit: int = CELL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A rich table where rich is installed (the demo extra), else plain aligned columns."""
    if _has_rich():
        from rich.console import Console
        from rich.table import Table

        table = Table(*headers, show_lines=True)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    rows = [[_short(cell.replace("\n", " | ")) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    for line in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
