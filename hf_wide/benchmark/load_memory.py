"""Peak resident memory while loading a wide model: ``python -m hf_wide.benchmark.load_memory``.

Saves N BERT checkpoints (hidden 256, 4 layers, a 30k vocabulary: about 45 MB each) and one fused repo of them
to a temporary folder, then loads them in fresh subprocesses and reads each one's peak resident memory
(``VmHWM``):

- ``baseline``: imports torch, transformers and hf-wide and does nothing else;
- ``members``:  ``WideModel.from_pretrained(member folders)``, the low-memory path;
- ``fused``:    ``WideModel.from_pretrained(fused folder)``;
- ``whole``:    every member loaded as a model, then ``WideModel.from_models`` (what the low-memory path
  replaced), for comparison;
- ``adapters``: ``WideModel.from_pretrained(adapter folders)``: N LoRA adapters (rank 8 on every linear of the
  layers, the classifier saved whole) of one such base, whose cost is measured against the base plus the
  adapters (their files' bytes) rather than the fused model.

A load's cost is its peak minus the baseline's, as a multiple of the fused model's size (the bytes of its
parameters and buffers). Loading pulls in libraries the baseline has not imported (``torch.export`` for the
trace), so each child also reports ``warm``: its peak after loading two tiny members first, which imports all
of that, and ``over_warm``: the cost of the real load above it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys
import torch, transformers
import hf_wide, hf_wide.hub
from hf_wide import WideModel
from hf_wide.cpu import peak_rss as peak
mode, warmup, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
result = {"imports": peak()}
if warmup != "-":  # for adapters, peft's imports and the adapter path too: on tiny adapters
    tiny = "tiny-lora" if mode == "adapters" else "tiny"
    WideModel.from_pretrained([os.path.join(warmup, f"{tiny}-0"), os.path.join(warmup, f"{tiny}-1")])
result["warm"] = peak()
if mode in ("members", "fused", "adapters"):
    wide = WideModel.from_pretrained(paths)
elif mode == "whole":
    from hf_wide.hub import load_members
    wide = WideModel.from_models(load_members(paths)[0])
if mode != "baseline":
    result["fused_bytes"] = sum(t.numel() * t.element_size() for t in (*wide.parameters(), *wide.buffers()))
result["peak"] = peak()
print(json.dumps(result))
"""


def _bert_config(hidden: int, layers: int, vocab: int):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden, num_labels=2)


def write_members(folder: Path, num_members: int, hidden: int, layers: int, vocab: int) -> list[str]:
    """N randomly initialised BertForSequenceClassification checkpoints (different seeds), two tiny ones for the
    warm-up, and the fused repo of the N under ``folder/fused``."""
    import torch
    from transformers import BertForSequenceClassification

    from ..model import WideModel

    paths = []
    for i in range(num_members):
        torch.manual_seed(i)
        model = BertForSequenceClassification(_bert_config(hidden, layers, vocab))
        model.save_pretrained(folder / f"member-{i}")
        paths.append(str(folder / f"member-{i}"))
        del model
    for i in range(2):
        torch.manual_seed(100 + i)
        BertForSequenceClassification(_bert_config(32, 1, 100)).save_pretrained(folder / f"tiny-{i}")
    WideModel.from_pretrained(paths).save_pretrained(folder / "fused")
    return paths


def write_adapters(folder: Path, num_members: int, hidden: int, layers: int, vocab: int) -> tuple[list[str], int]:
    """A base checkpoint and N LoRA adapters of it under ``folder``, two tiny ones for the warm-up; returns the
    adapters' folders and the bytes of the base and the adapters (their safetensors files)."""
    import peft
    import torch
    from transformers import BertForSequenceClassification

    def adapters(base_dir: Path, name: str, n: int, config) -> list[str]:
        paths = []
        for i in range(n):
            torch.manual_seed(i)
            model = peft.get_peft_model(BertForSequenceClassification.from_pretrained(base_dir), peft.LoraConfig(
                r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"], modules_to_save=["classifier"],
                task_type="SEQ_CLS", init_lora_weights=False))
            model.save_pretrained(folder / f"{name}-{i}")
            paths.append(str(folder / f"{name}-{i}"))
        return paths

    torch.manual_seed(0)
    BertForSequenceClassification(_bert_config(hidden, layers, vocab)).save_pretrained(folder / "base")
    BertForSequenceClassification(_bert_config(32, 1, 100)).save_pretrained(folder / "tiny-base")
    adapters(folder / "tiny-base", "tiny-lora", 2, None)
    paths = adapters(folder / "base", "lora", num_members, None)
    size = sum(p.stat().st_size for p in [folder / "base" / "model.safetensors",
                                         *(Path(p) / "adapter_model.safetensors" for p in paths)])
    return paths, size


def _run_child(mode: str, warmup: str, paths: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, warmup, *paths], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_load_memory(num_members: int = 4, hidden: int = 256, layers: int = 4, vocab: int = 30_000,
                        modes: tuple[str, ...] = ("members", "fused", "whole", "adapters"),
                        folder: str | None = None) -> dict:
    """Peak-RSS figures (bytes, and ratios to the fused model's size) of loading ``num_members`` BERT checkpoints
    each way in ``modes``. Checkpoints are written to ``folder`` (a temporary one if None)."""
    with tempfile.TemporaryDirectory(prefix="hf-wide-mem-") as tmp:
        root = Path(folder or tmp)
        full = [mode for mode in modes if mode != "adapters"]
        paths = write_members(root, num_members, hidden, layers, vocab) if full else []
        adapter_paths, adapter_bytes = write_adapters(root, num_members, hidden, layers, vocab) if (
            "adapters" in modes) else ([], None)
        baseline = _run_child("baseline", "-", [])
        report = {"num_members": num_members, "hidden": hidden, "layers": layers, "vocab": vocab,
                  "baseline_peak": baseline["peak"], "loads": {}}
        for mode in modes:
            sources = {"fused": [str(root / "fused")], "adapters": adapter_paths}.get(mode, paths)
            cold, warm = _run_child(mode, "-", sources), _run_child(mode, str(root), sources)
            size = adapter_bytes if mode == "adapters" else cold["fused_bytes"]
            if mode != "adapters":
                report["fused_bytes"] = size
            else:
                report["base_and_adapters_bytes"] = size
            report["loads"][mode] = {
                "peak": cold["peak"],
                "over_baseline": cold["peak"] - baseline["peak"],
                "ratio": (cold["peak"] - baseline["peak"]) / size,
                "warm": warm["warm"],
                "over_warm": warm["peak"] - warm["warm"],
                "ratio_over_warm": (warm["peak"] - warm["warm"]) / size,
            }
    return report


def _format(report: dict) -> str:
    mb = 1 << 20
    fused = f"fused model {report['fused_bytes'] / mb:.1f} MiB; " if "fused_bytes" in report else ""
    lines = [
        f"{report['num_members']} x BERT (hidden {report['hidden']}, {report['layers']} layers, vocab "
        f"{report['vocab']}): {fused}baseline process (imports) {report['baseline_peak'] / mb:.1f} MiB",
        f"{'load':<8} {'peak MiB':>9} {'- baseline':>11} {'x size':>8} {'- warm':>8} {'x size':>8}",
    ]
    if "base_and_adapters_bytes" in report:
        lines.insert(1, f"adapters: the base and {report['num_members']} LoRA adapters, "
                        f"{report['base_and_adapters_bytes'] / mb:.1f} MiB (the size its x is of; the others', the fused model)")
    for mode, r in report["loads"].items():
        lines.append(f"{mode:<8} {r['peak'] / mb:>9.1f} {r['over_baseline'] / mb:>11.1f} {r['ratio']:>8.2f} "
                     f"{r['over_warm'] / mb:>8.1f} {r['ratio_over_warm']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=30_000)
    parser.add_argument("--modes", nargs="+", default=["members", "fused", "whole", "adapters"],
                        choices=["members", "fused", "whole", "adapters"])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    report = measure_load_memory(args.members, args.hidden, args.layers, args.vocab, tuple(args.modes))
    print(_format(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
