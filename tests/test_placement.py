"""hf_wide/placement.py: the one device and the dtype a load asks for, refused at once where hf-wide cannot honour
them."""

import pytest
import torch

from hf_wide.placement import resolve_device, resolve_dtype


def test_device_and_device_map():
    assert resolve_device() is None
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(device_map={"": "cpu"}) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(device_map="auto").type == expected
    with pytest.raises(NotImplementedError, match="one device"):
        resolve_device(device_map={"bert": "cpu", "classifier": "cpu"})
    for spread in ("balanced", "balanced_low_0", "sequential"):  # (read as device types: torch's error)
        with pytest.raises(NotImplementedError, match=f"device_map='{spread}' spreads the model over devices"):
            resolve_device(device_map=spread)
    with pytest.raises(ValueError, match="not both"):
        resolve_device("cpu", "auto")
    if not torch.backends.mps.is_available():  # refused at once (it failed after the members were read and traced)
        with pytest.raises(ValueError, match="device 'mps' cannot be used here"):
            resolve_device(device_map="mps")


def test_dtype_names_and_dtypes():
    assert resolve_dtype(None) is None and resolve_dtype("auto") == "auto"
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.float16) is torch.float16
    for bad in ("float8", torch.int8):
        with pytest.raises(ValueError, match="Unsupported dtype"):
            resolve_dtype(bad)
