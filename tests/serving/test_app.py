"""hf_wide/serving/app.py in this process: which route a request's path names under the application's prefix
(over HTTP, with Ray Serve: tests/serving/test_server.py)."""

import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402

from hf_wide.serving.app import route_of  # noqa: E402


def request(path: str, root_path: str = "") -> Request:
    return Request({"type": "http", "method": "POST", "path": path, "root_path": root_path, "headers": []})


@pytest.mark.parametrize("path, root, route", [
    ("/", "", "/"),
    ("/health", "", "/health"),
    ("/info/", "", "/info"),
    ("/ens", "/ens", "/"),  # the prefix itself: curl posts it without a slash
    ("/ens/", "/ens", "/"),  # InferenceClient(base_url=".../ens") posts it with one
    ("/ens/health", "/ens", "/health"),
    ("/ens/nowhere", "/ens", "/nowhere"),
    ("/health", "/ens", "/health"),  # a path given relative to the prefix
    ("/ensemble/info", "/ens", "/ensemble/info"),  # not under the prefix, only starting like it
    ("/health", "/", "/health"),  # the prefix /
    ("/ens/info", "/ens/", "/info"),
])
def test_route_below_the_prefix(path, root, route):
    assert route_of(request(path, root)) == route
