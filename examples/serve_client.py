"""Call an ensemble served by ``hf-wide serve`` with the Hugging Face client, as any Inference API endpoint.

    hf-wide serve org/sst2-seed0 org/sst2-seed1 org/sst2-seed2 --task text-classification --port 8000
    python examples/serve_client.py "a great film" "a dull one" --url http://127.0.0.1:8000

Each answer is every label with the ensemble's score, best first; the best one also carries each member's
answer and the uncertainty measures (extra fields, which InferenceClient keeps as attributes).
"""

import argparse

from huggingface_hub import InferenceClient


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--top-k", type=int, default=None)
    args = parser.parse_args(argv)
    client = InferenceClient(base_url=args.url)
    answers = []
    for text in args.texts:
        best, *rest = client.text_classification(text, top_k=args.top_k)
        answers.append([best, *rest])
        members = ", ".join(f"{m['label']} {m['score']:.2f}" for m in best.members)
        print(f"{text!r}: {best.label} {best.score:.3f} (members: {members}; "
              f"agreement {best.uncertainty.get('agreement', float('nan')):.2f})")
    return answers


if __name__ == "__main__":
    main()
