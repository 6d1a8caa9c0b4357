"""Member parallelism measured: ``python -m hf_wide.benchmark.member_parallel [--ranks 1 2] [--json FILE]``.

Saves N Llama-like members (random weights, ``--hidden``, ``--layers``), then for each K in ``--ranks`` launches
``torchrun --nproc-per-node K`` on this module: every rank loads its slice with
``WideModel.from_pretrained(ids, member_parallel=True)`` and times a forward of the same ``(B, T)`` batch
(median of ``--repeats``, after a warm-up; ranks start each together). Reports per K: load seconds, each rank's
parameter bytes and peak resident memory, the forward's milliseconds. CPU ranks use gloo; with CUDA, each rank
takes the GPU of its local rank and nccl. No targets here: on a 2-core machine two processes share the cores
that one would use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..cpu import peak_rss


def write_members(folder: Path, num_members: int, hidden: int, layers: int) -> list[str]:
    from .configs import ModelSpec

    spec = ModelSpec("llama", hidden, layers)
    paths = []
    for seed in range(num_members):
        path = folder / f"member-{seed}"
        spec.build(seed).save_pretrained(path)
        paths.append(str(path))
    return paths


def rank_main(paths: list[str], batch: int, seq: int, repeats: int, out: Path) -> None:
    """One rank under torchrun: load the slice, time the forward, write ``rank{r}.json``."""
    import torch.distributed as dist

    from hf_wide import WideModel

    from hf_wide.parallel import init

    init()  # nccl on the local rank's GPU, or gloo
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    rank = dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    wide = WideModel.from_pretrained(paths, member_parallel=True, device=device)
    load_s = time.perf_counter() - start
    ids = torch.randint(0, wide.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    with torch.inference_mode():
        for step in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            logits = wide(input_ids=ids).logits  # (N, B, T, V) on every rank
            if cuda:
                torch.cuda.synchronize()
            if step >= 2:  # two warm-up steps
                times.append(time.perf_counter() - start)
    result = {"rank": rank, "members": list(wide.members_group.local), "load_s": load_s,
              "parameter_bytes": sum(p.numel() * p.element_size() for p in wide.parameters()),
              "peak_rss_bytes": peak_rss(), "forward_ms": statistics.median(times) * 1e3,
              "output_shape": list(logits.shape)}
    if cuda:
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(ranks=(1, 2), num_members: int = 4, hidden: int = 256, layers: int = 4, batch: int = 8, seq: int = 64,
        repeats: int = 10) -> dict:
    report = {"members": num_members, "hidden": hidden, "layers": layers, "batch": batch, "seq": seq,
              "device": "cuda" if torch.cuda.is_available() else "cpu", "ranks": {}}
    with tempfile.TemporaryDirectory(prefix="hf-wide-member-parallel-") as tmp:
        paths = write_members(Path(tmp), num_members, hidden, layers)
        for k in ranks:
            out = Path(tmp) / f"k{k}"
            out.mkdir()
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}",
                       "-m", "hf_wide.benchmark.member_parallel", "--rank-of", str(out), "--batch", str(batch),
                       "--seq", str(seq), "--repeats", str(repeats), *paths]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() // k)))}
            subprocess.run(command, check=True, env=env, timeout=1800)
            per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(k)]
            report["ranks"][str(k)] = {"load_s": max(r["load_s"] for r in per_rank),
                                       "forward_ms": max(r["forward_ms"] for r in per_rank), "per_rank": per_rank}
            print(f"K={k}: {_row(report['ranks'][str(k)])}", file=sys.stderr)
    return report


def _row(r: dict) -> str:
    mib = ", ".join(f"{p['parameter_bytes'] / 2**20:.1f}/{p['peak_rss_bytes'] / 2**20:.0f}" for p in r["per_rank"])
    return f"load {r['load_s']:.2f} s, forward {r['forward_ms']:.1f} ms, per rank params/peak RSS MiB: {mib}"


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts K to measure")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run as one rank, writing into this folder
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        rank_main(args.paths, args.batch, args.seq, args.repeats, Path(args.rank_of))
        return None
    report = run(args.ranks, args.members, args.hidden, args.layers, args.batch, args.seq, args.repeats)
    print(f"{report['members']} Llama members (hidden {report['hidden']}, {report['layers']} layers), "
          f"B={report['batch']} T={report['seq']}, {report['device']}")
    for k, r in report["ranks"].items():
        print(f"K={k}: {_row(r)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
