"""The embedded default: digit classifiers trained together, saved as ordinary checkpoints."""

import pytest
import torch
import transformers
from PIL import Image

from hf_wide import WideModel
from hf_wide.demo import evaluate, load_digits_split, make_demo_members, to_pixel_values


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
