"""What the Gradio Space (``spaces_app/``) shows for one drawing or text: :class:`DemoEnsemble`."""

from __future__ import annotations

from pathlib import Path

from .digits import (
    IMAGE_SIZE,
    calibration_rows,
    demo_member_paths,
    evaluate,
    load_digits_split,
    time_wide_vs_sequential,
    to_pixel_values,
)
from .drawings import to_digit_image


# What the demo cannot show as votes for one label: a regressor's values, a multi-label model's sets of labels.
NOT_SINGLE_LABEL = {"regression": "a regressor", "multi_label_classification": "a multi-label classifier"}


def task_for_config(config) -> str:
    """The pipeline task of a single-label classifier's config: ``image-classification`` or
    ``text-classification``. Raises ValueError for any other model, regressors and multi-label classifiers too."""
    problem = getattr(config, "problem_type", None)
    if problem in NOT_SINGLE_LABEL:
        raise ValueError(f"The demo shows single-label classifiers; this model is {NOT_SINGLE_LABEL[problem]} "
                         f"(problem_type={problem!r}).")
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if architecture.endswith("ForImageClassification"):
            return "image-classification"
        if architecture.endswith("ForSequenceClassification"):
            return "text-classification"
    raise ValueError(f"The demo shows image or text classifiers; this model is {architectures or 'unknown'}.")


def is_digit_model(config) -> bool:
    """True for models that read digits as the embedded default does: one channel, 8x8."""
    return getattr(config, "num_channels", None) == 1 and getattr(config, "image_size", None) == IMAGE_SIZE


class DemoEnsemble:
    """A classification pipeline with what the Space shows beside its answer.

    ``DemoEnsemble.load(model_id)`` loads a fused repo (or comma-separated member ids) and falls back to the
    embedded default, with a note saying why, when it cannot. ``classify(item)`` returns the pipeline's
    result plus ``summary`` (the uncertainty in plain words), ``timing`` (one wide forward against the
    members one after another) and ``seen`` (the digit as the members see it, for digit models)."""

    def __init__(self, pipe, source: str, note: str = ""):
        self.pipe, self.source, self.note = pipe, source, note
        self.task = pipe.task
        self.digits = self.task == "image-classification" and is_digit_model(pipe.model.config)
        self.members = [pipe.model.member(i, share=True).eval() for i in range(pipe.model.num_members)]

    @property
    def num_members(self) -> int:
        return self.pipe.model.num_members

    @classmethod
    def load(cls, model_id: str | None = None, members_dir: str | Path | None = None) -> DemoEnsemble:
        """``model_id``: a fused Hub repo, or member ids separated by commas; None: the embedded default
        (the members in ``members_dir``, or the cached eight, made once)."""
        from transformers import AutoConfig

        from ..pipelines import pipeline

        note = ""
        ids = [part.strip() for part in (model_id or "").split(",") if part.strip()]  # blank (" ", ","): unset
        if ids:
            try:
                task = task_for_config(AutoConfig.from_pretrained(ids[0]))
                return cls(pipeline(task, model=ids[0] if len(ids) == 1 else ids), source=", ".join(ids))
            except Exception as exc:  # unreachable Hub, unknown repo, unsupported model: say so, go on
                # the first line whole: cut short, the advice it ends with ("Pass allow_label_mismatch=True") is lost
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                note = f"Could not use {', '.join(ids)} ({reason}); showing the embedded default instead."
        paths = demo_member_paths(members_dir, None if members_dir else 8)
        return cls(pipeline("image-classification", model=[str(p) for p in paths]),
                   source="the embedded default (digit classifiers trained here)", note=note)

    def held_out_report(self) -> list[tuple[str, dict]] | None:
        """Accuracy, NLL and ECE on the held-out digits of every member, the best, the mean member and the
        ensemble (digit models only)."""
        if not self.digits:
            return None
        _, (x_test, y_test) = load_digits_split()
        report = evaluate(self.pipe.model, to_pixel_values(x_test), y_test)
        return [(f"member {i}", r) for i, r in enumerate(report["members"])] + calibration_rows(report)

    def classify(self, item, top_k: int = 3) -> dict:
        """``item``: an image (PIL, array, path) or a text, by the task. Raises ValueError on a blank or
        empty input."""
        seen = to_digit_image(item) if self.digits else None
        item = seen if seen is not None else item
        result = self.pipe(item, top_k=top_k)
        inputs = self.pipe.preprocess(item)  # the same tensors the pipeline ran: (1, ...)
        wide_s, sequential_s = time_wide_vs_sequential(self.pipe.model, inputs, self.members, repeats=15)
        result["timing"] = {"wide_ms": wide_s * 1e3, "sequential_ms": sequential_s * 1e3}
        result["summary"] = describe_uncertainty(result)
        result["seen"] = seen
        return result


def describe_uncertainty(result: dict) -> str:
    """The ensemble's answer and how far to trust it, in words a non-specialist reads."""
    votes = [m["label"] for m in result["members"]]
    n, label = len(votes), result["label"]
    agreeing = votes.count(label)
    others = sorted({v for v in votes if v != label}, key=lambda v: (-votes.count(v), v))
    u = result["uncertainty"]
    if agreeing == n:
        head = f"All {n} members say {label}."
    else:
        rest = ", ".join(f"{v} ({votes.count(v)})" for v in others)
        head = f"{agreeing} of {n} members say {label}; the others say {rest}."
    # Thresholds in nats: on the held-out digits about one input in ten is above each.
    if u["mutual_information"] > 0.2:
        verdict = ("The members disagree: this input is unusual, unlike the examples they learned from. "
                   "Treat the answer with caution.")
    elif u["predictive_entropy"] > 0.5:
        verdict = ("None of the members is sure, and they are unsure alike: the input looks like more than "
                   "one class to all of them.")
    else:
        verdict = "The members agree and are confident: this looks like what they were trained on."
    numbers = (f"Total uncertainty (entropy): {u['predictive_entropy']:.2f} nats, of which disagreement "
               f"between members (mutual information): {u['mutual_information']:.2f}; "
               f"agreement {agreeing}/{n}.")
    return f"{head} {verdict}\n\n{numbers}"
