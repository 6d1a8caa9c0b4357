"""Fuse LoRA adapters of one base into one wide model: a deep ensemble of adapters at nearly the cost of the base.

    python examples/lora_ensemble.py user/lora-seed0 user/lora-seed1 ./lora-seed2 --text "a great film"
    python examples/lora_ensemble.py          # fine-tunes 4 adapters of the embedded default's first digit classifier

Adapters (PEFT folders or Hub repos: ``adapter_config.json`` and ``adapter_model.safetensors``) name their base;
``WideModel.from_pretrained`` loads it once, and every adapted linear runs as one matmul of the base's weight over all
members' rows plus each member's low-rank update. With no adapters given, the example fine-tunes its own: rank-4 LoRA
on the attention's query and value projections of one embedded digit classifier, the classifier trained whole, each
adapter from its own seed on its own bootstrap sample of the digits, saved as an ordinary PEFT adapter folder; then
it fuses them and compares the members with their ensemble.
"""

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_wide import WideModel, pipeline
from hf_wide.demo import (
    demo_member_paths,
    evaluate,
    is_digit_model,
    load_digits_split,
    task_for_config,
    to_digit_image,
    to_pixel_values,
)


def train_adapter(base: Path, folder: Path, seed: int, epochs: int = 3, batch_size: int = 64) -> Path:
    """One LoRA adapter of the digit classifier at ``base``, fine-tuned on a bootstrap sample drawn from ``seed``."""
    import peft
    from transformers import ViTForImageClassification

    torch.manual_seed(seed)
    model = peft.get_peft_model(ViTForImageClassification.from_pretrained(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"]))
    (images, labels), _ = load_digits_split()
    pixels = to_pixel_values(images)  # (n, 1, 8, 8)
    sample = torch.randint(0, len(labels), (len(labels),))  # this adapter's own bootstrap sample
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for _ in range(epochs):
        for rows in sample[torch.randperm(len(sample))].split(batch_size):
            loss = F.cross_entropy(model(pixel_values=pixels[rows]).logits, labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.save_pretrained(folder)  # adapter_config.json names the base: base_model_name_or_path
    return folder


def _item(parser, args, task: str, config):
    """What the adapters' ensemble classifies: the text, the image, or, for digit classifiers, a held-out digit."""
    if task != "image-classification":
        return args.text
    if args.image:
        return to_digit_image(args.image) if is_digit_model(config) else args.image
    if not is_digit_model(config):  # no default image fits another image classifier
        parser.error("adapters of an image classifier need --image")
    from PIL import Image

    _, (images, labels) = load_digits_split()
    print(f"A held-out digit, written as {labels[0].item()}:")
    return Image.fromarray(images[0].numpy())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="*", help="adapter repo ids or folders (default: fine-tune 4 of a digit "
                                                    "classifier)")
    parser.add_argument("--members", type=int, default=4, help="how many adapters to fine-tune (default 4)")
    parser.add_argument("--base", help="the digit classifier to adapt (default: the embedded default's first)")
    parser.add_argument("--out", help="where to save the fine-tuned adapters (default: a temporary folder)")
    parser.add_argument("--text", default="a great film", help="the text to classify (adapters of a text classifier)")
    parser.add_argument("--image", help="the image to classify (adapters of an image classifier; default for digit "
                                        "classifiers: a held-out digit)")
    args = parser.parse_args(argv)

    if args.adapters:
        # adapters of any base, classified by their ensemble (with the base's tokenizer where they ship none)
        wide = WideModel.from_pretrained(args.adapters)
        print(wide.plan.summary())
        task = task_for_config(wide.config)
        item = _item(parser, args, task, wide.config)
        result = pipeline(task, model=wide)(item)
        print(result)
        return {"result": result}

    base = Path(args.base or demo_member_paths()[0])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        adapters = [str(train_adapter(base, out / f"lora-{seed}", seed)) for seed in range(args.members)]
        print(f"Fine-tuned {len(adapters)} LoRA adapters of {base} in {out}")
        wide = WideModel.from_pretrained(adapters)  # the base loaded once, the adapters stacked
        print(wide.plan.summary())
        _, (images, labels) = load_digits_split()
        pixels = to_pixel_values(images)
        report = evaluate(wide, pixels, labels)
        # member i of the wide model is adapter i on its base, as PEFT runs it alone
        import peft
        from transformers import ViTForImageClassification

        alone = peft.PeftModel.from_pretrained(ViTForImageClassification.from_pretrained(base), adapters[0]).eval()
        with torch.inference_mode():
            difference = (wide(pixel_values=pixels).logits[0] - alone(pixel_values=pixels).logits).abs().max().item()
    print(f"\nHeld-out digits: {len(labels)} images; member 0 against its adapter run alone: max |diff| "
          f"{difference:.1e}\n{'model':<12}{'accuracy':>10}{'NLL':>8}{'ECE':>8}")
    rows = [(f"adapter {i}", r) for i, r in enumerate(report["members"])] + [("ensemble", report["ensemble"])]
    for name, r in rows:
        print(f"{name:<12}{r['accuracy']:>10.3f}{r['nll']:>8.3f}{r['ece']:>8.3f}")
    return {"members": report["members"], "ensemble": report["ensemble"], "difference": difference}


if __name__ == "__main__":
    main()
