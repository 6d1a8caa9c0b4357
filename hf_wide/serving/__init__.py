"""Serving: an ensemble endpoint that Hugging Face clients can call, on Ray Serve (``hf-wide serve``).

:mod:`.payloads` and :mod:`.tasks` read and write the Inference API's payloads (no server code); :mod:`.app` is the Ray Serve
application (``build_app``); :func:`serve` runs it until interrupted. Ray is an extra:
``pip install "hf-wide[serve]"``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator, Sequence

INSTALL = 'hf-wide serve needs Ray Serve: pip install "hf-wide[serve]" (or: pip install "ray[serve]")'


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
          port: int = 8000, address: str | None = None, blocking: bool = True, **kwargs):
    """Start Ray (a local instance, or join the cluster at ``address``), run the application on
    ``host:port`` and, with ``blocking``, serve until Ctrl-C or SIGTERM (what ``docker stop`` and Kubernetes
    send), then shut Serve (and a local Ray) down."""
    require_ray()
    import ray
    from ray import serve as ray_serve

    app = build_app(model_ids, task, **kwargs)
    local = address is None
    if local:
        ray.init(include_dashboard=False, logging_level="ERROR")
    else:
        ray.init(address=address)
    try:
        with _sigterm_as_interrupt():  # loading the model included: it may take minutes
            ray_serve.start(http_options={"host": host, "port": port})
            ray_serve.run(app, name="hf-wide", route_prefix="/")  # returns once the replicas have loaded the model
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
