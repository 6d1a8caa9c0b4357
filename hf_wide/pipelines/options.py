"""Checks of the pipelines' options: a number that must be whole, a temperature that must be a positive finite number."""

from __future__ import annotations

import math
import numbers
import operator


def positive_temperature(value) -> float:
    """``temperature=``, refused unless a positive finite number (a NaN passed ``<= 0``, and every score came back
    NaN; a string raised a bare TypeError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"temperature must be a positive finite number, got {value!r}.")
    return float(value)


def whole_number(name: str, value, least: int = 1) -> int:
    """``value`` of the option ``name``, refused unless it is a whole number of at least ``least``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # an int, or numpy's
    except TypeError:
        number = None
    if number is None or number < least:
        raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}.")
    return number
