"""Shared fixtures: the family table on sys.path, and fused models built once per case; how the tests share out
over pytest-xdist's workers (``make test`` runs two)."""

import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# Each pytest-xdist worker's torch (and the processes it starts) takes its share of the cores, set before torch is
# imported: two workers of two OpenMP threads each on a 2-core machine wait on one another's cores (test_model and
# test_architectures ran 25-33% slower so).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

# Plans of adapter lists are cached on disk (hf_wide.plan_cache): here under a folder of the run's own, which the
# processes the tests start inherit, and a folder of each test's own within the test (below), so that a test traces
# what it loads unless it loads it twice itself.
os.environ.setdefault("HF_WIDE_PLAN_CACHE", tempfile.mkdtemp(prefix="hf-wide-plans-"))

from families import FAMILIES  # noqa: E402

from hf_wide import WideModel, fuse, planner, sample_trace  # noqa: E402

CASES = {case.id: case for case in FAMILIES}
NUM_MEMBERS = 3


@pytest.fixture(autouse=True)
def plan_cache(tmp_path_factory, monkeypatch):
    """This test's own cache of plans (hf_wide.plan_cache), empty at its start."""
    folder = tmp_path_factory.mktemp("plans")
    monkeypatch.setenv("HF_WIDE_PLAN_CACHE", str(folder))
    return folder


@pytest.fixture
def traces(monkeypatch):
    """The traces hf-wide takes (:func:`hf_wide.sample_trace.trace_members`), counted."""
    taken, trace = [], sample_trace.trace_members

    def counted(*args, **kwargs):
        taken.append(type(args[0]).__name__)
        return trace(*args, **kwargs)

    monkeypatch.setattr(sample_trace, "trace_members", counted)  # (trace_ahead's)
    monkeypatch.setattr(fuse, "trace_members", counted)
    monkeypatch.setattr(planner, "trace_members", counted)  # (plan_members': full checkpoints, streamed)
    return taken


@pytest.fixture(scope="session")
def fused():
    """fused(case_id) -> (members, wide), built once per session."""
    cache = {}

    def get(case_id: str):
        if case_id not in cache:
            case = CASES[case_id]
            members = [case.build(seed) for seed in range(NUM_MEMBERS)]
            cache[case_id] = (members, WideModel.from_models(members))
        return cache[case_id]

    return get


# The modules that start Ray (a local cluster, a Serve app, `hf-wide serve`): one at a time, on one worker.
RAY_MODULES = {"tests/serving/test_server.py", "tests/serving/test_serve_cli.py",
               "tests/benchmark/test_serve_benchmark.py"}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: run without xdist, nothing calls it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (each module on one worker: its module fixtures built once), with the Ray modules as one
    file. (xdist's ``loadgroup`` would do this from marks, but with pytest 9.2 it silently stops grouping:
    pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneRayModuleAtATime(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if module in RAY_MODULES else module

    return OneRayModuleAtATime(config, log)
