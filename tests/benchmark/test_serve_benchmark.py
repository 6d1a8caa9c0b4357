"""hf_wide/benchmark/serve.py: the load test's ways, tiny (the figures are the benchmark's to report)."""

import pytest

pytest.importorskip("ray.serve")

from hf_wide.benchmark.serve import WAYS, run  # noqa: E402
from ports import free_port  # noqa: E402


def test_every_way_answers_every_request_right():
    report = run(num_requests=24, clients=4, num_members=2, hidden=32, max_batch_size=4, port=free_port(), num_cpus=2)
    assert set(report["ways"]) == set(WAYS) and report["num_cpus"] == 2  # every way's replica reserves two
    for way, r in report["ways"].items():
        assert (r["errors"], r["wrong"]) == (0, 0), (way, r["first_error"])
        assert r["requests_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
        cpu = r["cpu_ms_per_request"]  # each request passed through the proxy to the way's replica, from here
        assert cpu["proxy"] > 0 and cpu["replica"] > 0 and cpu["clients"] > 0, (way, cpu)
    assert report["wide_over_members"] > 0 and report["wide_over_members_batched"] > 0
    assert [f["batch"][0] for f in report["forward_alone"]] == [1, 4]  # 1, 4, 8 and the clients, up to the clients
    assert all(f["wide_ms"] > 0 and f["members_over_wide"] > 0 for f in report["forward_alone"])
    assert all(f["wide_padding_free_ms"] > 0 for f in report["forward_alone"])  # BERTs: their encoder packs
    assert all(f["wide_first_tokens_ms"] > 0 for f in report["forward_alone"])  # and their head reads [CLS]
