"""The embedded default: digit classifiers trained together, saved as ordinary checkpoints."""

import re

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw

from hf_wide import WideModel
from hf_wide.demo import (
    DemoEnsemble,
    calibration_rows,
    describe_uncertainty,
    digit_drawing,
    evaluate,
    example_digits,
    load_digits_split,
    make_demo_members,
    run_demo,
    to_digit_image,
    to_pixel_values,
)


@pytest.fixture(scope="module")
def demo_members(tmp_path_factory):
    return make_demo_members(tmp_path_factory.mktemp("demo"), num_members=2, epochs=2, verbose=False)


def test_members_are_ordinary_checkpoints_that_learned(demo_members):
    _, (x_test, y_test) = load_digits_split()
    pixels = to_pixel_values(x_test)
    processor = transformers.AutoImageProcessor.from_pretrained(demo_members[0])
    images = [Image.fromarray(x.numpy(), mode="L") for x in x_test[:4]]
    from_processor = processor(images, return_tensors="pt")["pixel_values"]
    assert torch.allclose(from_processor, pixels[:4], atol=1e-6)
    model = transformers.AutoModelForImageClassification.from_pretrained(demo_members[0]).eval()
    with torch.no_grad():
        accuracy = (model(pixel_values=pixels).logits.argmax(-1) == y_test).float().mean()
    assert accuracy > 0.3  # 2 epochs: far better than chance (0.1), not yet good


def test_members_trained_independently(demo_members):
    a, b = (transformers.AutoModelForImageClassification.from_pretrained(p) for p in demo_members)
    assert not torch.equal(a.vit.layernorm.weight, b.vit.layernorm.weight)


def test_evaluate_reports_members_and_ensemble(demo_members):
    wide = WideModel.from_pretrained([str(p) for p in demo_members])
    _, (x_test, y_test) = load_digits_split()
    report = evaluate(wide, to_pixel_values(x_test), y_test)
    assert len(report["members"]) == 2
    assert 0 <= report["ensemble"]["ece"] <= 1 and report["ensemble"]["nll"] > 0


# ---------------------------------------------------------------- calibration, drawings, what the Space shows
def test_calibration_rows_best_member_and_ensemble(demo_members):
    wide = WideModel.from_pretrained([str(p) for p in demo_members])
    _, (x_test, y_test) = load_digits_split()
    report = evaluate(wide, to_pixel_values(x_test), y_test)
    (best_name, best), (_, mean), (name, ensemble) = calibration_rows(report)
    assert name == "ensemble" and best["nll"] == min(m["nll"] for m in report["members"])
    assert best_name == f"best member ({[m['nll'] for m in report['members']].index(best['nll'])})"
    # -log is convex: the mean of the probabilities never has a higher NLL than the mean member.
    assert ensemble["nll"] <= mean["nll"] + 1e-6
    assert 0 < ensemble["confidence"] <= 1


def test_run_demo_prints_the_calibration_report(demo_members, capsys):
    run_demo(members_dir=demo_members[0].parent, num_members=2)
    out = capsys.readouterr().out
    for text in ("best member (", "mean member", "ensemble", "NLL: ensemble", "members in sequence"):
        assert text in out
    assert re.search(r"the ensemble is (under|over)-confident: mean confidence", out)


def test_run_demo_says_how_many_of_the_members_made_it_fuses(demo_members, capsys):
    # "Members: 2 ViTs trained together ...", then 1 member fused
    run_demo(members_dir=demo_members[0].parent, num_members=1)
    out = capsys.readouterr().out
    assert out.startswith("Members: 1 of the 2 ViTs trained together") and "1 members fused into one model" in out


def _stroke(points, size=(300, 400), width=12, ink="black", ground="white", mode="RGB"):
    image = Image.new(mode, size, ground)
    ImageDraw.Draw(image).line([(x * size[0], y * size[1]) for x, y in points], fill=ink, width=width)
    return image


def test_to_digit_image_makes_a_drawing_look_like_the_training_data():
    one = _stroke([(0.5, 0.2), (0.5, 0.8)])  # a thin dark "1" off to one side of a tall light canvas
    digit = np.asarray(to_digit_image(one))
    assert digit.shape == (8, 8) and digit.dtype == np.uint8 and digit.max() == 255
    assert digit[:, 3:5].min() > 100 and digit[:, :2].max() == 0 and digit[:, 6:].max() == 0  # centred, full height
    # Bright ink on black (an MNIST-style photo) and transparent strokes give the same digit.
    assert np.array_equal(np.asarray(to_digit_image(_stroke([(0.5, 0.2), (0.5, 0.8)], ink="white", ground="black"))),
                          digit)
    transparent = _stroke([(0.5, 0.2), (0.5, 0.8)], ink=(0, 0, 0, 255), ground=(0, 0, 0, 0), mode="RGBA")
    assert np.array_equal(np.asarray(to_digit_image(transparent)), digit)
    with pytest.raises(ValueError, match="blank"):
        to_digit_image(Image.new("RGB", (100, 100), "white"))


def test_a_dataset_digit_drawn_and_normalised_comes_back_close():
    _, (x_test, _) = load_digits_split()
    errors = [np.abs(np.asarray(to_digit_image(digit_drawing(x))).astype(float) - x.numpy()).mean() for x in x_test[:100]]
    assert np.mean(errors) < 30  # of 255: the crop and the rescaling move a little ink, not the digit


def test_example_digits_are_clear_and_ambiguous(demo_members, tmp_path):
    wide = WideModel.from_pretrained([str(p) for p in demo_members])
    examples = example_digits(wide, tmp_path, clear=3, ambiguous=2)
    captions = [caption for _, caption in examples]
    assert len(examples) == 5 and all(path.exists() for path, _ in examples)
    assert all(c.startswith("a clear ") for c in captions[:3]) and len(set(captions[:3])) == 3
    assert all(c.startswith("ambiguous (written as ") for c in captions[3:])


def _result(votes, mutual_information, predictive_entropy):
    return {"label": max(set(votes), key=votes.count), "members": [{"label": v, "score": 0.9} for v in votes],
            "uncertainty": {"mutual_information": mutual_information, "predictive_entropy": predictive_entropy}}


@pytest.mark.parametrize("votes, mi, entropy, expected", [
    (["3"] * 4, 0.0, 0.05, ["All 4 members say 3.", "agree and are confident"]),
    (["3", "3", "3", "8"], 0.4, 0.9, ["3 of 4 members say 3; the others say 8 (1).", "members disagree", "unusual"]),
    (["5", "5", "5", "5"], 0.05, 1.2, ["All 4 members say 5.", "None of the members is sure"]),
])
def test_describe_uncertainty_in_plain_words(votes, mi, entropy, expected):
    text = describe_uncertainty(_result(votes, mi, entropy))
    assert all(e in text for e in expected), text
    assert f"mutual information): {mi:.2f}" in text


def test_demo_ensemble_classifies_a_drawing_and_times_it(demo_members):
    ensemble = DemoEnsemble.load(None, demo_members[0].parent)
    assert ensemble.digits and ensemble.num_members == 2 and not ensemble.note
    result = ensemble.classify(_stroke([(0.5, 0.2), (0.5, 0.8)], width=30))
    assert result["seen"].size == (8, 8) and len(result["top_k"]) == 3
    assert result["timing"]["wide_ms"] > 0 and result["timing"]["sequential_ms"] > 0
    assert "members say" in result["summary"]
    rows = ensemble.held_out_report()
    assert [name for name, _ in rows][-1] == "ensemble" and len(rows) == 2 + 3
