"""Ensemble decoding with causal LMs: N fine-tunes of one base model write one shared continuation.

    python examples/ensemble_decoding.py org/llama-sft-seed0 org/llama-sft-seed1 org/llama-sft-seed2 \
        --prompt "The capital of France is" --max-new-tokens 20

At every step all members read the same prefix in one wide forward (a KV cache of N*B rows), their
next-token distributions are averaged (``combine="mean"``) and one token is chosen for all of them. With
``return_members=True`` each member's own greedy continuation comes too, from the same wide model.
"""

import argparse

from hf_wide import pipeline


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="Hub repo ids or local folders of causal LMs of one architecture")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--combine", default="mean",
                        help="mean, logit_mean, vote, median, ..., or none: the members' own continuations alone")
    args = parser.parse_args(argv)

    pipe = pipeline("text-generation", model=args.models, combine=args.combine)
    result = pipe(args.prompt, max_new_tokens=args.max_new_tokens, return_members=True)
    if "generated_text" in result:  # (combine="none": the members' own continuations, no ensemble's)
        print(f"ensemble ({args.combine}): {result['generated_text']!r}")
    for member in result["members"]:
        print(f"  member {member['member']} alone: {member['generated_text']!r}")
    u = result.get("uncertainty")
    if u:
        print(f"per token, on average: predictive entropy {u['predictive_entropy']:.3f} nats, "
              f"mutual information {u['mutual_information']:.3f}, agreement {u['agreement']:.0%}")
    return result


if __name__ == "__main__":
    main()
