"""Fuse three checkpoints of one architecture into one wide model and classify with the ensemble.

    python examples/fuse_and_classify.py org/sst2-seed0 org/sst2-seed1 org/sst2-seed2 --text "a great film"
    python examples/fuse_and_classify.py ./ckpt-a ./ckpt-b ./ckpt-c --image cat.png
    python examples/fuse_and_classify.py          # the embedded default's first three digit classifiers

Hub repo ids and local folders mix freely; every checkpoint must share the model class and its config's
shape-defining fields. One forward pass computes all members; the pipeline combines them (mean of
probabilities) and says how much they agree.
"""

import argparse

from hf_wide import WideModel, pipeline
from hf_wide.demo import demo_member_paths, is_digit_model, load_digits_split, task_for_config, to_digit_image


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="Hub repo ids or local folders (default: 3 embedded digit members)")
    parser.add_argument("--text", default="a great film", help="the text to classify (text classifiers)")
    parser.add_argument("--image", help="the image to classify (image classifiers; default: a held-out digit)")
    args = parser.parse_args(argv)

    models = args.models or [str(path) for path in demo_member_paths()[:3]]
    wide = WideModel.from_pretrained(models)  # N checkpoints -> one wide model
    print(wide.plan.summary())
    task = task_for_config(wide.config)
    pipe = pipeline(task, model=wide)  # the tokenizer or image processor comes from the members
    if task == "text-classification":
        item = args.text
    elif args.image:
        item = to_digit_image(args.image) if is_digit_model(wide.config) else args.image
    else:
        from PIL import Image

        _, (images, labels) = load_digits_split()
        item = Image.fromarray(images[0].numpy())
        print(f"A held-out digit, written as {labels[0].item()}:")
    result = pipe(item)
    print(f"ensemble: {result['label']} ({result['score']:.1%})")
    for i, member in enumerate(result["members"]):
        print(f"  member {i} ({models[i]}): {member['label']} ({member['score']:.1%})")
    u = result["uncertainty"]
    print(f"agreement {u['agreement']:.0%}, mutual information {u['mutual_information']:.3f} nats "
          f"(how much the members disagree), predictive entropy {u['predictive_entropy']:.3f} nats")
    return result


if __name__ == "__main__":
    main()
