"""The dtype and the one device a load asks for (:func:`resolve_dtype`, :func:`resolve_device`): refused before
anything is downloaded or read where hf-wide cannot honour them."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """``None`` or "auto" (as saved), or one of :data:`DTYPES` given as a name or a ``torch.dtype``."""
    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
    elif dtype in DTYPES.values():
        return dtype
    raise ValueError(f"Unsupported dtype {dtype!r}: use one of {', '.join(DTYPES)}, 'auto' or None.")


def resolve_device(device=None, device_map=None) -> torch.device | None:
    """The one device the wide model goes to. The members are folded into each layer, so a layer cannot be split
    across devices: ``device_map`` is "auto" (the first accelerator, else the CPU), a device, or ``{"": device}``."""
    if device_map is None:
        return None if device is None else _available(torch.device(device))
    if device is not None:
        raise ValueError("Pass device= or device_map=, not both.")
    if device_map == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return torch.device(accelerator.type, 0) if accelerator is not None else torch.device("cpu")
    if device_map in ("balanced", "balanced_low_0", "sequential"):  # (torch read them as device types)
        raise NotImplementedError(
            f"device_map={device_map!r} spreads the model over devices; hf-wide keeps the wide model on one device "
            "(every layer holds all members). Use device_map='auto' or {'': device}, or member_parallel=True.")
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise NotImplementedError(
                f"device_map {device_map!r} splits the model across devices; hf-wide keeps the wide model on one "
                "device (every layer holds all members). Use device_map='auto' or {'': device}."
            )
        device_map = device_map[""]
    return _available(torch.device(device_map))


def _available(device: torch.device) -> torch.device:
    """``device``, once a tensor can be made on it: one this build or machine lacks (MPS on Linux, CUDA in a CPU
    build) is refused before anything loads, not after the members are read and traced."""
    if device.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError, NotImplementedError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]
            raise ValueError(f"device {str(device)!r} cannot be used here: {reason}") from None
    return device
