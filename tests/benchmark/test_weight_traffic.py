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
    assert "weight traffic" in weight_traffic.format_record(record)
    monkeypatch.setattr(weight_traffic, "CONFIGS", [("bert", 64, 2, 1, 8)])
    path = tmp_path / "wt.json"
    assert weight_traffic.main(["--no-compile", "--target-s", "0.01", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["records"][0]["n"] == 2
    assert "fusion" in capsys.readouterr().out
