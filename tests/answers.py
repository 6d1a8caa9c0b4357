"""Comparing pipelines' answers (nested dicts and lists of labels, texts and floats) across ways of computing them."""

import pytest


def close(got, expected, tol: float = 1e-6) -> bool:
    """Nested answers equal: the same keys, labels, texts and lengths, floats within ``tol`` (another batch
    shape, a padded length or another number of members in a process changes the last bits)."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and got.keys() == expected.keys() and all(
            close(got[k], expected[k], tol) for k in expected)
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(
            close(g, e, tol) for g, e in zip(got, expected))
    if isinstance(expected, float):
        return got == pytest.approx(expected, abs=tol)
    return got == expected
