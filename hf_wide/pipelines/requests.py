"""Many callers' requests in shared forwards: what a server's batch runs (:mod:`hf_wide.serving`).

``pipe(items, **options)`` runs one caller's inputs with one set of options. A server gathers the requests
of many callers, each with its own options and its own chance of being wrong, and must answer each as the
pipeline would answer it alone while running them together:

- each request's options are checked on its own, and the inputs of requests whose preprocess options agree
  are preprocessed in one call (one tokenizer call); where that call refuses one, each request's again on its
  own (a bad one gets its error back, and the others run);
- requests whose ``_forward`` options agree share forwards (sorted by length, ``batch_size`` at a time, of one
  batch key), unless the pipeline says an answer with them depends on its batch (sampling: those requests run
  alone);
  ``postprocess`` runs with each request's own options;
- a forward that raises is run again one request at a time, so that only the request that fails does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import WidePipeline, _item, batches


def run_requests(pipe: WidePipeline, requests: Sequence[tuple[list, dict]]) -> list[list | Exception]:
    """For each ``(items, options)``, the list of the pipeline's answers for its items, or the exception that
    refused it (``TypeError``/``ValueError``: the request's fault; anything else: the model's)."""
    answers: list[list | Exception | None] = [None] * len(requests)
    checked: dict[str, list[tuple[int, dict, dict, dict]]] = {}  # preprocess options -> (request, pre, fwd, post)
    for r, (_, options) in enumerate(requests):
        try:
            pre, fwd, post = pipe.call_options(options)
        except (TypeError, ValueError) as exc:
            answers[r] = exc
            continue
        checked.setdefault(repr(sorted(pre.items())), []).append((r, pre, fwd, post))
    groups: dict[str, tuple[dict, list]] = {}  # _forward options -> (them, [(request, post, features)])
    for same_pre in checked.values():
        for r, fwd, post, features in _preprocess(pipe, requests, same_pre, answers):
            answers[r] = [None] * len(features)
            key = repr(sorted(fwd.items())) + ("" if pipe.batch_invariant(fwd) else f" request {r}")
            groups.setdefault(key, (fwd, []))[1].append((r, post, features))
    for fwd, members in groups.values():
        rows = [(r, j, f) for r, _, features in members for j, f in enumerate(features)]
        posts = {r: post for r, post, _ in members}
        for indices in batches(pipe, [f for _, _, f in rows], pipe.batch_size):
            chunk = [rows[k] for k in indices]
            try:
                _run(pipe, chunk, fwd, posts, answers)
            except Exception:  # the model failed on this batch: each request again alone, to fail only its own
                for r in dict.fromkeys(r for r, _, _ in chunk):
                    try:
                        _run(pipe, [row for row in chunk if row[0] == r], fwd, posts, answers)
                    except Exception as exc:
                        answers[r] = exc
    return answers


def _preprocess(pipe: WidePipeline, requests, same_pre: list, answers: list) -> list[tuple[int, dict, dict, list]]:
    """(request, fwd, post, features) of requests that share preprocess options: their items in one call (one
    tokenizer call for all, where the pipeline batches it); if that call refuses something, each request alone,
    and a request refused alone gets its exception in ``answers``."""
    pre = same_pre[0][1]
    try:
        features = pipe.preprocess_many([item for r, *_ in same_pre for item in requests[r][0]], **pre)
    except (TypeError, ValueError):
        done = []
        for r, _, fwd, post in same_pre:
            try:
                done.append((r, fwd, post, pipe.preprocess_many(list(requests[r][0]), **pre)))
            except (TypeError, ValueError) as exc:
                answers[r] = exc
        return done
    done, start = [], 0
    for r, _, fwd, post in same_pre:
        count = len(requests[r][0])
        done.append((r, fwd, post, features[start:start + count]))
        start += count
    return done


def _run(pipe: WidePipeline, rows: list[tuple[int, int, dict]], fwd: dict, posts: dict[int, dict],
         answers: list) -> None:
    """One forward over ``rows`` (request, item, features); each answer into its request's list."""
    outputs = pipe.forward_batch([features for _, _, features in rows], fwd)
    done: list[tuple[int, int, Any]] = [(r, j, pipe.postprocess(_item(outputs, b, features), **posts[r]))
                                        for b, (r, j, features) in enumerate(rows)]
    for r, j, answer in done:  # only once every row of the batch is answered
        if not isinstance(answers[r], Exception):
            answers[r][j] = answer
