"""Token classification (NER, tagging): every token's, word's or entity's label from the ensemble, each
member's, and how sure the ensemble is about each one.

    pipe = pipeline("token-classification", model=ids, aggregation_strategy="simple")
    pipe("alice flew to paris")
    # {"entities": [{"entity_group", "score", "word", "start", "end", "uncertainty"}, ...],
    #  "members": [[{"entity_group", "score", "word", "start", "end"}, ...], ...]}

Aggregation follows transformers' ``TokenClassificationPipeline`` exactly, so each member's list equals
``transformers.pipeline("token-classification", model=member, aggregation_strategy=...)``; the ensemble's
list is the same aggregation run on the combined per-token probabilities (``combine=`` as for sequence
classification, per token). Each ensemble unit carries the classification uncertainty measures, computed
on its member probabilities: a token's own, a word's aggregated like its score (first token, the token
with the highest score, or the mean over its tokens), and an entity's averaged over its words.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import torch

from .. import metrics
from .base import WidePipeline
from .combine import Combine, combine, member_probabilities, ranking, realign
from .inputs import tokenize

MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")
UNCERTAINTY_KEYS = ("predictive_entropy", "expected_entropy", "mutual_information", "member_std", "agreement")


class AggregationStrategy(str, enum.Enum):
    NONE = "none"  # every token on its own, with its index
    SIMPLE = "simple"  # tokens grouped into entities by their B-/I- tags
    FIRST = "first"  # a word takes its first token's label, then entities are grouped
    AVERAGE = "average"  # a word takes the label of its tokens' mean scores
    MAX = "max"  # a word takes the label of its most confident token

    @classmethod
    def parse(cls, value: "str | AggregationStrategy") -> "AggregationStrategy":
        try:
            return cls(value.lower() if isinstance(value, str) else value)
        except ValueError:
            choices = ", ".join(c.value for c in cls)
            raise ValueError(f"Unknown aggregation_strategy {value!r}: choose one of {choices}.") from None


class TokenClassificationPipeline(WidePipeline):
    """``pipe(text)`` -> ``{"entities": [...], "members": [[...], ...]}`` (``{"members"}`` only with
    ``combine="none"``). Options: ``aggregation_strategy`` (none, simple, first, average, max; the word
    strategies need a tokenizer that marks sub-words), ``ignore_labels`` (default ``["O"]``), ``truncation``."""

    task = "token-classification"
    heads = ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "a token-classification head (...ForTokenClassification)")

    def packs_tokens(self) -> bool:
        return True  # each answer reads its own tokens' outputs (postprocess cuts the padding off)

    def _sanitize_parameters(self, aggregation_strategy=None, ignore_labels=None, truncation=None, **kwargs):
        pre, fwd, post = super()._sanitize_parameters(**kwargs)
        if truncation is not None:
            pre["truncation"] = truncation
        if aggregation_strategy is not None:
            post["aggregation_strategy"] = AggregationStrategy.parse(aggregation_strategy)
        if ignore_labels is not None:
            post["ignore_labels"] = [ignore_labels] if isinstance(ignore_labels, str) else list(ignore_labels)
        return pre, fwd, post

    def preprocess(self, text, truncation: bool = True):
        if self.tokenizer is not None and not getattr(self.tokenizer, "is_fast", False):
            raise ValueError("Token classification needs a fast tokenizer: it reads the offsets of every token.")
        features = tokenize(self.tokenizer, self.model, text, truncation,
                            return_offsets_mapping=True, return_special_tokens_mask=True)
        features["text"] = text
        return features

    def collate(self, features):
        return super().collate([{k: f[k] for k in MODEL_KEYS if k in f} for f in features])

    def _forward(self, batch):
        _, permutations = self.label_order()
        logits = self.model(**batch).logits  # (N, B, T, C)
        n, b, t, c = logits.shape
        logits = realign(logits.reshape(n, b * t, c), permutations)  # every token a row: (N, B*T, C)
        member_probs = member_probabilities(logits, False, self.temperature).view(n, b, t, c)
        scores = combine(logits, self.combine, self.weights, False, self.temperature).view(b, t, c)
        return {"per_member_probs": member_probs, "scores": scores, "ranking": ranking(scores, member_probs)}

    def postprocess(self, outputs: dict[str, Any], aggregation_strategy=AggregationStrategy.NONE, ignore_labels=None):
        ignore = {"O"} if ignore_labels is None else set(ignore_labels)
        features = outputs["features"]
        length = features["input_ids"].shape[-1]  # outputs are padded to the batch's bucket
        member_probs = outputs["per_member_probs"][:, :length].float()  # (N, T, C)
        labels, _ = self.label_order()
        tokens = self._tokens(features, aggregation_strategy)
        members = []
        for probs in member_probs:
            units = _units(tokens, probs.numpy(), probs.numpy(), None, aggregation_strategy)
            members.append(_entities(units, labels, aggregation_strategy, ignore, self.tokenizer))
        if self.combine == Combine.NONE:
            return {"members": members}
        scores = outputs["scores"][:length].float().numpy()
        rank = outputs["ranking"][:length].numpy()  # float64: a vote tie's nudge rounds away in float32
        units = _units(tokens, scores, rank, member_probs, aggregation_strategy)
        _add_uncertainty(units, self.weights)
        entities = _entities(units, labels, aggregation_strategy, ignore, self.tokenizer, with_uncertainty=True)
        return {"entities": entities, "members": members}

    def _tokens(self, features, strategy: AggregationStrategy) -> list[dict]:
        """The non-special tokens with their word, character span and whether they continue a word
        (transformers' ``gather_pre_entities``)."""
        text = features["text"]
        ids = features["input_ids"][0].tolist()
        special = features["special_tokens_mask"][0].tolist()
        offsets = features["offset_mapping"][0].tolist()
        word_aware = getattr(getattr(getattr(self.tokenizer, "_tokenizer", None), "model", None),
                             "continuing_subword_prefix", None)
        if strategy in (AggregationStrategy.FIRST, AggregationStrategy.AVERAGE, AggregationStrategy.MAX) \
                and not word_aware:
            raise ValueError(f"aggregation_strategy={strategy.value!r} needs a tokenizer that marks sub-words "
                             "(WordPiece or BPE with a continuing-subword prefix); use 'simple' or 'none'.")
        tokens = []
        for index, (token_id, is_special, (start, end)) in enumerate(zip(ids, special, offsets)):
            if is_special:
                continue
            word = self.tokenizer.convert_ids_to_tokens(token_id)
            reference = text[start:end]
            if token_id == self.tokenizer.unk_token_id:
                word, is_subword = reference, False
            elif word_aware:
                is_subword = len(word) != len(reference)
            else:  # transformers' fallback heuristic for tokenizers that do not know words
                is_subword = start > 0 and " " not in text[start - 1 : start + 1]
            tokens.append({"index": index, "word": word, "start": start, "end": end, "is_subword": is_subword})
        return tokens


def _units(tokens: list[dict], scores: np.ndarray, rank: np.ndarray, member_probs: torch.Tensor | None,
           strategy: AggregationStrategy) -> list[dict]:
    """Tokens (none, simple) or words (first, average, max), each with its label index (argmax of ``rank``:
    the scores, with vote ties broken by the mean probability), its score, and for the ensemble its
    member probabilities ``(N, C)`` aggregated the same way."""
    if strategy in (AggregationStrategy.NONE, AggregationStrategy.SIMPLE):
        groups = [[t] for t in tokens]
    else:
        groups = []
        for token in tokens:
            if groups and token["is_subword"]:
                groups[-1].append(token)
            else:
                groups.append([token])
    units = []
    for group in groups:
        rows = [t["index"] for t in group]
        if strategy == AggregationStrategy.AVERAGE:
            unit_scores, unit_rank = np.nanmean(scores[rows], 0), np.nanmean(rank[rows], 0)
            probs = None if member_probs is None else member_probs[:, rows].mean(1)
        else:
            row = max(rows, key=lambda r: rank[r].max()) if strategy == AggregationStrategy.MAX else rows[0]
            unit_scores, unit_rank = scores[row], rank[row]
            probs = None if member_probs is None else member_probs[:, row]
        label = int(unit_rank.argmax())
        units.append({"label": label, "score": float(unit_scores[label]), "tokens": group, "probs": probs})
    return units


def _add_uncertainty(units: list[dict], weights: torch.Tensor | None = None) -> None:
    """Each unit's classification measures, from its member probabilities ``(N, C)``, all units at once (``weights``:
    a weighted ensemble's, :func:`hf_wide.metrics.uncertainty`)."""
    if not units:
        return
    probs = torch.stack([u["probs"] for u in units], 1)  # (N, K, C)
    chosen = torch.tensor([u["label"] for u in units], device=probs.device)  # (K,)
    measures = metrics.uncertainty(probs, chosen, weights)
    for k, unit in enumerate(units):
        unit["uncertainty"] = {key: float(measures[key][k]) for key in UNCERTAINTY_KEYS}


def _entities(units: list[dict], labels: list[str], strategy: AggregationStrategy, ignore: set[str], tokenizer,
              with_uncertainty: bool = False) -> list[dict]:
    """transformers' output: tokens (``entity``, ``index``) for ``none``, else entities (``entity_group``)
    grouped from adjacent units with the same tag (``B-`` starts a new one). Ignored labels are dropped."""
    entities = []
    for unit in units:
        tokens = unit["tokens"]
        word = tokens[0]["word"] if strategy in (AggregationStrategy.NONE, AggregationStrategy.SIMPLE) \
            else tokenizer.convert_tokens_to_string([t["word"] for t in tokens])
        entity = {"entity": labels[unit["label"]], "score": unit["score"]}
        if strategy == AggregationStrategy.NONE:
            entity["index"] = tokens[0]["index"]
        entity.update(word=word, start=tokens[0]["start"], end=tokens[-1]["end"])
        if with_uncertainty:
            entity["uncertainty"] = unit["uncertainty"]
        entities.append(entity)
    if strategy != AggregationStrategy.NONE:
        entities = [_group(g, tokenizer, with_uncertainty) for g in _adjacent_groups(entities)]
    return [e for e in entities if e.get("entity", e.get("entity_group")) not in ignore]


def _tag(label: str) -> tuple[str, str]:
    """("B" or "I", the tag) as transformers groups by it: labels without a B-/I- prefix (O, PER, and BIOES' E-PER
    and S-LOC, whole) continue the previous entity where they are the same label."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _adjacent_groups(entities: list[dict]) -> list[list[dict]]:
    groups: list[list[dict]] = []
    for entity in entities:
        bi, tag = _tag(entity["entity"])
        if groups and bi != "B" and tag == _tag(groups[-1][-1]["entity"])[1]:
            groups[-1].append(entity)
        else:
            groups.append([entity])
    return groups


def _group(entities: list[dict], tokenizer, with_uncertainty: bool) -> dict:
    group = {
        "entity_group": entities[0]["entity"].split("-", 1)[-1],  # as transformers names it: E-PER, S-LOC too
        "score": float(np.mean([e["score"] for e in entities])),
        "word": tokenizer.convert_tokens_to_string([e["word"] for e in entities]),
        "start": entities[0]["start"],
        "end": entities[-1]["end"],
    }
    if with_uncertainty:  # the mean of the grouped words' (or tokens') measures
        group["uncertainty"] = {k: float(np.mean([e["uncertainty"][k] for e in entities])) for k in UNCERTAINTY_KEYS}
    return group
