"""Serving: an ensemble endpoint that Hugging Face clients can call, on Ray Serve (``hf-wide serve``).

:mod:`.payloads` and :mod:`.tasks` read and write the Inference API's payloads (no server code); :mod:`.app` is the Ray Serve
application (``build_app``); :func:`serve` runs it until interrupted. Ray is an extra:
``pip install "hf-wide[serve]"``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)
INSTALL = 'hf-wide serve needs Ray Serve: pip install "hf-wide[serve]" (or: pip install "ray[serve]")'
# How long a batch waits for more requests. Ray Serve opens a batch's window when it takes the batch's first request
# from the queue: under load, once the replica is done with the previous batch (its forward holds the event loop),
# and the requests that came meanwhile are in it already. The window is then time the replica waits, idle, each
# batch: short, it keeps the replica busy; under light load it is what a lone request waits for company.
BATCH_WAIT_MS = 1.0


# Ray Serve's high-throughput mode (Ray >= 2.55): HAProxy, a load balancer in C, takes the HTTP port and sends each
# request straight to a replica's own HTTP server, in place of Ray's Python proxy; and Serve's throughput settings
# (gRPC between Ray's processes, buffered request logs). Read by Ray's processes when they start: the raylet passes
# its environment on, so it must be set when ray.init starts a local Ray. The replicas' code keeps its own thread
# (the mode's default would run it on the replica's event loop): a batch's forward, minutes of generation say, must
# not hold up the controller's health checks, which would take the replica for dead.
HIGH_THROUGHPUT_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                       "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}
HIGH_THROUGHPUT_HINT = ("a cluster reads it from its own environment: start it with "
                        + " ".join(f"{k}={v}" for k, v in HIGH_THROUGHPUT_ENV.items()) + " before `ray start`.")
# HAProxy's stats page and Prometheus metrics listen on every interface at ports of their own, Ray's defaults unless
# set: a second such server on the machine would find them taken, and its HAProxy would not start.
HAPROXY_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}
# Told to stop, a replica behind HAProxy stays open for a draining period (Ray's default: 30 s), so that a load balancer
# in front can take it out of its list first; the requests in flight are finished either way. A local Ray's HAProxy
# is Serve's own and is told at once: 2 s, unless set. With 30, Ctrl-C or SIGTERM stopped the server in 34 s, past
# the 10 s that `docker stop` waits before it kills.
DRAINING_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def haproxy_ports() -> dict[str, str]:
    """The environment that gives HAProxy's stats and metrics ports: Ray's defaults where they are free, the next
    free port above one where it is taken (by another hf-wide serve, say); a port set in the environment is left as
    it is."""
    ports = {}
    for name, default in HAPROXY_PORTS.items():
        if name in os.environ:
            continue
        port = _next_free(default)
        if port != default:
            logger.warning("Port %d (%s) is taken, by another server in high-throughput mode perhaps: HAProxy "
                           "takes port %d for it.", default, name, port)
        ports[name] = str(port)
    return ports


class PortInUse(OSError):
    """The port to serve on is taken."""


def require_free(host: str, port: int) -> None:
    """Raise :class:`PortInUse` where something listens on ``host:port`` already (another server, say), and a
    ``ValueError`` where it cannot be bound at all (a port past 65535, an address not this machine's), which Ray's
    proxy would meet after starting Ray, with a traceback."""
    if not 0 <= port <= 65535:
        raise ValueError(f"The port must be 0-65535, got {port}.")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:  # bound as a server binds it (SO_REUSEADDR: a socket still closing is no bar)
        with socket.create_server((host, port), family=family):
            pass
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(exc.errno, f"{host}:{port} is in use (another server?)") from None
        raise ValueError(f"Cannot listen on {host}:{port}: {exc.strerror or exc} (is {host} an address of this "
                         "machine?)") from None


def require_cpus(replicas: int, num_cpus: float | None) -> None:
    """A ``ValueError`` where the replicas ask a local Ray for more CPUs than this machine has: Ray would wait for
    them forever, the server never answering."""
    wanted, have = replicas * (1.0 if num_cpus is None else num_cpus), os.cpu_count() or 1
    if wanted > have:
        raise ValueError(f"{replicas} replica(s) x {num_cpus or 1:g} CPU(s) ask Ray for {wanted:g} CPUs, and this "
                         f"machine has {have}: ask for fewer (--replicas, --num-cpus).")


def _bindable(port: int) -> bool:
    try:
        require_free("0.0.0.0", port)  # where HAProxy binds them
    except PortInUse:
        return False
    return True


def _next_free(port: int, tries: int = 100) -> int:
    """``port`` (Ray's default) where it is free, else the first free one above it that is not one of the kernel's
    ephemeral ports: one of those free when probed may be the local end of a connection by the time HAProxy binds it,
    seconds later, Ray's processes starting and connecting to each other meanwhile (so it failed once in CI, "cannot
    bind socket" for port 51277)."""
    low, high = _ephemeral_ports()
    above = range(port + 1, 65536)
    above = [p for p in above if not low <= p <= high] or list(above)  # (all, where every port is ephemeral)
    candidates = [port, *above[:tries - 1]]
    for candidate in candidates:
        if _bindable(candidate):
            return candidate
    raise ValueError(f"Port {port} and the {len(candidates) - 1} tried after it (the system's ephemeral ports left "
                     "out) are in use: set RAY_SERVE_HAPROXY_STATS_PORT and RAY_SERVE_HAPROXY_METRICS_PORT to free "
                     "ones.")


def _ephemeral_ports() -> tuple[int, int]:
    """The range from which the kernel takes the local ports of outgoing connections (Linux's setting; elsewhere the
    IANA range, which macOS and Windows use)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


@contextlib.contextmanager
def ray_environment(high_throughput: bool) -> Iterator[dict[str, str]]:
    """Within it (around ``ray.init`` of a local Ray), the environment of :data:`HIGH_THROUGHPUT_ENV`, of
    :func:`haproxy_ports` and of :data:`DRAINING_ENV` (where not set) if asked; yields what it set."""
    draining = {name: value for name, value in DRAINING_ENV.items() if name not in os.environ}
    values = {**HIGH_THROUGHPUT_ENV, **haproxy_ports(), **draining} if high_throughput else {}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield values
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def require_ray():
    try:
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise ImportError(INSTALL) from exc


def build_app(model_ids: Sequence[str] | str, task: str = "text-classification", **kwargs):
    """The Ray Serve application (see :func:`hf_wide.serving.app.build_app`)."""
    require_ray()
    from .app import build_app as build

    return build(model_ids, task, **kwargs)


def serve(model_ids: Sequence[str] | str, task: str = "text-classification", *, host: str = "127.0.0.1",
          port: int = 8000, address: str | None = None, blocking: bool = True, high_throughput: bool = False,
          ready: Callable[[], None] | None = None, **kwargs):
    """Start Ray (a local instance, or join the cluster at ``address``), run the application on
    ``host:port`` and, with ``blocking``, serve until Ctrl-C or SIGTERM (what ``docker stop`` and Kubernetes
    send), then shut Serve (and a local Ray) down. ``high_throughput``: Ray Serve's high-throughput mode for the
    local Ray (see :data:`HIGH_THROUGHPUT_ENV`; HAProxy's stats and metrics take free ports where Ray's defaults
    are taken: :func:`haproxy_ports`). Raises, for a local Ray before it starts, :class:`PortInUse`,
    :class:`~hf_wide.download.MemberLoadError` (:func:`fetch_members`) and ``ValueError`` (:func:`check_head`), and
    :class:`ServeStartError` with the replicas' own error where they could not load the model. ``ready`` is called
    once the replicas have loaded the model and answer."""
    require_ray()
    import ray
    from ray import serve as ray_serve

    local = address is None
    if high_throughput and not local:
        raise ValueError(f"high_throughput applies to a local Ray, not to one at address={address!r}: "
                         f"{HIGH_THROUGHPUT_HINT}")
    app = build_app(model_ids, task, **kwargs)  # (its options checked before anything is fetched)
    if local:  # what would fail in the replicas, said before Ray starts rather than after their attempts
        require_free(host, port)
        require_cpus(kwargs.get("replicas", 1), kwargs.get("num_cpus"))
        folders = fetch_members(model_ids, kwargs)
        check_head(folders[0], task)
        if not any(map(_has_a_base, folders)):  # the replicas load what is here: one that fails would fail alike again
            retries = {"max_constructor_retry_count": kwargs.get("replicas", 1), **kwargs}  # once each, not thrice
            app = build_app(model_ids, task, **retries)
        with ray_environment(high_throughput):
            ray.init(include_dashboard=False, logging_level="ERROR")
    else:
        ray.init(address=address)
    try:
        with _sigterm_as_interrupt():  # loading the model included: it may take minutes
            ray_serve.start(http_options={"host": host, "port": port})
            try:
                ray_serve.run(app, name="hf-wide", route_prefix="/")  # returns once the replicas loaded the model
            except RuntimeError as exc:  # Ray's "Deploying application hf-wide failed": say why
                reason = _replica_failure(ray_serve)
                if reason is None:
                    raise
                raise ServeStartError(f"The replicas could not load the model: {reason}") from exc
            if ready is not None:
                ready()
            if not blocking:
                return app
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    except BaseException:  # the model did not load, say: nothing left running
        _stop(ray, ray_serve, local)
        raise
    _stop(ray, ray_serve, local)
    return app


class ServeStartError(RuntimeError):
    """The application did not start: its replicas failed to load the model (the message says why)."""


def fetch_members(model_ids: Sequence[str] | str, options: dict) -> list[Path]:
    """Fetch every member here, with ``options``' revision, subfolder, token and download options: a local Ray's
    replicas then find them in the cache, and a typo, a private repo without a token or a revision or subfolder that
    is not there is a :class:`~hf_wide.download.MemberLoadError` now, rather than each replica's failure in turn.
    Returns their folders."""
    from ..download import HUB_KWARGS, as_ids, download_members

    hub_kwargs = {k: v for k, v in (options.get("model_kwargs") or {}).items() if k in HUB_KWARGS}
    if options.get("token") is not None:
        hub_kwargs["token"] = options["token"]
    ids = as_ids(model_ids)
    allow_pickle = bool((options.get("model_kwargs") or {}).get("allow_pickle", False))
    subfolder = options.get("subfolder") or (options.get("model_kwargs") or {}).get("subfolder")
    return download_members(ids, options.get("revision"), subfolder=subfolder, allow_pickle=allow_pickle,
                            **hub_kwargs)


def check_head(folder: Path, task: str) -> None:
    """A ``ValueError`` where the members' class (the ``architectures`` of the first one's config) has another task's
    head, as the task's pipeline would refuse it in each replica (:func:`hf_wide.pipelines.heads.head_refusal`).
    Adapters, which have no config of their own, are checked there."""
    from ..pipelines import TASKS
    from ..pipelines.heads import class_refusal

    config = Path(folder) / "config.json"
    if not config.is_file():
        return
    architectures = json.loads(config.read_text()).get("architectures") or []
    refusal = class_refusal(architectures[0], task, TASKS[task].heads) if len(architectures) == 1 else None
    if refusal is not None:
        raise ValueError(refusal)


def _has_a_base(folder: Path) -> bool:
    """Whether ``folder`` holds PEFT adapters, or a saved ensemble of them: the replicas fetch their base."""
    from ..adapters import adapter_config
    from ..saving import read_section

    return adapter_config(folder) is not None or "adapters" in (read_section(folder) or {})


def _replica_failure(ray_serve) -> str | None:
    """The exception a replica's constructor raised (the end of its traceback, in the deployment's status)."""
    try:
        app = ray_serve.status().applications.get("hf-wide")
    except Exception:  # the status itself unavailable: Ray's own error stands
        return None
    for deployment in (app.deployments.values() if app is not None else ()):
        lines = (deployment.message or "").strip().splitlines()
        indented = [i for i, line in enumerate(lines) if line.startswith(" ")]  # the traceback's frames
        reason = "\n".join(lines[indented[-1] + 1:] if indented else lines).strip()
        if reason:
            return reason
    return None


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Within it, SIGTERM stops the server as Ctrl-C does (its default would end the process at once, leaving a
    local Ray's processes behind). Only the main thread can set a handler; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(ray, ray_serve, local: bool) -> None:
    ray_serve.shutdown()
    if local:
        ray.shutdown()
