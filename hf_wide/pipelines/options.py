"""Checks of the pipelines' options: a number that must be whole, a temperature that must be a positive finite number,
a sampling seed that torch's generators take."""

from __future__ import annotations

import math
import numbers
import operator

SEED_LIMIT = 2**64  # torch's manual_seed takes 0 <= seed < 2**64 (one 64-bit word)


def positive_temperature(value) -> float:
    """``temperature=``, refused unless a positive finite number (a NaN passed ``<= 0``, and every score came back
    NaN; a string raised a bare TypeError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"temperature must be a positive finite number, got {value!r}.")
    return float(value)


def whole_number(name: str, value, least: int = 1) -> int:
    """``value`` of the option ``name``, refused unless it is a whole number of at least ``least``."""
    number = _whole(value)
    if number is None or number < least:
        raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}.")
    return number


def sampling_seed(value) -> int:
    """``seed=``, refused unless torch's generators take it: a whole number from 0 to 2**64 - 1 (a larger one got as
    far as ``manual_seed``, whose "Overflow when unpacking long long" names no option)."""
    number = _whole(value)
    if number is None or not 0 <= number < SEED_LIMIT:
        raise ValueError(f"seed must be a whole number from 0 to 2**64 - 1 (what torch's generators take), "
                         f"got {value!r}.")
    return number


def _whole(value) -> int | None:
    """``value`` as an int if it is one (numpy's too), else None (True and False included)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
