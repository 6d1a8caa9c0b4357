"""Feature extraction: sentence embeddings from every member and from the ensemble.

    pipe = pipeline("feature-extraction", model=ids)
    pipe("a sentence")   # {"embedding": [D floats], "members": [[D floats], ...]}

A member's embedding is its last hidden state mean-pooled over the real tokens (``pooling="mean"``, the
default), its first token's state (``"cls"``) or every token's state (``"none"``: ``(T, D)``, what
``transformers.pipeline("feature-extraction")`` returns for one text). The ensemble's embedding is the
mean of the members' (``combine="weighted"``: their weighted mean; ``"median"``: the element-wise median;
``"none"``: members only). ``normalize=True`` L2-normalises each member's embedding and the ensemble's.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import WidePipeline
from .combine import Combine, member_median
from .inputs import tokenize

POOLINGS = ("mean", "cls", "none")
RULES = (Combine.MEAN, Combine.WEIGHTED, Combine.MEDIAN, Combine.NONE)


class FeatureExtractionPipeline(WidePipeline):
    """``pipe(text)`` -> ``{"embedding", "members"}``. Options: ``pooling`` (mean, cls, none),
    ``normalize``, ``truncation``. Works on bare encoders and on models with a head (their last hidden
    state is read)."""

    task = "feature-extraction"

    def packs_tokens(self) -> bool:  # a bare encoder's states: each answer pools or cuts its own tokens'
        return self._bare()  # (a model with a head is asked for every layer's states, which are not unpacked)

    def _bare(self) -> bool:
        folded = self.model.model
        return getattr(folded, "base_model", folded) is folded  # a model with a head hides its hidden states

    def _sanitize_parameters(self, pooling: str | None = None, normalize: bool | None = None,
                             truncation: bool | None = None, **kwargs):
        pre, fwd, post = super()._sanitize_parameters(**kwargs)
        if self.combine not in RULES:
            raise ValueError(f"combine={self.combine.value!r} does not apply to embeddings: use one of "
                             f"{', '.join(r.value for r in RULES)}.")
        if self.temperature != 1.0:  # set by the constructor (or calibrate, which refuses this task)
            raise ValueError(f"temperature={self.temperature} scales probabilities, and embeddings have none.")
        if truncation is not None:
            pre["truncation"] = truncation
        if pooling is not None:
            if pooling not in POOLINGS:
                raise ValueError(f"Unknown pooling {pooling!r}: choose one of {', '.join(POOLINGS)}.")
            fwd["pooling"] = post["pooling"] = pooling
        if normalize is not None:
            fwd["normalize"] = normalize
        return pre, fwd, post

    def preprocess(self, text, truncation: bool = True):
        return tokenize(self.tokenizer, self.model, text, truncation)

    def _forward(self, batch, pooling: str = "mean", normalize: bool = False):
        bare = self._bare()
        out = self.model(**batch, **({} if bare else {"output_hidden_states": True}))
        states = (out["last_hidden_state"] if bare else out["hidden_states"][-1]).float()  # (N, B, T, D)
        if pooling == "mean":
            mask = batch["attention_mask"].to(states.dtype)[None, :, :, None]  # (1, B, T, 1)
            members = (states * mask).sum(2) / mask.sum(2).clamp_min(1)  # (N, B, D)
        elif pooling == "cls":
            members = states[:, :, 0]  # (N, B, D)
        else:
            members = states  # (N, B, T, D)
        if normalize:
            members = torch.nn.functional.normalize(members, dim=-1)
        out = {"per_member_embeddings": members}
        if self.combine != Combine.NONE:
            out["embedding"] = self._combine(members, normalize)  # (B, D) or (B, T, D)
        return out

    def _combine(self, members: torch.Tensor, normalize: bool) -> torch.Tensor:
        if self.combine == Combine.WEIGHTED:
            shape = (-1,) + (1,) * (members.dim() - 1)
            ensemble = (self.weights.to(members.device).view(shape) * members).sum(0)
        elif self.combine == Combine.MEDIAN:
            ensemble = member_median(members)
        else:
            ensemble = members.mean(0)
        return torch.nn.functional.normalize(ensemble, dim=-1) if normalize else ensemble

    def postprocess(self, outputs: dict[str, Any], pooling: str = "mean"):
        members = outputs["per_member_embeddings"]
        length = outputs["features"]["input_ids"].shape[-1]  # token states are padded to the batch's bucket
        if pooling == "none":
            members = members[:, :length]
        result = {"members": members.tolist()}
        if "embedding" in outputs:
            embedding = outputs["embedding"]
            result = {"embedding": (embedding[:length] if pooling == "none" else embedding).tolist(), **result}
        return result
