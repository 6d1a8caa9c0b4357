"""``hf-wide benchmark --pipeline`` on a few texts and tokens: valid JSON, results checked against the baselines."""

import json

from hf_wide.benchmark.pipeline import run_pipeline_benchmark


def test_small_pipeline_benchmark_writes_checked_records(tmp_path, capsys):
    path = tmp_path / "pipe.json"
    records = run_pipeline_benchmark(texts=40, new_tokens=3, batches=(2,), unbatched=False, repeats=1,
                                     json_path=str(path))
    assert json.loads(path.read_text())["records"] == json.loads(json.dumps(records))
    classification, decoding = records
    assert classification["member_labels_match"] == 1.0  # eager and compiled members = transformers pipelines
    assert classification["ours_speedup_vs_batched"] > 0
    for name in ("ours", "ours_compiled", "transformers_batched"):
        assert classification[f"{name}_s"] > 0
    assert decoding["same_tokens"] is True and decoding["batch"] == 2 and decoding["speedup"] > 0
    assert all(r["cpu_allocator"] and r["threads"] >= 1 for r in records)
    out = capsys.readouterr().out
    assert "text-classification" in out and "ensemble decoding" in out
