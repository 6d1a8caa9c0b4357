"""Fuse checkpoints and push the fused model to the Hub as one repo; then load it back by its id.

    HF_TOKEN=hf_... python examples/push_fused_model.py you/digits-wide            # the embedded default
    HF_TOKEN=hf_... python examples/push_fused_model.py you/bert-wide org/a org/b org/c --private

The repo holds the stacked weights (one safetensors file, sharded when large), a config with an ``hf_wide``
section (members, revisions, labels), the members' tokenizer or processor files and a model card listing the
members. ``WideModel.from_pretrained("you/digits-wide")`` and ``pipeline(task, model="you/digits-wide")``
load it back; the Space shows it with ``HF_WIDE_MODEL=you/digits-wide``. For a private Hub, set
``HF_ENDPOINT`` (huggingface_hub reads it) or pass ``--endpoint``.
"""

import argparse
import os

from hf_wide import WideModel, pipeline
from hf_wide.demo import demo_member_paths, is_digit_model, load_digits_split, task_for_config


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo_id", help="where to push, e.g. you/digits-wide")
    parser.add_argument("models", nargs="*", help="Hub repo ids or local folders (default: the embedded default)")
    parser.add_argument("--token", default=os.environ.get("HF_TOKEN"), help="a write token (default: $HF_TOKEN)")
    parser.add_argument("--endpoint", help="a Hub other than huggingface.co (default: $HF_ENDPOINT)")
    parser.add_argument("--private", action="store_true")
    args = parser.parse_args(argv)
    if args.endpoint:
        from huggingface_hub import constants

        constants.ENDPOINT = args.endpoint.rstrip("/")
        constants.HUGGINGFACE_CO_URL_TEMPLATE = constants.ENDPOINT + "/{repo_id}/resolve/{revision}/{filename}"

    models = args.models or [str(path) for path in demo_member_paths()]
    wide = WideModel.from_pretrained(models)
    url = wide.push_to_hub(args.repo_id, token=args.token, private=args.private or None)
    print(f"Pushed {wide.num_members} members fused into one repo: {url}")

    # Back from the Hub by its id alone, and used at once.
    task = task_for_config(wide.config)
    pipe = pipeline(task, model=args.repo_id, token=args.token)
    if is_digit_model(wide.config):
        from PIL import Image

        _, (images, _) = load_digits_split()
        item = Image.fromarray(images[0].numpy())
    else:
        item = "a great film" if task == "text-classification" else None
    if item is not None:
        result = pipe(item)
        print(f"{args.repo_id} says {result['label']} ({result['score']:.1%}) for {item!r:.40}; "
              f"members agreeing: {result['uncertainty']['agreement']:.0%}")
    return args.repo_id


if __name__ == "__main__":
    main()
