"""The Hugging Face Inference API's payloads, read and written for a wide pipeline; no server code here.

A request is ``{"inputs": ..., "parameters": {...}}`` as ``huggingface_hub.InferenceClient`` sends it to a base
URL. Each task's :class:`TaskFormat` checks it (a :class:`BadRequest` that says what is wrong: the server answers
it with its status and ``{"error": message}``, the Inference API's error body), turns it into the pipeline's
inputs and options, and turns the pipeline's answers into the task's response, which ``InferenceClient`` parses.

The ensemble's extras ride along as extra fields, which ``InferenceClient`` keeps as attributes of what it
returns: in text classification, the first (best) label of each input carries ``members`` (each member's answer)
and ``uncertainty`` (the pipeline's measures).
"""

from __future__ import annotations

import dataclasses
import json
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
    if not isinstance(payload, dict):
        raise BadRequest(f'The request body must be a JSON object {{"inputs": ...}}, got a {_kind(payload)}.', 400)
    return payload


class TaskFormat:
    """One task's payloads. Subclasses set ``task`` and ``parameters`` (name -> check), and write ``options``
    (the pipeline's options from the checked parameters) and ``answer`` (one item's response)."""

    task = ""
    parameters: dict[str, Any] = {}

    def setup(self, pipe) -> None:
        """Read what the responses need from the pipeline (its labels, say)."""

    def parse(self, payload: dict) -> Request:
        unknown = sorted(set(payload) - {"inputs", "parameters", "options"})  # "options": the API's cache hints
        if unknown:
            raise BadRequest(f"Unknown field(s) {', '.join(map(repr, unknown))}: a request has \"inputs\" and, "
                             "optionally, \"parameters\".")
        if "inputs" not in payload:
            raise BadRequest('The request has no "inputs".')
        parameters = payload.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise BadRequest(f'"parameters" must be an object, got a {_kind(parameters)}.')
        unknown = sorted(set(parameters) - set(self.parameters))
        if unknown:
            known = ", ".join(sorted(self.parameters)) or "none"
            raise BadRequest(f"Unknown parameter(s) for {self.task}: {', '.join(map(repr, unknown))} (known: {known}).")
        checked = {name: self.parameters[name](name, value) for name, value in parameters.items() if value is not None}
        single, items = self.inputs(payload["inputs"])
        return Request(items, self.options(checked), single, checked)

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


def one_of(*choices: str):
    def check(name: str, value) -> str:
        if value not in choices:
            raise BadRequest(f"Parameter {name!r} must be one of {', '.join(map(repr, choices))}, got {value!r}.")
        return value
    return check


class TextClassification(TaskFormat):
    """``[[{"label", "score"}, ...]]`` per input, best first (all labels, or ``top_k``); the first carries the
    ensemble's extras. ``function_to_apply``: ``softmax`` (one label) or ``sigmoid`` (each label on its own,
    the pipeline's ``multi_label``); ``none`` (raw logits) has no meaning for an ensemble's combined
    probabilities, and is refused. A text longer than the model takes is refused, not truncated."""

    task = "text-classification"
    parameters = {"top_k": positive_int, "function_to_apply": one_of("softmax", "sigmoid", "none")}

    def setup(self, pipe) -> None:
        self.num_labels = len(pipe.label_order()[0])

    def inputs(self, inputs) -> tuple[bool, list]:
        if isinstance(inputs, dict):
            raise BadRequest("Text pairs ({\"text\", \"text_pair\"}) are not supported: send a text or a list of texts.")
        return texts(inputs)

    def options(self, parameters: dict) -> dict:
        if parameters.get("function_to_apply") == "none":
            raise BadRequest("function_to_apply='none' (raw logits) has no meaning for an ensemble, whose answer "
                             "combines the members' probabilities: use 'softmax' or 'sigmoid'.")
        # every label's score, to rank and cut to the caller's top_k; a text over the model's maximum length
        # refused (a 422 that says so) rather than cut silently
        options = {"top_k": self.num_labels, "truncation": False}
        if "function_to_apply" in parameters:
            options["multi_label"] = parameters["function_to_apply"] == "sigmoid"
        return options

    def answer(self, answer: dict, parameters: dict) -> list[dict]:
        ranked = [dict(entry) for entry in answer["top_k"][:parameters.get("top_k", self.num_labels)]]
        ranked[0].update(members=answer["members"], uncertainty=answer["uncertainty"])
        return ranked


FORMATS: dict[str, type[TaskFormat]] = {TextClassification.task: TextClassification}


def task_format(task: str, pipe) -> TaskFormat:
    """The payloads of ``task``, set up for ``pipe``."""
    if task not in FORMATS:
        raise ValueError(f"hf-wide serve does not serve {task!r} yet; it serves {', '.join(sorted(FORMATS))}.")
    fmt = FORMATS[task]()
    fmt.setup(pipe)
    return fmt


def _kind(value) -> str:
    return {dict: "JSON object", list: "list", str: "text", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)
