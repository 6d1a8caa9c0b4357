"""The model card (README.md) of a fused repo, generated from its members.

Metadata follows the Hub's conventions so the repo is found and linked: ``library_name: hf-wide``, tags
``hf-wide`` and ``ensemble``, ``base_model`` listing the members downloaded from the Hub (which makes the Hub show the
fused repo in each member's model tree) and the ``pipeline_tag`` of the members' head.
"""

from __future__ import annotations

from huggingface_hub import ModelCardData, constants

# Class name suffix -> pipeline tag; the first match wins, so specific heads come before the bare model.
PIPELINE_TAGS = [
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForMaskedLM", "fill-mask"),
    ("ForCausalLM", "text-generation"),
    ("LMHeadModel", "text-generation"),
    ("ForImageClassification", "image-classification"),
    ("Model", "feature-extraction"),
]


def pipeline_tag(model_class: str) -> str | None:
    return next((tag for suffix, tag in PIPELINE_TAGS if model_class.endswith(suffix)), None)


def _member_row(i: int, model_id: str, revision: str | None, labels: list[str], subfolder: str | None = None) -> str:
    """A row of the members table; members downloaded from the Hub (those with a commit sha) are linked, to their
    subfolder where they were in one."""
    inside = f"/{subfolder.strip('/')}" if subfolder else ""
    if revision:
        name = f"[{model_id}]({constants.ENDPOINT}/{model_id})" + (f" `{inside[1:]}`" if inside else "")
        rev = f"[`{revision[:7]}`]({constants.ENDPOINT}/{model_id}/tree/{revision}{inside})"
    else:
        name, rev = f"`{model_id}{inside}` (local)", "-"
    return f"| {i} | {name} | {rev} | {', '.join(labels) if labels else '-'} |"


def model_card(wide, repo_id: str | None = None) -> str:
    """README.md for ``wide`` saved as a fused repo (``repo_id``: where it will live, for the usage snippet)."""
    model_class = wide.plan.model_class
    hub_members = list(dict.fromkeys(m for m, rev in zip(wide.member_ids, wide.member_revisions) if rev))
    data = ModelCardData(
        library_name="hf-wide",
        tags=["hf-wide", "ensemble"],
        base_model=hub_members or None,
        pipeline_tag=pipeline_tag(model_class),
    )
    configs = wide.member_configs or [None] * wide.num_members
    subfolders = wide.member_subfolders or [None] * wide.num_members
    rows = [
        _member_row(i, m, rev, [str(v) for _, v in sorted((getattr(c, "id2label", None) or {}).items())], sub)
        for i, (m, rev, c, sub) in enumerate(zip(wide.member_ids, wide.member_revisions, configs, subfolders))
    ]
    title = repo_id.split("/")[-1] if repo_id else f"{model_class} x {wide.num_members}"
    where = repo_id or "path/to/this/folder"
    return f"""---
{data.to_yaml()}
---

# {title}

{wide.num_members} checkpoints of `{model_class}` fused into one wide model with hf-wide: one forward pass
computes every member, and member i's output equals checkpoint i run alone.

## Members

| # | checkpoint | revision | labels |
|---|---|---|---|
{chr(10).join(rows)}

## How to load

```python
from hf_wide import WideModel

wide = WideModel.from_pretrained("{where}")
out = wide(**inputs)    # every output gains a leading member dim: (N, B, ...)
member = wide.member(0) # checkpoint 0 again, an ordinary transformers model
```

## Plan

{wide.plan.summary()}. Tensors identical in every member are stored once.
"""
