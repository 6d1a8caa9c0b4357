"""The Hugging Face Inference API's payloads, read and written for a wide pipeline; no server code here.

A request is ``{"inputs": ..., "parameters": {...}}`` as ``huggingface_hub.InferenceClient`` sends it to a base
URL (feature extraction sends its parameters at the top level, image classification may send the image's bytes
as the body). A task's :class:`TaskFormat` (:mod:`.tasks`) checks it (a :class:`BadRequest` that says what is
wrong: the server answers it with its status and ``{"error": message}``, the Inference API's error body), turns
it into the pipeline's inputs and options, and turns the pipeline's answers into the task's response, which
``InferenceClient`` parses. This module holds what every task shares: the request's envelope and the checks of
parameter values.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any


MAX_INPUTS = 256  # texts in one request


class BadRequest(Exception):
    """A request the server refuses: ``status`` (4xx) and a message that says what is wrong."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Request:
    """One caller's request, checked: the pipeline's ``items`` and ``options``, whether ``inputs`` was one item
    (``single``: its answer is the response's only entry), and the task's own parameters for the response."""

    items: list
    options: dict
    single: bool
    parameters: dict


def read_json(body: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says why not."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}.", 400) from exc
    except RecursionError as exc:  # the decoder's stack, on arrays or objects nested thousands deep
        raise BadRequest("The request body is JSON nested too deeply to read.", 400) from exc
    if not isinstance(payload, dict):
        raise BadRequest(f'The request body must be a JSON object {{"inputs": ...}}, got a {_kind(payload)}.', 400)
    return payload


class TaskFormat:
    """One task's payloads. Subclasses set ``task`` and ``parameters`` (name -> check), and write ``inputs``
    (the pipeline's items), ``options`` (the pipeline's options from the checked parameters) and ``answer``
    (one item's response). ``refused`` names parameters of the API that hf-wide does not do, with the reason;
    ``top_level`` names parameters that may also come outside ``"parameters"`` (as InferenceClient sends
    feature extraction's)."""

    task = ""
    parameters: dict[str, Any] = {}
    refused: dict[str, str] = {}
    top_level: tuple[str, ...] = ()
    # what a request that is too long may do: the pipeline's hint (pass truncation=True) names an option of its
    # own, which this server's requests do not take
    too_long = "this server refuses an input longer than the model takes rather than cut it: shorten it"

    def refusal(self, message: str) -> str:
        """The pipeline's refusal of a request's inputs or options, as a client of this server can act on it."""
        return re.sub(r"[pP]ass truncation=True to [^.]*", self.too_long, message)

    def setup(self, pipe) -> None:
        """Read what the responses need from the pipeline (its labels, say)."""
        if pipe.combine.value == "none":
            raise ValueError(f"hf-wide serve answers with the ensemble's {self.task} answer, and combine='none' has "
                             "none: choose a combination rule (mean, vote, ...); every member's answer comes too.")

    def parse_body(self, body: bytes, content_type: str = "application/json") -> Request:
        """A request body (JSON here; image classification also takes an image's bytes)."""
        return self.parse(read_json(body))

    def parse(self, payload: dict) -> Request:
        fields = {"inputs", "parameters", "options", *self.top_level}  # "options": the API's cache hints
        unknown = sorted(set(payload) - fields)
        if unknown:
            raise BadRequest(f"Unknown field(s) {', '.join(map(repr, unknown))}: a request has \"inputs\" and, "
                             "optionally, \"parameters\".")
        if "inputs" not in payload:
            raise BadRequest('The request has no "inputs".')
        parameters = payload.get("parameters")
        if parameters is None:  # null or absent, as InferenceClient sends "no parameters"; [], 0, "" are mistakes
            parameters = {}
        if not isinstance(parameters, dict):
            raise BadRequest(f'"parameters" must be an object, got a {_kind(parameters)}.')
        parameters = {**{k: payload[k] for k in self.top_level if k in payload}, **parameters}
        self.refuse({k: v for k, v in parameters.items() if k in self.refused})
        parameters = {k: v for k, v in parameters.items() if k not in self.refused}  # those that ask for nothing
        unknown = sorted(set(parameters) - set(self.parameters))
        if unknown:
            known = ", ".join(sorted(self.parameters)) or "none"
            raise BadRequest(f"Unknown parameter(s) for {self.task}: {', '.join(map(repr, unknown))} (known: {known}).")
        checked = {name: self.parameters[name](name, value) for name, value in parameters.items() if value is not None}
        single, items = self.inputs(payload["inputs"])
        return Request(items, self.options(checked), single, checked)

    def refuse(self, parameters: dict) -> None:
        """Refuse the API parameters that hf-wide does not do, where they ask for something (not null/false)."""
        asked = sorted(k for k, v in parameters.items() if v not in (None, False))
        if asked:
            raise BadRequest(" ".join(f"Parameter {k!r} is not supported: {self.refused[k]}" for k in asked))

    def inputs(self, inputs) -> tuple[bool, list]:
        raise NotImplementedError

    def options(self, parameters: dict) -> dict:
        return {}

    def answer(self, answer: Any, parameters: dict) -> Any:
        raise NotImplementedError

    def respond(self, request: Request, answers: list) -> list:
        """The response: one entry per input (a list of one for a single input, as the Inference API does)."""
        return [self.answer(answer, request.parameters) for answer in answers]


def texts(inputs) -> tuple[bool, list[str]]:
    """A text or a list of texts, each non-empty."""
    single = isinstance(inputs, str)
    items = [inputs] if single else inputs
    if not isinstance(items, list) or not items:
        what = "an empty list" if items == [] else f"a {_kind(inputs)}"
        raise BadRequest(f'"inputs" must be a text or a list of texts, got {what}.')
    if len(items) > MAX_INPUTS:
        raise BadRequest(f'"inputs" holds {len(items)} texts; one request takes at most {MAX_INPUTS}.', 413)
    for i, text in enumerate(items):
        where = "" if single else f" (item {i})"
        if not isinstance(text, str):
            raise BadRequest(f'"inputs"{where} must be a text, got a {_kind(text)}.')
        if not text.strip():
            raise BadRequest(f'"inputs"{where} is an empty text: there is nothing to run.')
    return single, items


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"Parameter {name!r} must be a positive integer, got {value!r}.")
    return value


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"Parameter {name!r} must be true or false, got {value!r}.")
    return value


def seed(name: str, value) -> int:
    """A sampling seed, checked as the pipeline checks one (torch's generators take 0 to 2**64 - 1): a larger one
    reached torch, whose refusal named no parameter."""
    from ..pipelines.options import sampling_seed  # here: importing hf_wide.pipelines takes seconds (serve --help)

    try:
        return sampling_seed(value)
    except ValueError as exc:
        raise BadRequest(f"Parameter {name!r}: {exc}") from exc


def positive_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise BadRequest(f"Parameter {name!r} must be a positive number, got {value!r}.")
    return float(value)


def probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise BadRequest(f"Parameter {name!r} must be a number in (0, 1], got {value!r}.")
    return float(value)


def list_of_texts(name: str, value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"Parameter {name!r} must be a list of texts, got {value!r}.")
    return value


def one_of(*choices: str):
    def check(name: str, value) -> str:
        if value not in choices:
            raise BadRequest(f"Parameter {name!r} must be one of {', '.join(map(repr, choices))}, got {value!r}.")
        return value
    return check


def _kind(value) -> str:
    return {dict: "JSON object", list: "list", str: "text", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)
