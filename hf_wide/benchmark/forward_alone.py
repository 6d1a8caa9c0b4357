"""The serve load test's forward-alone table (:mod:`hf_wide.benchmark.serve`): one forward of the wide model, padded,
padding-free (:mod:`hf_wide.packing`) and, as the text-classification pipeline runs it, padding-free with the last
layer at the texts' first tokens, against the members one after another, in this process with one thread."""

import torch
import transformers

from ..model import WideModel
from ..packing import packed
from ..pipelines.packing import enable_first_tokens, enable_packing
from .methods import time_interleaved


def forward_alone(paths: list[str], texts: list[str], sizes: tuple[int, ...], seconds: float = 2.0) -> list[dict]:
    """For each batch size, milliseconds of one forward of the wide model (padded, padding-free, and padding-free
    with the last layer at the first tokens) and of the members one after another on the first ``size`` texts as
    one padded batch, with one thread (a replica's, with Ray's default of one CPU)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths[0])
    wide = WideModel.from_pretrained(paths)
    members = [transformers.AutoModelForSequenceClassification.from_pretrained(p).eval() for p in paths]
    padding_free = enable_packing(wide) is None
    first_tokens = padding_free and enable_first_tokens(wide) is None
    threads, rows = torch.get_num_threads(), []
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for size in sizes:
                batch = tokenizer(texts[:size], padding=True, truncation=True, return_tensors="pt")
                runs = {"wide": lambda: wide(**batch), "members": lambda: [m(**batch) for m in members]}
                if padding_free:
                    runs["wide_padding_free"] = lambda: _padding_free(wide, batch)
                if first_tokens:
                    runs["wide_first_tokens"] = lambda: _padding_free(wide, batch, first_tokens=True)
                for run_once in runs.values():
                    run_once()
                times, _ = time_interleaved(runs, seconds)
                wide_ms, members_ms = times["wide"][0], times["members"][0]
                free_ms = times["wide_padding_free"][0] if padding_free else None
                first_ms = times["wide_first_tokens"][0] if first_tokens else None
                rows.append({"batch": list(batch["input_ids"].shape), "tokens": int(batch["attention_mask"].sum()),
                             "wide_ms": wide_ms, "wide_padding_free_ms": free_ms, "wide_first_tokens_ms": first_ms,
                             "members_ms": members_ms, "members_over_wide": members_ms / wide_ms})
    finally:
        torch.set_num_threads(threads)
    return rows


def _padding_free(wide, batch: dict, first_tokens: bool = False):
    with packed(batch["attention_mask"], first_tokens=first_tokens):
        return wide(**batch)
