"""Mixed precision for the trainers: one context manager per forward pass."""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16}


def autocast(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``mode`` ('bfloat16') on ``device``'s type, or a no-op for 'off'."""
    if mode == "off":
        return contextlib.nullcontext()
    if mode not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast: {mode!r} is not one of off, {', '.join(AUTOCAST_DTYPES)}")
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[mode])
