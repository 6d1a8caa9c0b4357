"""Shared fixtures: the family table on sys.path, and fused models built once per case; how the tests share out
over pytest-xdist's workers (``make test`` runs two)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from families import FAMILIES  # noqa: E402

from hf_wide import WideModel  # noqa: E402

CASES = {case.id: case for case in FAMILIES}
NUM_MEMBERS = 3


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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Each test module's tests run on one worker (its module fixtures are built once); the modules that start
    Ray mark themselves ``xdist_group("ray")``, so they run one after another on one worker (one cluster at a time)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
