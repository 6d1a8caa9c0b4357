"""CPU allocator tuning: applied once on glibc, skipped where another allocator is preloaded, reported, and
done by the command line unless --default-allocator. Run in subprocesses: the setting is process-wide."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import hf_wide.cpu as cpu
before = cpu.allocator_state()
print(cpu.tune_cpu_allocator(), cpu.tune_cpu_allocator())
print(before)
print(cpu.allocator_state())
"""


def run(code: str, **env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_tuning_applies_once_on_glibc_and_is_reported():
    applied, before, after = run(SCRIPT)
    assert applied == "True True"
    assert "defaults" in before and "tuned" in after


def test_a_preloaded_allocator_is_left_alone():
    applied, _, after = run(SCRIPT, LD_PRELOAD=os.environ.get("LD_PRELOAD", "") + " libjemalloc.so.2")
    assert applied == "False False"
    assert after == "jemalloc (LD_PRELOAD)"


@pytest.mark.parametrize("flag, state", [([], "tuned"), (["--default-allocator"], "defaults")])
def test_the_command_line_tunes_unless_asked_not_to(flag, state):
    code = ("import sys, hf_wide.cli as cli, hf_wide.cpu as cpu\n"
            "cli._trace = lambda args: print(cpu.allocator_state()) or 0\n"
            f"sys.exit(cli.main({flag!r} + ['trace', 'unused']))")
    assert state in run(code)[-1]


def test_peak_rss_is_the_peak_in_bytes():
    """In a fresh process: at least what is resident now, and it grows by a 256 MiB buffer touched, then freed."""
    code = """
import torch
from hf_wide.cpu import peak_rss
def resident():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
before = peak_rss()
assert before >= resident() > 0, (before, resident())
x = torch.ones(64 * 2**20)  # 256 MiB, written
del x
print(peak_rss() - before)
"""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("VmRSS comes from /proc (Linux)")
    (grown,) = run(code)
    assert int(grown) >= 250 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
@pytest.mark.parametrize("tuned", [False, True])
def test_freed_memory_goes_back_to_the_system_unless_the_allocator_keeps_it(tuned):
    """64 MiB of small tensors freed below one still alive stay in glibc's heap (its top cannot shrink) until
    ``release_freed_memory`` trims it; after ``tune_cpu_allocator`` (keep what is freed) it leaves them."""
    code = f"""
import torch
import hf_wide.cpu as cpu
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
if {tuned}:
    cpu.tune_cpu_allocator()
small = [torch.ones(1000) for _ in range(16_000)]  # 4 KB each, from the heap
pin = torch.ones(1000)
del small
before = anon()
cpu.release_freed_memory()
print(before - anon())
"""
    (released,) = run(code)
    if tuned:
        assert int(released) < 8 * 2**20
    else:
        assert int(released) >= 48 * 2**20
