"""hf_wide/benchmark/load_memory.py: the peak-memory figures of loading, on tiny checkpoints (the figures
themselves are the benchmark's to report, not a test's)."""

import pytest

from hf_wide.benchmark.load_memory import _format, measure_load_memory

pytest.importorskip("peft")


def test_adapters_alone_are_measured_against_the_base_and_the_adapters(tmp_path):
    report = measure_load_memory(2, hidden=32, layers=1, vocab=100, modes=("adapters",), folder=str(tmp_path))
    load = report["loads"]["adapters"]
    assert set(report["loads"]) == {"adapters"} and "fused_bytes" not in report
    assert not (tmp_path / "member-0").exists()  # no full checkpoints written for adapters alone
    assert report["base_and_adapters_bytes"] > 0 and load["peak"] > report["baseline_peak"] and load["over_warm"] >= 0
    assert load["ratio"] == pytest.approx(load["over_baseline"] / report["base_and_adapters_bytes"])
    assert "LoRA adapters" in _format(report) and "fused model " not in _format(report)
