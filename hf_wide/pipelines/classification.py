"""Text and image classification: the ensemble's label, each member's, and how sure the ensemble is."""

from __future__ import annotations

from typing import Any

import torch

from .. import metrics
from .base import WidePipeline
from .combine import Combine, combine, combine_values, member_probabilities, ranking, realign
from .inputs import load_image, text_and_pair, tokenize_many
from .options import whole_number


class ClassificationPipeline(WidePipeline):
    """Shared by text and image classification: ``_forward`` combines the members on the device and
    computes the uncertainty measures for the whole batch; ``postprocess`` formats one input.

    Options: ``top_k`` (the ensemble's k best labels, in ``"top_k"``; None: all of them), ``multi_label`` (independent
    sigmoids; by default for multi-label members and a head of one logit, as transformers'), or, in transformers'
    words, ``function_to_apply`` (``"softmax"``, or ``"sigmoid"``: each label on its own). Raw logits (``"none"``) are refused: the ensemble's
    answer combines the members' probabilities. Regressors (``problem_type="regression"``) are the exception: their
    values are combined as they are (``combine_values``), with their spread over the members as the uncertainty."""

    def _sanitize_parameters(self, top_k: int | None | str = "", multi_label: bool | None = None,
                             function_to_apply: str | None = None, **kwargs):
        pre, fwd, post = self._sanitize_inputs(**kwargs)
        if function_to_apply is not None and not (self._regressors() and _named(function_to_apply) == "none"):
            multi_label = _multi_label_of(function_to_apply, multi_label)
        if multi_label is not None:
            fwd["multi_label"] = post["multi_label"] = multi_label
        if top_k != "":  # None, as in transformers: every label, ranked
            if self.combine == Combine.NONE:  # (which would answer without it)
                raise ValueError("top_k ranks the ensemble's labels, and combine='none' has no ensemble answer: each "
                                 "member gives its own label; use another combine rule to rank labels.")
            post["top_k"] = None if top_k is None else whole_number("top_k", top_k)
        return pre, fwd, post

    def _sanitize_inputs(self, **kwargs) -> tuple[dict, dict, dict]:
        return super()._sanitize_parameters(**kwargs)

    def _regressors(self) -> bool:
        return getattr(self.model.config, "problem_type", None) == "regression"

    def _multi_label(self, multi_label: bool | None) -> bool | None:
        """Sigmoids (each label on its own) or a softmax; by default as transformers' pipeline picks its function:
        sigmoids for multi-label members and for a head of one logit (a softmax over one label scores 1.0), and
        None, values as they are, for regressors."""
        if multi_label is not None:
            return multi_label
        config = self.model.config
        if self._regressors():
            return None
        return getattr(config, "problem_type", None) == "multi_label_classification" or \
            getattr(config, "num_labels", None) == 1

    def _forward(self, batch, multi_label: bool | None = None):
        multi_label = self._multi_label(multi_label)
        _, permutations = self.label_order()
        logits = realign(self.model(**batch).logits, permutations)  # (N, B, C)
        if multi_label is None:  # regressors: their values
            if self.temperature != 1.0:
                raise ValueError(f"temperature={self.temperature} scales probabilities, and these members are "
                                 "regressors (problem_type='regression'), whose values have none.")
            return _values(logits.float(), combine_values(logits, self.combine, self.weights), self.weights)
        member_probs = member_probabilities(logits, multi_label, self.temperature)  # (N, B, C)
        scores = combine(logits, self.combine, self.weights, multi_label, self.temperature)  # (B, C)
        out = {"per_member_probs": member_probs, "scores": scores, "ranking": ranking(scores, member_probs)}
        out["per_member_score"], out["per_member_label"] = member_probs.max(-1)  # (N, B) each
        weights = self.weights  # (of a weighted ensemble: the measures weigh the members as its answer does)
        if multi_label:  # each label a yes/no question: measures averaged over labels
            binary = torch.stack([member_probs, 1 - member_probs], -1)  # (N, B, C, 2)
            out["predictive_entropy"] = metrics.predictive_entropy(binary, weights).mean(-1)
            out["expected_entropy"] = metrics.expected_entropy(binary, weights).mean(-1)
            out["mutual_information"] = metrics.mutual_information(binary, weights).mean(-1)
            out["member_std"] = metrics.member_std(member_probs, weights).mean(-1)  # (B,): over labels, as the others
        else:
            out.update(metrics.uncertainty(member_probs, out["ranking"].argmax(-1), weights))
        return out

    def postprocess(self, outputs: dict[str, Any], top_k: int | None | str = "", multi_label: bool | None = None):
        labels, _ = self.label_order()
        multi_label = self._multi_label(multi_label)
        # Plain Python from here: a few conversions per input rather than a tensor op per label and member.
        one = multi_label and len(labels) == 1  # a head of one logit: its label and sigmoid, as transformers gives
        if multi_label is None:  # regressors: each member's largest value, as transformers' argmax of the outputs
            members = [{"label": labels[i], "score": v} for i, v in
                       zip(outputs["per_member_label"].tolist(), outputs["per_member_score"].tolist())]
        elif one:
            members = [{"label": labels[0], "score": p[0]} for p in outputs["per_member_probs"].tolist()]
        elif multi_label:
            members = [_labels_above(p, labels) for p in outputs["per_member_probs"].tolist()]  # (N, C)
        else:
            members = [{"label": labels[i], "score": p} for i, p in
                       zip(outputs["per_member_label"].tolist(), outputs["per_member_score"].tolist())]
        if self.combine == Combine.NONE:
            return {"members": members}
        scores, order = outputs["scores"].tolist(), outputs["ranking"].argsort(descending=True).tolist()  # (C,) each
        result: dict[str, Any] = {}
        result.update(label=labels[order[0]], score=scores[order[0]])  # the best label, as transformers gives it
        if multi_label and not one:  # and every label the ensemble says yes to
            result["labels"] = [{"label": labels[i], "score": scores[i]} for i in order if scores[i] > 0.5]
        if top_k != "":
            result["top_k"] = [{"label": labels[i], "score": scores[i]} for i in order[:top_k]]
        result["members"] = members
        keys = ("predictive_entropy", "expected_entropy", "mutual_information", "member_std", "agreement")
        result["uncertainty"] = {k: outputs[k].item() for k in keys if k in outputs}
        return result


def _values(values: torch.Tensor, scores: torch.Tensor, weights: torch.Tensor | None = None) -> dict:
    """Regressors' outputs: their values ``(N, B, C)`` and the ensemble's ``(B, C)``, whose largest is the answer,
    with the spread of the members' values of it (``member_std``) as its uncertainty."""
    chosen = scores.argmax(-1)  # (B,)
    mine = values.gather(-1, chosen.view(1, -1, 1).expand(values.shape[0], -1, 1)).squeeze(-1)  # (N, B)
    out = {"scores": scores, "ranking": scores.double(), "member_std": metrics.member_std(mine, weights)}
    out["per_member_score"], out["per_member_label"] = values.max(-1)  # (N, B) each
    return out


def _named(function_to_apply) -> str:
    return str(getattr(function_to_apply, "value", function_to_apply)).lower()


def _multi_label_of(function_to_apply, multi_label: bool | None) -> bool:
    """transformers' ``function_to_apply`` (a string, or its ``ClassificationFunction``) as ``multi_label``."""
    name = _named(function_to_apply)
    if name == "none":
        raise ValueError("function_to_apply='none' (raw logits) has no meaning for an ensemble, whose answer combines "
                         "the members' probabilities: use 'softmax' or 'sigmoid' (each member's logits are "
                         "WideModel(...).logits).")
    if name not in ("softmax", "sigmoid"):
        raise ValueError(f"function_to_apply must be 'softmax' or 'sigmoid', got {function_to_apply!r}.")
    if multi_label is not None and multi_label != (name == "sigmoid"):
        raise ValueError(f"function_to_apply={name!r} and multi_label={multi_label} disagree: pass one of them.")
    return name == "sigmoid"


def _labels_above(probs: list[float], labels: list[str], threshold: float = 0.5) -> list[dict]:
    return [{"label": labels[i], "score": p} for i, p in enumerate(probs) if p > threshold]


class TextClassificationPipeline(ClassificationPipeline):
    """``pipe("great movie")`` -> ``{"label", "score", "members", "uncertainty"}``; a pair of texts (natural
    language inference) as transformers takes one, ``pipe({"text": premise, "text_pair": hypothesis})``.
    Texts longer than the model's maximum length are truncated (``truncation=False`` refuses them)."""

    task = "text-classification"
    heads = ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
             "a sequence-classification head (...ForSequenceClassification)")

    def packs_tokens(self) -> bool:
        return True  # each answer reads its text's first token (or a pooling of its own tokens)

    def reads_first_tokens(self) -> bool:
        return True  # the logits, of a head that reads each text's first token where the model's probe agrees

    def _sanitize_inputs(self, truncation: bool | None = None, **kwargs):
        pre, fwd, post = super()._sanitize_inputs(**kwargs)
        if truncation is not None:
            pre["truncation"] = truncation
        return pre, fwd, post

    def preprocess(self, text, truncation: bool = True):
        return self.preprocess_many([text], truncation)[0]

    def preprocess_many(self, texts, truncation: bool = True):
        items = [text_and_pair(text) for text in texts]
        singles = [i for i, (_, pair) in enumerate(items) if pair is None]
        pairs = [i for i, (_, pair) in enumerate(items) if pair is not None]
        features = [None] * len(items)
        for rows, text_pairs in ((singles, None), (pairs, [items[i][1] for i in pairs])):
            if rows:  # one tokenizer call for the single texts, one for the pairs
                encoded = tokenize_many(self.tokenizer, self.model, [items[i][0] for i in rows], truncation, text_pairs)
                for i, feature in zip(rows, encoded):
                    features[i] = feature
        return features


class ImageClassificationPipeline(ClassificationPipeline):
    """``pipe(image)`` with a PIL image, an array or a file path. Images are converted to the mode the
    model expects (``L`` for one channel, ``RGB`` for three) before the image processor runs."""

    task = "image-classification"
    heads = ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "an image-classification head (...ForImageClassification)")

    def preprocess(self, image):
        channels = getattr(self.model.config, "num_channels", 3)
        pixels = self.image_processor(load_image(image, channels), return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels.to(next(self.model.parameters()).dtype)}
