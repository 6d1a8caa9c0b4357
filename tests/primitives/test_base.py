"""hf_wide/primitives/base.py: when two members' attribute values count as the same."""

import functools

import torch
from torch import nn

from hf_wide.primitives.base import same_value


def test_the_very_tensor_is_the_same_without_reading_its_values():
    t = torch.empty(4, 4, device="meta")  # no values to read: comparing them would fail
    assert same_value(t, t)
    nan = torch.full((3,), float("nan"))
    assert same_value(nan, nan) and not same_value(nan, nan.clone())  # NaN equals nothing, not even its copy


def test_tensors_compare_by_shape_dtype_and_values():
    t = torch.arange(6.0)
    assert same_value(t, t.clone())
    assert not same_value(t, t.double()) and not same_value(t, t.view(2, 3)) and not same_value(t, t + 1)
    assert not same_value(t, 0.0) and not same_value(None, t)


def test_functions_bound_to_each_members_module_compare_by_what_they_run():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert same_value(a.forward, b.forward) and not same_value(a.forward, nn.ReLU().forward)
    assert same_value(functools.partial(a.forward, 1), functools.partial(b.forward, 1))
    assert not same_value(functools.partial(a.forward, 1), functools.partial(b.forward, 2))
