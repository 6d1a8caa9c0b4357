"""A free port for a server a test starts (Ray Serve, the Space, the benchmark's load test)."""

import random
import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A port nobody listens on, for a server a test starts. Not one the kernel picks (``bind(0)``): that is from its
    ephemeral range, which it hands out again to whatever binds next, and a Ray server's own parts bind many such
    ports as it starts, before its HTTP proxy binds this one (a run met Ray's gRPC on it), as do those of a Ray
    started by a test in the other worker. Below that range and above Ray's worker ports (10002-19999), only an
    explicit bind can take it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) if sys.platform == "linux" else 0
    for port in random.Random().sample(range(20000, low), min(100, max(0, low - 20000))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no such range here: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
