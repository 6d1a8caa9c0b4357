"""``python -m hf_wide.benchmark.weight_traffic``: the one-weight-set control views member 0's weights, and
the report splits the gap to the ideal into its two factors."""

import json

import pytest
import torch

from hf_wide.benchmark import weight_traffic
from hf_wide.benchmark.configs import ModelSpec
from hf_wide.primitives.linear import WideLinear


def test_the_control_streams_one_weight_set_with_the_wide_models_shapes():
    members = [ModelSpec("llama", 64, 1).build(seed) for seed in range(3)]
    control = weight_traffic.one_weight_set(members)
    matmul_weights = [m.weight for m in control.modules() if isinstance(m, WideLinear)]
    matmul_weights += [m.qkv_weight for m in control.modules() if hasattr(m, "qkv_weight")]
    assert matmul_weights
    for weight in matmul_weights:
        assert weight.shape[0] == 3 and weight.stride(0) == 0  # N members, one set in memory
        assert torch.equal(weight[2], weight[0])


def test_measure_and_report(tmp_path, capsys, monkeypatch):
    record = weight_traffic.measure("bert", 64, 2, 1, 8, target_s=0.01, compiled=False)
    assert record["max_abs_diff"] < 1e-5
    assert set(record["ms"]) == {"wide", "one_set", "ideal"} and min(record["ms"].values()) > 0
    assert record["wide_over_ideal"] == pytest.approx(record["fusion"] * record["weights"])
    for name in ("wide", "one_set"):
        assert record["matmul_ms"][name]["in_forward"] > 0 and record["matmul_ms"][name]["back_to_back"] > 0
    assert "weight traffic" in weight_traffic.format_record(record)
    assert "back to back" in weight_traffic.format_record(record)
    monkeypatch.setattr(weight_traffic, "CONFIGS", [("bert", 64, 2, 1, 8)])
    monkeypatch.setattr(weight_traffic, "RETENTION_GAPS_US", (0, 100))
    path = tmp_path / "wt.json"
    assert weight_traffic.main(["--no-compile", "--target-s", "0.01", "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written["records"][0]["n"] == 2
    timed = [(r["mb"], r["gap_us"]) for r in written["cache_retention"]]
    assert timed == [(1.6, 0), (1.6, 100), (13.0, 0), (13.0, 100)]
    out = capsys.readouterr().out
    assert "fusion" in out and "cache retention" in out


def test_the_matmul_timer_sees_every_batched_matmul_of_a_forward():
    members = [ModelSpec("bert", 64, 1).build(seed) for seed in range(2)]
    wide = weight_traffic.WideModel.from_models(members).eval()
    inputs = weight_traffic.make_inputs(members[0], 1, 8)
    timer = weight_traffic._MatmulTimer()
    with torch.inference_mode(), timer:
        wide(**inputs)
    matmuls = [m for m in wide.modules() if isinstance(m, WideLinear) or hasattr(m, "qkv_weight")]
    assert len(timer.calls) == len(matmuls) and timer.seconds > 0


def test_cache_retention_times_every_size_after_every_gap_and_restores_the_threads():
    threads = torch.get_num_threads()
    records = weight_traffic.cache_retention(sizes_mb=(0.25, 1), gaps_us=(0, 50), reads=5)
    assert [(r["mb"], r["gap_us"]) for r in records] == [(0.25, 0), (0.25, 50), (1, 0), (1, 50)]
    assert all(r["gb_per_s"] > 0 and r["read_us"] > 0 for r in records)
    assert torch.get_num_threads() == threads
    assert "1 MB, GB/s after a gap of 0 ms: " in weight_traffic.format_retention(records)
