"""The base of hf-wide's pipelines, in the shape of transformers' ``Pipeline``.

``_sanitize_parameters`` splits call options into three dicts; ``preprocess`` turns one input into
tensors on the CPU; ``_forward`` runs one wide forward for a whole batch on the model's device (all
members at once) and combines the members there; ``postprocess`` turns one item's results into plain
Python. The base class owns batching (inputs sorted by length, padded to length buckets), progress bars,
``inference_mode`` and device moves.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from huggingface_hub.utils import tqdm
from torch.nn.utils.rnn import pad_sequence

from ..model import WideModel
from ..packing import packed, worth_packing
from .combine import Combine, check_weights, label_permutations
from .heads import head_refusal
from .options import positive_temperature, whole_number
from .packing import enable_first_tokens, enable_packing

PROGRESS_MIN_ITEMS = 256  # show a progress bar from this many inputs on


class WidePipeline:
    """One task on a :class:`WideModel`: every batch is one forward of all N members."""

    task: str = ""
    # The models this task runs: the name of transformers' mapping of them (in transformers.models.auto.
    # modeling_auto, as its own pipeline of the task checks), and what their head is called in an error; None: any.
    heads: tuple[str, str] | None = None

    def __init__(
        self,
        model: WideModel,
        *,
        tokenizer=None,
        image_processor=None,
        device: str | int | torch.device | None = None,
        batch_size: int = 8,
        combine: str | Combine = Combine.MEAN,
        weights: Sequence[float] | None = None,
        temperature: float = 1.0,
        compile: bool | dict = False,
        buckets: Sequence[int] | str | None = "auto",
        padding_free: bool = True,
        **kwargs,
    ):
        if not isinstance(model, WideModel):
            raise TypeError(f"A wide pipeline runs a WideModel, got {type(model).__name__}.")
        if any(isinstance(p, (str, os.PathLike)) for p in (tokenizer, image_processor)):
            raise TypeError("A pipeline class takes a loaded tokenizer or image processor; hf_wide.pipeline() loads "
                            "one by its name.")
        whole_number("batch_size", batch_size)
        refusal = head_refusal(model, self.task, self.heads)
        if refusal is not None:
            raise ValueError(refusal)
        self.model = model.eval()
        if device is not None and device != -1:  # -1: where the model is, as transformers' pipelines read it
            self.model.to(_device(device))
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.batch_size = batch_size
        self.combine = Combine.parse(combine)
        self.weights = check_weights(weights, model.num_members)
        if self.combine == Combine.WEIGHTED and self.weights is None:
            raise ValueError("combine='weighted' needs weights=[one per member].")
        if self.weights is not None and self.combine != Combine.WEIGHTED:
            raise ValueError(f"weights= are read by combine='weighted' only, and combine is {self.combine.value!r}: "
                             "pass combine='weighted' to weigh the members.")
        self.temperature = positive_temperature(temperature)
        # Every padded position costs compute, so batches are padded to their longest input. The wide model
        # compiles with dynamic shapes (one graph for every length), so only static-shape compiles (dynamic=False,
        # or CUDA graphs: mode="reduce-overhead"/"max-autotune") are given power-of-two buckets, which bound the
        # number of graphs they build.
        options = dict(compile) if isinstance(compile, dict) else {}
        static = options.get("dynamic", True) is False or options.get("mode") in ("reduce-overhead", "max-autotune")
        self.buckets = ("pow2" if compile and static else None) if buckets == "auto" else buckets
        if compile:
            self.model.compile(**options)
        # Batches with much padding run the encoder on their real tokens only, where the model allows it (checked
        # on a probe batch: hf_wide.pipelines.packing); not in a compiled model, whose graphs would be one per K.
        self.padding_free = bool(padding_free and not compile and self.packs_tokens() and enable_packing(model) is None)
        # Where the answers read each input's first token only (a sequence classifier's head), the encoder's last
        # layer runs past its keys and values on those tokens only (checked on a probe batch as well).
        self.first_tokens = bool(self.padding_free and self.reads_first_tokens() and enable_first_tokens(model) is None)
        self._label_order = None
        self._defaults = self._sanitize_parameters(**kwargs)

    # ---------------------------------------------------------------- the four steps
    def _sanitize_parameters(self, **kwargs) -> tuple[dict, dict, dict]:
        """Split call options into (preprocess, _forward, postprocess) parameters."""
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unknown options: {', '.join(kwargs)}")
        return {}, {}, {}

    def preprocess(self, item: Any, **params) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def preprocess_many(self, items: list, **params) -> list[dict[str, torch.Tensor]]:
        """All inputs of one call; override where the work batches (a fast tokenizer, say)."""
        return [self.preprocess(item, **params) for item in items]

    def _forward(self, batch: dict[str, torch.Tensor], **params) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def postprocess(self, outputs: dict[str, Any], **params) -> Any:
        raise NotImplementedError

    # ---------------------------------------------------------------- running
    def __call__(self, inputs, batch_size: int | None = None, **kwargs):
        single = not isinstance(inputs, (list, tuple))
        items = [inputs] if single else list(inputs)
        if not items:
            raise ValueError(f"{self.task} got an empty list of inputs.")
        pre, fwd, post = self.call_options(kwargs)
        features = self.preprocess_many(items, **pre)
        results: list[Any] = [None] * len(items)
        size = self.batch_size if batch_size is None else whole_number("batch_size", batch_size)
        chunks = batches(self, features, size)
        for chunk in tqdm(chunks, desc=self.task, unit="batch", disable=len(items) < PROGRESS_MIN_ITEMS):
            outputs = self.forward_batch([features[i] for i in chunk], fwd)
            for j, i in enumerate(chunk):
                results[i] = self.postprocess(_item(outputs, j, features[i]), **post)
        return results[0] if single else results

    def call_options(self, kwargs: dict) -> tuple[dict, dict, dict]:
        """The (preprocess, _forward, postprocess) parameters of a call: the pipeline's own, updated by ``kwargs``."""
        pre, fwd, post = self._defaults
        if kwargs:
            extra = self._sanitize_parameters(**kwargs)
            pre, fwd, post = {**pre, **extra[0]}, {**fwd, **extra[1]}, {**post, **extra[2]}
        return pre, fwd, post

    def forward_batch(self, features: list[dict[str, torch.Tensor]], fwd: dict) -> dict[str, torch.Tensor]:
        """One forward of these items' features, collated, on the model's device; its outputs back on the CPU."""
        batch = self.collate(features)
        mask = batch.get("attention_mask")
        packing = self.padding_free and mask is not None and (self.first_tokens or worth_packing(mask))
        with torch.inference_mode(), (packed(mask, self.device, self.first_tokens) if packing
                                      else contextlib.nullcontext()):
            outputs = self._forward({k: v.to(self.device) for k, v in batch.items()}, **fwd)
        return {k: v.cpu() for k, v in outputs.items()}  # one transfer per batch, then plain Python

    def packs_tokens(self) -> bool:
        """Whether this task's answers read the real tokens' outputs only, so that its batches may run padding-free
        (:mod:`hf_wide.packing`): no, unless a task says so."""
        return False

    def reads_first_tokens(self) -> bool:
        """Whether this task's answers read nothing of a padding-free forward but what the model computes from
        each input's first token (a sequence classifier's head), so that an encoder's last layer may run on those
        alone (:func:`hf_wide.pipelines.packing.enable_first_tokens` checks it on the model): no, unless a task
        says so."""
        return False

    def batch_keys(self, features: list[dict[str, torch.Tensor]]) -> list:
        """For each input, what the inputs of one batch must share for each to get the answer it gets alone (beyond
        the call's options: :meth:`batch_invariant`): nothing, unless a task says otherwise."""
        return [None] * len(features)

    def batch_invariant(self, fwd: dict) -> bool:
        """Whether an input's answer with these ``_forward`` options is the same in a batch with others as alone
        (so that a server may run many callers' inputs in one forward): yes, unless a task says otherwise."""
        return True

    def collate(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack one-item features into a batch; token inputs are right-padded to a length bucket."""
        keys = features[0].keys()
        if "input_ids" not in keys:
            return {k: torch.cat([f[k] for f in features]) for k in keys}
        longest = max(f["input_ids"].shape[-1] for f in features)
        length = self.bucket(longest)
        pad_id = self._pad_id(any(f["input_ids"].shape[-1] != length for f in features))
        batch = {}
        for key in keys:
            fill = pad_id if key == "input_ids" else 0
            rows = pad_sequence([f[key][0] for f in features], batch_first=True, padding_value=fill)  # (B, longest)
            batch[key] = rows if length == longest else torch.nn.functional.pad(rows, (0, length - longest), value=fill)
        return batch

    def _pad_id(self, needed: bool) -> int:
        """The id to pad ``input_ids`` with: the model's config's, which its code takes for padding (a decoder's
        sequence classifier reads the last token that is not that id: padded with the tokenizer's 0 beside a config's
        1, a short text was scored at a padding position), else the tokenizer's. Neither, and texts to pad:
        refused, as transformers refuses to batch them."""
        for source in (getattr(self.model, "config", None), self.tokenizer):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return pad
        if needed:
            raise ValueError("Neither the tokenizer nor the model's config has a pad token, so texts of different "
                             "lengths cannot be batched: pass batch_size=1, or set tokenizer.pad_token (as "
                             "tokenizer.pad_token = tokenizer.eos_token) and the members' config.pad_token_id.")
        return 0
    def bucket(self, length: int) -> int:
        """The padded length: the next power of two (at least 8), a user bucket, or the length itself."""
        limit = _max_length(self.tokenizer, self.model)
        if self.buckets == "pow2":
            padded = max(8, 2 ** math.ceil(math.log2(length)))
        elif self.buckets:
            padded = next((b for b in sorted(self.buckets) if b >= length), length)
        else:
            padded = length
        return min(padded, max(limit, length))

    # ---------------------------------------------------------------- shared helpers
    def member_id2labels(self) -> list[dict[int, str]]:
        configs = self.model.member_configs or [self.model.config] * self.model.num_members
        return [{int(k): v for k, v in c.id2label.items()} for c in configs]

    def label_order(self):
        """(member 0's labels in order, per-member permutations onto them or None). Computed once: it is
        read for every item, and the members' labels do not change."""
        if self._label_order is None:
            id2labels = self.member_id2labels()
            self._label_order = [id2labels[0][i] for i in range(len(id2labels[0]))], label_permutations(id2labels)
        return self._label_order

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(task={self.task!r}, members={self.model.num_members}, "
                f"combine={self.combine.value!r}, device={self.device})")


def _device(device: str | int | torch.device) -> torch.device:
    """``device=`` as transformers' pipelines read it: a negative number is the CPU, another number that index of the
    accelerator (CUDA's, if torch knows none)."""
    if isinstance(device, bool) or not isinstance(device, int):
        return torch.device(device)
    if device < 0:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type if accelerator is not None else "cuda", device)


def batches(pipe: WidePipeline, features: list[dict[str, torch.Tensor]], size: int) -> list[list[int]]:
    """Indices of ``features`` in batches of at most ``size``: similar lengths together (less padding, and few
    distinct shapes for a compiled model), and inputs of one :meth:`WidePipeline.batch_keys` only."""
    order = sorted(range(len(features)), key=lambda i: -_length(features[i]))
    keys = pipe.batch_keys(features)
    chunks = []
    for key in dict.fromkeys(keys[i] for i in order):
        same = [i for i in order if keys[i] == key]
        chunks += [same[k : k + size] for k in range(0, len(same), size)]
    return chunks


def _length(features: dict[str, torch.Tensor]) -> int:
    ids = features.get("input_ids")
    return 0 if ids is None else ids.shape[-1]


def _max_length(tokenizer, model: WideModel) -> int:
    """The most tokens an input may have: the tokenizer's ``model_max_length``, and the members' positions."""
    limit = getattr(tokenizer, "model_max_length", None)
    if model not in _POSITIONS:
        _POSITIONS[model] = _positions(model)
    candidates = [v for v in (limit, _POSITIONS[model]) if isinstance(v, int) and 0 < v < 1_000_000]
    return min(candidates) if candidates else 1_000_000


_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # WideModel -> _positions(model)


def _positions(model: WideModel) -> int | None:
    """How many positions the members take: ``max_position_embeddings``, or fewer where a position table counts from
    past its padding row (RoBERTa's and MPNet's positions start at ``padding_idx + 1``: a table of 514 rows takes 512
    tokens, and a longer input indexed past it)."""
    config = model.config
    positions = getattr(config, "max_position_embeddings", None) if config is not None else None
    for module in model.model.modules():
        table = getattr(module, "position_embeddings", None)
        pad, rows = getattr(table, "padding_idx", None), getattr(table, "num_embeddings", None)
        if isinstance(pad, int) and isinstance(rows, int) and 0 <= pad < rows:
            offset_limit = rows - pad - 1
            return offset_limit if not isinstance(positions, int) else min(positions, offset_limit)
    return positions


def _item(outputs: dict[str, torch.Tensor], j: int, features: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Row j of a batch's outputs; ``per_member_*`` tensors have the member dim first, (N, B, ...)."""
    item = {key: value[:, j] if key.startswith("per_member_") else value[j] for key, value in outputs.items()}
    item["features"] = features
    return item
