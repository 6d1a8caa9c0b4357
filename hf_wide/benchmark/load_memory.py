"""Peak memory while loading a wide model: ``python -m hf_wide.benchmark.load_memory``.

Saves N BERT checkpoints (hidden 256, 4 layers, a 30k vocabulary: about 45 MB each) and one fused repo of them
to a temporary folder, then loads them in fresh subprocesses:

- ``baseline``: imports torch, transformers and hf-wide and does nothing else;
- ``members``:  ``WideModel.from_pretrained(member folders)``, the low-memory path;
- ``again``:    the same members loaded again, streamed into the plan their first load cached
  (:mod:`hf_wide.plan_cache`), verified rather than traced;
- ``fused``:    ``WideModel.from_pretrained(fused folder)``;
- ``whole``:    every member loaded as a model, then ``WideModel.from_models`` (what the low-memory path
  replaced), for comparison;
- ``adapters``: ``WideModel.from_pretrained(adapter folders)``: N LoRA adapters (rank 8 on every linear of the
  layers, the classifier saved whole) of one such base, whose cost is measured against the base plus the
  adapters (their files' bytes) rather than the fused model;
- ``cached``: the same adapters loaded again, by the plan their first load cached (:mod:`hf_wide.plan_cache`),
  verified rather than traced (``members``, ``adapters`` and the others load with a cache of their own, empty);
- ``unverified``: the same, ``verify=False`` (what hf-wide's check of every fused module against its members
  adds to the peak);
- ``peft``: the same adapters as PEFT itself holds them, for reference: one ``PeftModel`` with the N adapters
  loaded by name, each run once on the sample inputs hf-wide verifies with (no trace, no fusion, no member
  models; what a load that only reads the files and runs each adapter costs, :func:`load_with_peft`);
- ``traced``: ``peft`` with one trace of adapter 0 as hf-wide traces a member (``torch.export``,
  :func:`hf_wide.tracer.trace`), taken before the other adapters load (the order that holds least): the least a
  load that traces the model can hold.

Each child reads its peak resident memory (``VmHWM``). A load's cost is its peak minus the baseline's, as a
multiple of the fused model's size (the bytes of its parameters and buffers). Loading pulls in libraries the
baseline has not imported (``torch.export`` for the trace), so each child also reports ``warm``: its peak after
loading two tiny members first, which imports all of that, and ``over_warm``: the cost of the real load above it.

``held`` is the figure to read: resident memory counts only the pages of a memory-mapped checkpoint that have been
touched, and a base kept mapped (adapters) is mostly an embedding of which a load touches a few rows, so ``VmHWM``
swings with what happened to read the file (from 1.00x to 1.13x of the adapters' size in eight runs of the
default). ``held`` counts those files whole: the most that the real load added to the process's anonymous memory
(sampled every 0.2 ms) plus the bytes of the checkpoint files it held mapped at the time (read every 20 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ADAPTER_MODES = {"adapters", "cached", "unverified", "peft", "traced"}  # measured against the base and the adapters
PRIMED = {"again": "members", "cached": "adapters"}  # loads again, after a first load in their plan cache

CHILD = r"""
import gc, json, os, sys
import torch, transformers
import hf_wide, hf_wide.hub
from hf_wide import WideModel
from hf_wide.benchmark.load_memory import ADAPTER_MODES, HeldPeak
from hf_wide.cpu import peak_rss as peak
mode, warmup, root, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
result = {"imports": peak()}
if warmup != "-":  # for adapters, peft's imports and the adapter path too: on tiny adapters
    tiny = "tiny-lora" if mode in ADAPTER_MODES else "tiny"
    WideModel.from_pretrained([os.path.join(warmup, f"{tiny}-0"), os.path.join(warmup, f"{tiny}-1")])
    gc.collect()  # the tiny model's mapped files with it
result["warm"] = peak()
with HeldPeak(root) as held:
    if mode in ("members", "again", "fused", "adapters", "cached"):
        wide = WideModel.from_pretrained(paths)
    elif mode == "unverified":
        wide = WideModel.from_pretrained(paths, verify=False)
    elif mode == "whole":
        from hf_wide.hub import load_members
        wide = WideModel.from_models(load_members(paths)[0])
    elif mode in ("peft", "traced"):
        from hf_wide.benchmark.load_memory import load_with_peft
        wide = load_with_peft(paths, trace=mode == "traced")
if mode != "baseline":
    result["fused_bytes"] = sum(t.numel() * t.element_size() for t in (*wide.parameters(), *wide.buffers()))
result["peak"] = peak()
result["anonymous"], result["held"] = held.anonymous, held.held
print(json.dumps(result))
"""


def anonymous_rss() -> int:
    """This process's resident anonymous memory in bytes (``RssAnon``: its heap, not files or libraries), Linux."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status: this measure needs Linux")


def mapped_bytes(folder: str) -> int:
    """The bytes of the files under ``folder`` that this process has mapped (a checkpoint's memory-mapped
    tensors), resident or not; a file mapped twice shares its pages, and counts once."""
    prefix = os.path.join(os.path.realpath(folder), "")  # the kernel names mapped files by their real path
    files = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                files.add(fields[5].rstrip("\n"))
    return sum(os.path.getsize(f) for f in files if os.path.exists(f))


class HeldPeak:
    """``with HeldPeak(folder) as h: ...``: ``h.anonymous`` and ``h.held``, the most anonymous memory the block added
    and the most it added and held mapped from files under ``folder`` at once (the files counted whole). A thread
    samples the anonymous memory every ``interval`` seconds (torch releases the GIL in its ops) and the maps, whose
    reading costs milliseconds, every ``maps_interval``."""

    def __init__(self, folder: str, interval: float = 2e-4, maps_interval: float = 0.02):
        self.folder, self.interval, self.maps_interval = folder, interval, maps_interval
        self._done = threading.Event()

    def __enter__(self) -> "HeldPeak":
        self._anonymous, self._mapped = anonymous_rss(), mapped_bytes(self.folder)
        self.anonymous = self.held = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        mapped, read_at = self._mapped, time.perf_counter()
        while not self._done.is_set():
            if time.perf_counter() - read_at >= self.maps_interval:
                mapped, read_at = mapped_bytes(self.folder), time.perf_counter()
            self._update(anonymous_rss(), mapped)
            time.sleep(self.interval)

    def _update(self, anonymous: int, mapped: int) -> None:  # what the block added: files it unmapped count 0
        anonymous, mapped = anonymous - self._anonymous, max(0, mapped - self._mapped)
        self.anonymous = max(self.anonymous, anonymous)
        self.held = max(self.held, anonymous + mapped)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._update(anonymous_rss(), mapped_bytes(self.folder))


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

    from ..adapters import peft_quietly

    def adapters(base_dir: Path, name: str, n: int) -> list[str]:
        paths = []
        for i in range(n):
            torch.manual_seed(i)
            with peft_quietly():
                model = peft.get_peft_model(BertForSequenceClassification.from_pretrained(base_dir), peft.LoraConfig(
                    r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"],
                    modules_to_save=["classifier"], task_type="SEQ_CLS", init_lora_weights=False))
            model.save_pretrained(folder / f"{name}-{i}")
            paths.append(str(folder / f"{name}-{i}"))
        return paths

    torch.manual_seed(0)
    BertForSequenceClassification(_bert_config(hidden, layers, vocab)).save_pretrained(folder / "base")
    BertForSequenceClassification(_bert_config(32, 1, 100)).save_pretrained(folder / "tiny-base")
    adapters(folder / "tiny-base", "tiny-lora", 2)
    paths = adapters(folder / "base", "lora", num_members)
    size = sum(p.stat().st_size for p in [folder / "base" / "model.safetensors",
                                         *(Path(p) / "adapter_model.safetensors" for p in paths)])
    return paths, size


def load_with_peft(paths: list[str], trace: bool = False):
    """The adapters at ``paths`` as PEFT holds several: one ``PeftModel`` over their base, each adapter loaded under
    its own name and run once (no gradients) on :func:`hf_wide.samples.sample_inputs` of the model; ``trace``: with
    adapter 0 alone loaded, traced as hf-wide traces a member (:func:`hf_wide.tracer.trace`), the trace dropped (the
    other adapters then reuse memory the trace freed: 1.14x of the base and adapters of the default size held,
    against 1.22x tracing after the last)."""
    import peft
    import torch
    from transformers import BertForSequenceClassification

    from ..adapters import peft_quietly
    from ..samples import sample_inputs

    base = json.loads((Path(paths[0]) / "adapter_config.json").read_text())["base_model_name_or_path"]
    with peft_quietly():
        model = peft.PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained(base), paths[0],
                                               adapter_name="0").eval()
        inputs = sample_inputs(model)
        if trace:
            from ..tracer import trace as export

            export(model, (), inputs)
        for i, path in enumerate(paths[1:], 1):
            model.load_adapter(path, adapter_name=str(i))
    with torch.no_grad():
        for i in range(len(paths)):
            model.set_adapter(str(i))
            model(**inputs)
    return model


def _run_child(mode: str, warmup: str, root: Path, paths: list[str], plans: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_WIDE_PLAN_CACHE": str(plans)}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, warmup, str(root), *paths], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_load_memory(num_members: int = 4, hidden: int = 256, layers: int = 4, vocab: int = 30_000,
                        modes: tuple[str, ...] = ("members", "fused", "whole", "adapters"),
                        folder: str | None = None) -> dict:
    """Peak-RSS figures (bytes, and ratios to the fused model's size) of loading ``num_members`` BERT checkpoints
    each way in ``modes``. Checkpoints are written to ``folder`` (a temporary one if None)."""
    with tempfile.TemporaryDirectory(prefix="hf-wide-mem-") as tmp:
        root = Path(folder or tmp)
        full = [mode for mode in modes if mode not in ADAPTER_MODES]
        paths = write_members(root, num_members, hidden, layers, vocab) if full else []
        adapter_paths, adapter_bytes = write_adapters(root, num_members, hidden, layers, vocab) if (
            set(modes) & ADAPTER_MODES) else ([], None)
        baseline = _run_child("baseline", "-", root, [], root / "plans-baseline")
        report = {"num_members": num_members, "hidden": hidden, "layers": layers, "vocab": vocab,
                  "baseline_peak": baseline["peak"], "loads": {}}
        for mode in modes:
            sources = adapter_paths if mode in ADAPTER_MODES else [str(root / "fused")] if mode == "fused" else paths
            plans = [root / f"plans-{mode}-{child}" for child in ("cold", "warm")]  # each a first load
            if mode in PRIMED:  # a load of the same members before, which cached their plan
                plans = [root / f"plans-{mode}"] * 2
                _run_child(PRIMED[mode], "-", root, sources, plans[0])
            cold, warm = _run_child(mode, "-", root, sources, plans[0]), _run_child(mode, str(root), root, sources,
                                                                                      plans[1])
            size = adapter_bytes if mode in ADAPTER_MODES else cold["fused_bytes"]
            if mode not in ADAPTER_MODES:
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
                "anonymous": warm["anonymous"],
                "held": warm["held"],
                "ratio_held": warm["held"] / size,
            }
    return report


def _format(report: dict) -> str:
    mb = 1 << 20
    fused = f"fused model {report['fused_bytes'] / mb:.1f} MiB; " if "fused_bytes" in report else ""
    lines = [
        f"{report['num_members']} x BERT (hidden {report['hidden']}, {report['layers']} layers, vocab "
        f"{report['vocab']}): {fused}baseline process (imports) {report['baseline_peak'] / mb:.1f} MiB",
        f"{'load':<10} {'peak MiB':>9} {'- baseline':>11} {'x size':>8} {'- warm':>8} {'x size':>8} "
        f"{'anon. MiB':>10} {'held MiB':>9} {'x size':>8}",
    ]
    if "base_and_adapters_bytes" in report:
        modes = ", ".join(sorted(ADAPTER_MODES & report["loads"].keys()))
        lines.insert(1, f"{modes}: the base and {report['num_members']} LoRA adapters, "
                        f"{report['base_and_adapters_bytes'] / mb:.1f} MiB (the size their x is of; the others', "
                        "the fused model)")
    for mode, r in report["loads"].items():
        lines.append(f"{mode:<10} {r['peak'] / mb:>9.1f} {r['over_baseline'] / mb:>11.1f} {r['ratio']:>8.2f} "
                     f"{r['over_warm'] / mb:>8.1f} {r['ratio_over_warm']:>8.2f} {r['anonymous'] / mb:>10.1f} "
                     f"{r['held'] / mb:>9.1f} {r['ratio_held']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=30_000)
    parser.add_argument("--modes", nargs="+", default=["members", "fused", "whole", "adapters"],
                        choices=["members", "again", "fused", "whole", "adapters", "cached", "unverified", "peft",
                                 "traced"])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    report = measure_load_memory(args.members, args.hidden, args.layers, args.vocab, tuple(args.modes))
    print(_format(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
