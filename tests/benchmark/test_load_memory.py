"""hf_wide/benchmark/load_memory.py: the peak-memory figures of loading, on tiny checkpoints (the figures
themselves are the benchmark's to report, not a test's)."""

import mmap
import time

import pytest

from hf_wide.benchmark.load_memory import HeldPeak, _format, mapped_bytes, measure_load_memory

pytest.importorskip("peft")


def test_adapters_alone_are_measured_against_the_base_and_the_adapters(tmp_path):
    """``adapters``: hf-wide's load of them; ``traced``: PEFT's own, the reference, with one trace. (``unverified``
    and ``peft`` are these two with an option left out; each mode is two fresh processes, 10-15 s here.)"""
    modes = ("adapters", "traced")
    report = measure_load_memory(2, hidden=32, layers=1, vocab=100, modes=modes, folder=str(tmp_path))
    assert set(report["loads"]) == set(modes) and "fused_bytes" not in report
    assert not (tmp_path / "member-0").exists()  # no full checkpoints written for adapters alone
    assert report["base_and_adapters_bytes"] > 0
    assert "LoRA adapters" in _format(report) and "fused model " not in _format(report)
    for load in report["loads"].values():
        assert load["peak"] > report["baseline_peak"] and load["over_warm"] >= 0
        assert load["ratio"] == pytest.approx(load["over_baseline"] / report["base_and_adapters_bytes"])
        # held: the base kept mapped counts whole, read or not
        assert load["held"] >= max(load["anonymous"], (tmp_path / "base" / "model.safetensors").stat().st_size)
        assert load["ratio_held"] == pytest.approx(load["held"] / report["base_and_adapters_bytes"])


@pytest.mark.parametrize("first, again", [("adapters", "cached"), ("members", "again")])
def test_each_load_is_a_first_one_but_the_loads_again(tmp_path, monkeypatch, first, again):
    """Each child loads with a plan cache of its own, empty (a first load, traced), but ``cached``'s two (adapters)
    and ``again``'s (full members), which share the one a first load of the same members filled before them
    (hf_wide.plan_cache)."""
    from hf_wide.benchmark import load_memory

    calls = []

    def child(mode, warmup, root, paths, plans):
        calls.append((mode, paths, plans))
        return {"peak": 2, "warm": 1, "anonymous": 1, "held": 1, "fused_bytes": 1}

    monkeypatch.setattr(load_memory, "_run_child", child)
    measure_load_memory(2, hidden=32, layers=1, vocab=100, modes=(first, again), folder=str(tmp_path))
    (_, _, baseline), *loads = calls
    assert [mode for mode, _, _ in loads] == [first, first, first, again, again]
    assert len({tuple(paths) for _, paths, _ in loads}) == 1  # the same members, each time
    firsts, primed = [plans for _, _, plans in loads[:2]], [plans for _, _, plans in loads[2:]]
    assert len({baseline, *firsts, primed[0]}) == 4 and primed == [primed[0]] * 3


def test_mapped_files_count_whole_and_once(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 3 * mmap.PAGESIZE)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.bin").write_bytes(b"y" * mmap.PAGESIZE)
    assert mapped_bytes(tmp_path / "elsewhere") == 0
    with open(tmp_path / "a.bin", "rb") as f, open(tmp_path / "elsewhere" / "b.bin", "rb") as g:
        first, second = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) for _ in range(2))
        other = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)  # none of its pages read
        assert mapped_bytes(tmp_path / "elsewhere") == mmap.PAGESIZE
        assert mapped_bytes(tmp_path) == 4 * mmap.PAGESIZE  # a.bin mapped twice counts once
        for m in (first, second, other):
            m.close()
    assert mapped_bytes(tmp_path) == 0


def test_held_peak_sees_what_a_block_allocates_and_frees(tmp_path):
    with HeldPeak(str(tmp_path)) as held:
        # 64 MiB of anonymous pages of its own, written: resident, whatever malloc keeps (a tensor could reuse
        # freed heap a test before it left when hf_wide.cpu.tune_cpu_allocator ran in this worker)
        block = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for offset in range(0, len(block), mmap.PAGESIZE):
            block[offset] = 1
        deadline = time.monotonic() + 60  # the sampler's turn, however busy the machine
        while held.anonymous < 60 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        block.close()
    assert held.anonymous >= 60 << 20 and held.held >= held.anonymous
