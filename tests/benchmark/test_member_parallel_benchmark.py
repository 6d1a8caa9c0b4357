"""hf_wide/benchmark/member_parallel.py: the torchrun-launched measurement reports every rank, and each rank of
K = 2 holds its slice's share of the parameters."""

from hf_wide.benchmark.member_parallel import run


def test_the_report_for_one_and_two_ranks():
    report = run(ranks=(1, 2), num_members=3, hidden=64, layers=1, batch=2, seq=8, repeats=1)
    one, two = report["ranks"]["1"], report["ranks"]["2"]
    assert [r["members"] for r in one["per_rank"]] == [[0, 1, 2]]
    assert [r["members"] for r in two["per_rank"]] == [[0, 1], [2]]
    whole = one["per_rank"][0]["parameter_bytes"]
    split = [r["parameter_bytes"] for r in two["per_rank"]]
    assert split[1] < split[0] < whole and sum(split) >= whole  # each its share (shared tensors: on every rank)
    for r in (*one["per_rank"], *two["per_rank"]):
        assert r["output_shape"][:2] == [3, 2] and r["forward_ms"] > 0 and r["load_s"] > 0
