"""Where a load test's CPU time goes, per process group: ``python -m hf_wide.benchmark.serve`` reports it per way.

On one machine the server, Ray's processes and the clients share the cores, so a way's throughput is the cores
over the CPU time each request costs in all of them together. Reading that time per group (Ray Serve's HTTP
proxy, Python or HAProxy; the way's replicas; the clients in this process; Ray's other processes) shows which
part a faster model can shrink and which it cannot.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import psutil

GROUPS = ("proxy", "replica", "clients", "ray_other")


def _group(pid: int, cmdline: str, replica_key: str) -> str | None:
    if pid == os.getpid():
        return "clients"
    if "ProxyActor" in cmdline or "haproxy" in cmdline:  # Ray's Python proxy, or HAProxy (high-throughput mode)
        return "proxy"
    if replica_key in cmdline:
        return "replica"
    if cmdline.startswith("ray::") or "/ray/" in cmdline:
        return "ray_other"  # GCS, raylet, the controller, other ways' idle replicas, ...
    return None


def cpu_seconds(replica_key: str) -> dict[int, tuple[str, float]]:
    """pid -> (group, user + system CPU seconds so far) of every process of a group; ``replica_key`` is what the
    replicas' command lines hold (Ray names them ``ray::ServeReplica:<app>:<deployment>``)."""
    seen = {}
    for process in psutil.process_iter(["cmdline"]):
        try:
            group = _group(process.pid, " ".join(process.info["cmdline"] or ()), replica_key)
            if group == "clients":  # this process: its own clock, in nanoseconds (/proc counts 10 ms ticks, and a
                seen[process.pid] = (group, time.process_time())  # short load's clients spent none of them)
            elif group is not None:
                times = process.cpu_times()
                seen[process.pid] = (group, times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return seen


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each group spent between two :func:`cpu_seconds` readings (processes in both)."""
    out: dict[str, float] = defaultdict(float)
    for pid, (group, seconds) in after.items():
        if pid in before:
            out[group] += seconds - before[pid][1]
    return {group: out[group] for group in GROUPS}
