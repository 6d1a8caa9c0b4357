"""CPU allocator tuning: keep large freed buffers in the process instead of giving them back to the kernel.

PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves large requests (above its mmap
threshold, which adapts up to 32 MiB) with fresh ``mmap``s and returns them on ``free``, and trims the top
of its heap once enough is free at the end of it. A forward over large batches allocates and frees
activations of several MiB per op, so every call faults all of their pages in again: on the 2-core
machine of the benchmark, elementwise ops over 12 MiB tensors ran 3-6x slower per element than over
1.5 MiB ones. A wide model folds N members into one batch, so its activations are N times larger and it
pays this more than N separate models do (measured at 1,024 tokens per member: wide 0.76-0.90x the
speed of the members run one after another with glibc's defaults, 1.01-1.04x with this tuning).

This is the advice of PyTorch's CPU performance guide (use jemalloc or tcmalloc) done with the allocator
already loaded: it is process-wide, so the ``hf-wide`` command line calls :func:`tune_cpu_allocator` and
a library never does it on import. The cost: memory the process freed stays in it (resident at its peak)
rather than going back to the system. :func:`peak_rss` reads that peak (the memory benchmarks report it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Iterator

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_state: dict = {"tuned": False}  # and "trim": glibc's malloc_trim, once looked up


def _preloaded_allocator() -> str | None:
    """jemalloc or tcmalloc when preloaded (they replace malloc, and glibc's options mean nothing)."""
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in os.environ.get("LD_PRELOAD", ""):
            return name
    return None


def tune_cpu_allocator() -> bool:
    """Tell glibc's malloc to serve large blocks from its heap and never to trim it, so freed activations
    are reused by the next forward rather than faulted in again. Process-wide and idempotent; True when
    applied, False where there is nothing to do (not Linux with glibc, or jemalloc/tcmalloc preloaded)."""
    if _state["tuned"]:
        return True
    if not sys.platform.startswith("linux") or _preloaded_allocator():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # No mmap for large blocks (when the heap cannot grow, glibc still falls back to mmap), and no trimming.
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    _state["tuned"] = ok
    return ok


def release_freed_memory() -> None:
    """Give the free pages inside glibc's heap back to the system (``malloc_trim``). Fusing runs in phases (trace,
    plan, record the members, build, verify) whose temporaries are freed into the heap, where the next phase's
    large tensors (served by ``mmap``) cannot reuse them: trimmed between phases they stop adding to the peak
    (4 adapters of a 727 MiB BERT: 16 MiB less). A few milliseconds; nothing where the allocator keeps what is
    freed on purpose (:func:`tune_cpu_allocator`), is preloaded, or is not glibc's."""
    if _state["tuned"] or not sys.platform.startswith("linux") or _preloaded_allocator():
        return
    if "trim" not in _state:
        try:
            trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
        except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
            trim = None
        _state["trim"] = trim
    if _state["trim"] is not None:
        _state["trim"](0)


@contextlib.contextmanager
def collected() -> Iterator[None]:
    """Collect the reference cycles made within the block as it ends (PEFT's module trees hold some, and so does
    ``torch.export``), then give the freed pages back (:func:`release_freed_memory`). What existed before is frozen
    meanwhile, so the collection looks at the block's objects alone (6 ms against 280 over every object of a process
    that traced a BERT); unless the process froze objects itself (before forking its workers, say), which unfreezing
    would undo: then a full collection."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        if freeze:
            gc.unfreeze()
        release_freed_memory()


def allocator_state() -> str:
    """What serves CPU tensors in this process, in words (for benchmark reports)."""
    preloaded = _preloaded_allocator()
    if preloaded:
        return f"{preloaded} (LD_PRELOAD)"
    if _state["tuned"]:
        return "glibc malloc, tuned by hf_wide.tune_cpu_allocator (no mmap for large blocks, no heap trimming)"
    return "the C library's malloc with its defaults"


def peak_rss() -> int:
    """This process's peak resident memory in bytes: ``VmHWM`` on Linux, else ``ru_maxrss`` (KiB on Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
