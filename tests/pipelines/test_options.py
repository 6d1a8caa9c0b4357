"""hf_wide/pipelines/options.py: what each check of the pipelines' options takes and refuses, without a model."""

import numpy as np
import pytest
import torch

from hf_wide.pipelines.options import SEED_LIMIT, positive_temperature, sampling_seed, whole_number


@pytest.mark.parametrize("value, least, takes", [
    (1, 1, True), (np.int64(3), 1, True), (0, 0, True), (0, 1, False), (-3, 1, False), (2.0, 1, False),
    (True, 1, False), ("2", 1, False), (None, 1, False)])
def test_whole_number(value, least, takes):
    if takes:
        assert whole_number("batch_size", value, least) == value
    else:
        with pytest.raises(ValueError, match=f"batch_size must be a whole number of at least {least}"):
            whole_number("batch_size", value, least)


@pytest.mark.parametrize("value, takes", [(0.5, True), (2, True), (0, False), (-1.0, False), (float("nan"), False),
                                          (float("inf"), False), (True, False), ("1", False)])
def test_positive_temperature(value, takes):
    if takes:
        assert positive_temperature(value) == value
    else:
        with pytest.raises(ValueError, match="temperature must be a positive finite number"):
            positive_temperature(value)


@pytest.mark.parametrize("value, takes", [(0, True), (np.uint64(2**64 - 1), True), (2**64 - 1, True), (2**64, False),
                                          (2**70, False), (-1, False), (1.0, False), (True, False), ("3", False)])
def test_sampling_seed_is_one_torch_takes(value, takes):
    # 2**64 and more passed, and torch's "Overflow when unpacking long long" named no option
    if takes:
        assert sampling_seed(value) == value
    else:
        with pytest.raises(ValueError, match=r"seed must be a whole number from 0 to 2\*\*64 - 1"):
            sampling_seed(value)


def test_the_seed_limit_is_torchs():
    torch.Generator().manual_seed(SEED_LIMIT - 1)
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        torch.Generator().manual_seed(SEED_LIMIT)
