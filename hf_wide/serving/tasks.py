"""Each served task's payloads: what ``InferenceClient`` sends for it, and the answer it parses.

The ensemble's extras ride along where ``InferenceClient`` keeps them (extra fields become attributes of what
it returns), or behind a ``return_members`` parameter where the API's answer has no room for them:

- text-classification: ``[{"label", "score"}, ...]`` per input, best first; ``members`` and ``uncertainty`` on
  the best label.
- image-classification: the same (for one image, the ranked list itself).
- token-classification: ``[{"entity_group", "score", "word", "start", "end"}, ...]``, ``uncertainty`` on each
  entity; with ``return_members``, ``{"entities", "members"}``.
- feature-extraction: the ensemble's embedding per input (``[D]``, or ``[T, D]`` with ``pooling="none"``); with
  ``return_members``, ``{"embeddings", "members"}``.
- text-generation: ``{"generated_text", "uncertainty"}`` per input, ``members`` with ``return_members``.

An input longer than the model takes is refused (a 422 that says so), not cut, unless the request asks for
truncation (feature extraction's ``truncate``).
"""

from __future__ import annotations

import base64
import binascii
import io

from .payloads import (BadRequest, Request, TaskFormat, _kind, boolean, list_of_texts, one_of, positive_int,
                       positive_number, probability, read_json, seed, texts)

MAX_IMAGE_BYTES = 20 * 1024 * 1024


class Classification(TaskFormat):
    """Ranked labels per input (all labels, or ``top_k``); the first carries the ensemble's extras.
    ``function_to_apply`` goes to the pipeline, which decides what it means for these members: ``softmax`` (one
    label) or ``sigmoid`` (each label on its own); ``none`` (values as they are) for regressors only, raw logits
    having no meaning for an ensemble's combined probabilities (the pipeline's refusal is a 422)."""

    parameters = {"top_k": positive_int, "function_to_apply": one_of("softmax", "sigmoid", "none")}

    def setup(self, pipe) -> None:
        super().setup(pipe)
        self.num_labels = len(pipe.label_order()[0])

    def options(self, parameters: dict) -> dict:
        options = {"top_k": self.num_labels}  # every label's score, to rank and cut to the caller's top_k
        if "function_to_apply" in parameters:
            options["function_to_apply"] = parameters["function_to_apply"]
        return options

    def answer(self, answer: dict, parameters: dict) -> list[dict]:
        ranked = [dict(entry) for entry in answer["top_k"][:parameters.get("top_k", self.num_labels)]]
        ranked[0].update(members=answer["members"], uncertainty=answer["uncertainty"])
        return ranked


class TextClassification(Classification):
    """``[[{"label", "score"}, ...]]``: one ranked list per input (a list of one for a single text). An input is a
    text or a pair, ``{"text": premise, "text_pair": hypothesis}`` (natural language inference), as transformers'
    pipeline and Inference Endpoints take one; ``inputs`` may be a list of both."""

    task = "text-classification"

    def inputs(self, inputs) -> tuple[bool, list]:
        if isinstance(inputs, dict):  # one pair
            return True, [_text_pair(inputs, "")]
        if isinstance(inputs, list) and any(isinstance(item, dict) for item in inputs):  # pairs, maybe with texts
            texts(["pair" if isinstance(item, dict) else item for item in inputs])  # count, types, empty texts
            return False, [_text_pair(item, f" (item {i})") if isinstance(item, dict) else item
                           for i, item in enumerate(inputs)]
        return texts(inputs)

    def options(self, parameters: dict) -> dict:
        return {**super().options(parameters), "truncation": False}


def _text_pair(item: dict, where: str) -> dict:
    """``{"text": premise, "text_pair": hypothesis}``, as transformers' pipeline takes a pair, both non-empty."""
    if set(item) != {"text", "text_pair"}:
        raise BadRequest(f'A text pair{where} is {{"text": ..., "text_pair": ...}}; got the keys {sorted(item)}.')
    for key in ("text", "text_pair"):
        value = item[key]
        if not isinstance(value, str):
            raise BadRequest(f'"{key}"{where} must be a text, got a {_kind(value)}.')
        if not value.strip():
            raise BadRequest(f'"{key}"{where} is an empty text: there is nothing to run.')
    return {"text": item["text"], "text_pair": item["text_pair"]}


class ImageClassification(Classification):
    """The body is an image's bytes (what ``InferenceClient`` sends without parameters), or JSON whose
    ``inputs`` is the base64 of one image or a list of them. One image: its ranked list; a list: one per image.
    Images are decoded here, so that one that does not decode is refused alone (a 400 that says so)."""

    task = "image-classification"

    def parse_body(self, body: bytes, content_type: str = "application/json") -> Request:
        if "json" in content_type or (not content_type and body.lstrip()[:1] == b"{"):
            return self.parse(read_json(body))
        return Request([decode_image(body)], self.options({}), True, {})

    def inputs(self, inputs) -> tuple[bool, list]:
        single = isinstance(inputs, str)
        items = [inputs] if single else inputs
        if not isinstance(items, list) or not items or not all(isinstance(item, str) for item in items):
            raise BadRequest(f'"inputs" must be an image as base64 text, or a list of them; got {_kind(inputs)}.')
        if len(items) > 16:
            raise BadRequest(f'"inputs" holds {len(items)} images; one request takes at most 16.', 413)
        return single, [decode_image(_base64(item)) for item in items]

    def respond(self, request: Request, answers: list) -> list:
        ranked = super().respond(request, answers)
        return ranked[0] if request.single else ranked


def _base64(text: str) -> bytes:
    if text.startswith(("http://", "https://")):
        raise BadRequest("The server does not fetch images from URLs: send the image's bytes (as the body, or "
                         "base64 in \"inputs\").")
    try:
        return base64.b64decode(text.split(",", 1)[-1] if text.startswith("data:") else text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f'"inputs" is not an image in base64: {exc}.', 400) from exc


def decode_image(data: bytes):
    """A PIL image from its encoded bytes (PNG, JPEG, ...), loaded now, or a 400/413 that says why not."""
    from PIL import Image

    if not data:
        raise BadRequest("The request has no image: send an image's bytes, or JSON with \"inputs\".", 400)
    if len(data) > MAX_IMAGE_BYTES:
        raise BadRequest(f"The image is {len(data)} bytes; the server takes at most {MAX_IMAGE_BYTES}.", 413)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Image.DecompressionBombError as exc:
        raise BadRequest(f"The image is too large to decode: {exc}", 413) from exc
    except Exception as exc:  # PIL raises many kinds on bad data
        raise BadRequest(f"The image does not decode: {exc}.", 400) from exc
    return image


class TokenClassification(TaskFormat):
    """The entities of each input (one text: the list itself), grouped with ``aggregation_strategy``
    (``simple`` unless asked, as the Inference API), ``ignore_labels`` dropped. Each ensemble entity carries
    its ``uncertainty``; ``return_members=true`` answers ``{"entities", "members"}`` per input."""

    task = "token-classification"
    parameters = {"aggregation_strategy": one_of("none", "simple", "first", "average", "max"),
                  "ignore_labels": list_of_texts, "return_members": boolean}
    refused = {"stride": "texts are not split into overlapping windows; one over the model's maximum length is "
                         "refused."}

    def inputs(self, inputs) -> tuple[bool, list]:
        return texts(inputs)

    def options(self, parameters: dict) -> dict:
        options = {"truncation": False, "aggregation_strategy": parameters.get("aggregation_strategy", "simple")}
        if "ignore_labels" in parameters:
            options["ignore_labels"] = parameters["ignore_labels"]
        return options

    def answer(self, answer: dict, parameters: dict):
        if parameters.get("return_members"):
            return {"entities": answer["entities"], "members": answer["members"]}
        return answer["entities"]

    def respond(self, request: Request, answers: list) -> list:
        entities = super().respond(request, answers)
        return entities[0] if request.single else entities


class FeatureExtraction(TaskFormat):
    """One embedding per input, the ensemble's (``[[D floats]]`` for one text, as TEI answers), pooled with
    hf-wide's ``pooling`` (``mean`` over the real tokens, ``cls``, or ``none``: every token's). ``normalize``
    (L2, default false), ``truncate`` (cut an over-long text instead of refusing it; at its end only) come at
    the top level, as ``InferenceClient`` sends them, or in ``parameters``. ``return_members=true`` answers
    ``{"embeddings": [...], "members": [[N embeddings] per input]}``."""

    task = "feature-extraction"
    too_long = "pass truncate=true to cut it"
    parameters = {"normalize": boolean, "truncate": boolean, "truncation_direction": lambda n, v: _direction(v),
                  "pooling": one_of("mean", "cls", "none"), "return_members": boolean,
                  "encoding_format": one_of("float")}
    refused = {"prompt_name": "the members have no prompts.",
               "dimensions": "embeddings are not shortened (Matryoshka); cut them on the client if the members "
                             "were trained for it."}
    top_level = tuple(parameters) + tuple(refused)

    def inputs(self, inputs) -> tuple[bool, list]:
        return texts(inputs)

    def options(self, parameters: dict) -> dict:
        options = {"truncation": parameters.get("truncate", False)}
        for name in ("normalize", "pooling"):
            if name in parameters:
                options[name] = parameters[name]
        return options

    def answer(self, answer: dict, parameters: dict):
        return answer

    def respond(self, request: Request, answers: list):
        embeddings = [answer["embedding"] for answer in answers]
        if request.parameters.get("return_members"):
            return {"embeddings": embeddings, "members": [answer["members"] for answer in answers]}
        return embeddings


def _direction(value) -> str:
    if not isinstance(value, str) or value.lower() not in ("left", "right"):
        raise BadRequest(f"Parameter 'truncation_direction' must be 'left' or 'right', got {value!r}.")
    if value.lower() == "left":
        raise BadRequest("Parameter 'truncation_direction': 'left' is not supported; texts are cut at their end.")
    return "right"


TGI_ONLY = ("adapter_id", "best_of", "decoder_input_details", "details", "frequency_penalty", "grammar",
            "repetition_penalty", "stop", "top_n_tokens", "truncate", "typical_p", "watermark")


class TextGeneration(TaskFormat):
    """``[{"generated_text", "uncertainty"}]`` per input (with ``members``, each member's own continuation,
    when ``return_members=true``): the ensemble's continuation only, unless ``return_full_text``. Parameters:
    ``max_new_tokens`` (20), ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``.

    Text Generation Inference's other parameters (``details``, ``stop``, ``stream``, ...) are answered with a
    400 in TGI's words (``The following `model_kwargs` are not used by the model: [...]``), on which
    ``InferenceClient`` drops them with a warning and asks again."""

    task = "text-generation"
    parameters = {"max_new_tokens": positive_int, "do_sample": boolean, "temperature": positive_number,
                  "top_k": positive_int, "top_p": probability, "seed": seed,
                  "return_full_text": boolean, "return_members": boolean}
    refused = dict.fromkeys(TGI_ONLY, "")

    def parse(self, payload: dict) -> Request:
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f'"stream" must be true or false, got {stream!r}.')
        if stream:
            self._not_used(["stream"], "answers come whole: streaming is not supported")
        return super().parse({k: v for k, v in payload.items() if k != "stream"})

    def refuse(self, parameters: dict) -> None:
        asked = sorted(k for k, v in parameters.items() if v not in (None, False))
        if asked:
            self._not_used(asked, "hf-wide serve is not Text Generation Inference")

    @staticmethod
    def _not_used(names: list[str], why: str):
        raise BadRequest(f"The following `model_kwargs` are not used by the model: {names} ({why}).", 400)

    def inputs(self, inputs) -> tuple[bool, list]:
        return texts(inputs)

    def options(self, parameters: dict) -> dict:
        return {"truncation": False, "return_full_text": False, **parameters}

    def answer(self, answer: dict, parameters: dict) -> dict:
        return answer


FORMATS: dict[str, type[TaskFormat]] = {
    fmt.task: fmt for fmt in (TextClassification, TokenClassification, FeatureExtraction, ImageClassification,
                              TextGeneration)}


def check_task(task: str) -> None:
    if task not in FORMATS:
        raise ValueError(f"hf-wide serve does not serve {task!r}; it serves {', '.join(sorted(FORMATS))}.")


def task_format(task: str, pipe) -> TaskFormat:
    """The payloads of ``task``, set up for ``pipe``."""
    check_task(task)
    fmt = FORMATS[task]()
    fmt.setup(pipe)
    return fmt
