"""The embedded default: a real deep ensemble of digit classifiers, made here from data sklearn ships.

``make_demo_members`` trains N tiny ViTs (transformers' own class) on scikit-learn's 8x8 handwritten
digits, each from its own seed on its own bootstrap sample, and saves each as an ordinary transformers
checkpoint folder with its image processor. The N members train *together*, as one wide model: wide
parameters take gradients, so one backward pass updates every member.

``run_demo`` fuses the members with ``WideModel.from_pretrained(paths)`` and prints what the ensemble
does: per-member and ensemble accuracy, calibration of the best member against the ensemble, the inputs
the members disagree on, and wide-vs-sequential timing.

``DemoEnsemble`` is what the Gradio Space (``spaces_app/``) shows for one drawing or text: the ensemble's
label, every member's vote, the uncertainty in plain words and the time of one wide forward against the
members run one after another. ``to_digit_image`` turns a drawing (dark ink on white, any size) into a
digit as the training data shows them (bright ink on black, 8x8, centred, scaled to the full height).

Modules: ``digits`` (data, members, evaluation, ``run_demo``), ``drawings`` (drawings in, examples out),
``space`` (``DemoEnsemble``).
"""

from .digits import (
    DEMO_VERSION,
    IMAGE_SIZE,
    calibration_rows,
    default_members_dir,
    demo_member_paths,
    evaluate,
    image_processor,
    load_digits_split,
    make_demo_members,
    member_config,
    run_demo,
    time_wide_vs_sequential,
    to_pixel_values,
)
from .drawings import digit_drawing, example_digits, to_digit_image
from .space import DemoEnsemble, describe_uncertainty, is_digit_model, task_for_config

__all__ = [
    "DEMO_VERSION", "IMAGE_SIZE", "DemoEnsemble", "calibration_rows", "default_members_dir", "demo_member_paths",
    "describe_uncertainty", "digit_drawing", "evaluate", "example_digits", "image_processor", "is_digit_model",
    "load_digits_split", "make_demo_members", "member_config", "run_demo", "task_for_config", "time_wide_vs_sequential",
    "to_digit_image", "to_pixel_values",
]
