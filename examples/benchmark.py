"""How fast is one wide model against running the members one after another, on this machine?

    python examples/benchmark.py                                # preset "quick": under 2 minutes on 2 cores
    python examples/benchmark.py --preset tiny --json out.json  # one small configuration, in seconds
    python examples/benchmark.py --models org/a org/b org/c --batch 8 --seq 64   # your own checkpoints

Same inputs, one process: the members in sequence, the torch.func vmap recipe, the wide model (eager and
compiled) and the ideal, one member on all N*B rows. ``hf-wide benchmark`` is the same from the shell.
"""

import argparse

from hf_wide import tune_cpu_allocator
from hf_wide.benchmark import run_benchmark


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick", choices=("tiny", "quick", "full"))
    parser.add_argument("--models", nargs="+", help="benchmark these checkpoints instead of a preset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="write every record as JSON here")
    args = parser.parse_args(argv)

    tune_cpu_allocator()  # as the hf-wide command line does: large CPU batches reuse freed memory
    records = run_benchmark(args.preset, models=args.models, batch=args.batch, seq=args.seq, json_path=args.json)
    for r in records:
        ratio = r["sequential_over_wide"]
        print(f"{r['config'] or 'models'} N={r['n']} B={r['batch']} seq={r['seq']}: the wide model is "
              f"{ratio:.2f}x as fast as the members in sequence (outputs equal to {r['max_abs_diff']:.1e})")
    return records


if __name__ == "__main__":
    main()
